"""A driven run's checkpoint ledger: the records of the checkpoints its jobs wrote, their
retention, the deletion of the files retention drops, the points a new job may resume from,
and the note people read about checkpoints in the run's detail.

Invariants:

- Every checkpoint a trainer reports is recorded once through ``Store.add_checkpoint``, which
  applies the run's retention (``keep_of``) and returns the episodes it dropped; their files
  are deleted in the background, and a file that cannot be deleted is logged, never raised.
- ``run.checkpoint_episode`` only grows.
- A record the store cannot take is logged and the run goes on (the trainer keeps the file);
  ``NotOwner`` propagates: another replica records what it sees.
- ``note`` is the last thing checkpoints did; a later successful record clears a failed write's
  note.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.core.checkpoints import CheckpointFiles, keep_of, record_of, resume_points
from gateway.core.forks import ForkNotRestored, fork_resume_point
from gateway.core.runs import TrainingRun
from gateway.core.store import Store, StoreWriteFailed
from gateway.core.trainers import (
    Cancelled,
    CheckpointFailed,
    CheckpointSaved,
    Resumed,
    ResumePoint,
)

_LOGGER = logging.getLogger(__name__)

_FAILED_WRITE = "the checkpoint at episode"


class CheckpointLedger:
    """The checkpoints of one driven run (see the module docstring).

    Args:
        run: The run (the ledger writes only its ``checkpoint_episode``).
        store: Where records go.
        files: The checkpoint store's files (None: records are kept, files never deleted).
        spawn: Keeps a background task referenced until it is done.
    """

    def __init__(
        self,
        run: TrainingRun,
        store: Store,
        files: CheckpointFiles | None,
        spawn: Callable[[Awaitable[None], str], None],
    ) -> None:
        self._run = run
        self._store = store
        self._files = files
        self._spawn = spawn
        #: For people: the last thing checkpoints did (a resume, a skipped or failed one).
        self.note = ""

    async def saved(self, saved: CheckpointSaved) -> None:
        """Records a checkpoint the trainer wrote and deletes what retention drops.

        Raises:
            NotOwner: another replica owns the run now.
        """
        run = self._run
        record = record_of(run.id, saved)
        try:
            dropped = await self._store.add_checkpoint(record, keep_of(run.config))
        except StoreWriteFailed as exc:
            _LOGGER.error(
                "run %s: could not record its checkpoint at episode %d: %s",
                run.id,
                saved.episode,
                exc,
                extra={"run_id": run.id},
            )
            return
        run.checkpointed(saved.episode)
        if self.note.startswith(_FAILED_WRITE):
            self.note = ""  # superseded by this one
        _LOGGER.info(
            "run %s: checkpoint at episode %d (%d bytes)",
            run.id,
            saved.episode,
            saved.size_bytes,
            extra={"run_id": run.id, "event": "checkpoint", "episode": saved.episode},
        )
        if dropped:
            self._spawn(self._delete_files(dropped), f"gateway-retention-{run.id}")

    def failed(self, failed: CheckpointFailed) -> None:
        """A checkpoint could not be written: noted for the run's detail; training goes on."""
        self.note = f"{_FAILED_WRITE} {failed.episode} could not be written: {failed.message}"
        _LOGGER.error(
            "run %s: %s",
            self._run.id,
            self.note,
            extra={"run_id": self._run.id, "event": "checkpoint_failed"},
        )

    async def resume_points(self) -> list[ResumePoint]:
        """The checkpoints the run may continue from, newest first (a fork's last: the
        parent's it was forked from)."""
        records = await self._store.list_checkpoints(self._run.id)
        points = resume_points(records, self._run.trainer_episode)
        fork = await fork_resume_point(self._store, self._run)
        return points if fork is None else [*points, fork]

    async def _delete_files(self, episodes: list[int]) -> None:
        files = self._files
        if files is None:
            return
        for episode in episodes:
            try:
                await asyncio.to_thread(files.delete, self._run.id, episode)
            except Exception as exc:
                _LOGGER.warning(
                    "run %s: could not delete its checkpoint at episode %d from %s: %s",
                    self._run.id,
                    episode,
                    files.location,
                    exc,
                    extra={"run_id": self._run.id},
                )

    async def parked(self, outcome: Cancelled) -> None:
        """The parking job's final checkpoint is recorded, or its failure said in the note.

        Raises:
            NotOwner: another replica owns the run now.
        """
        if outcome.checkpoint is not None:
            await self.saved(outcome.checkpoint)
        elif outcome.checkpoint_error:
            why = outcome.checkpoint_error
            self.note = f"the parking checkpoint could not be written: {why}"

    async def for_new_job(self) -> list[ResumePoint]:
        """What a new job of the run starts from: nothing for a run that has received no
        episode, else its resume points (newest first).

        Raises:
            ForkNotRestored: a fork whose checkpoints are all gone (it would train from
                scratch).
        """
        run = self._run
        if not run.trainer_episode:
            return []
        points = await self.resume_points()
        if not points and run.fork_run_id:
            gone = "that checkpoint is gone (deleted with its run or by its retention)"
            raise ForkNotRestored(run, gone)
        return points

    def resumed(self, resumed: Resumed) -> int:
        """Notes where a job placed again started from, and what it skipped; returns the
        episode of the checkpoint it restored (0: none).

        Raises:
            ForkNotRestored: a fork's job restored none of its checkpoints (it would train
                from scratch).
        """
        run = self._run
        skipped = "; ".join(
            f"skipped the checkpoint at episode {e} ({why})" for e, why in resumed.skipped
        )
        if run.fork_run_id and not resumed.episode:
            reasons = "; ".join(f"episode {e}: {why}" for e, why in resumed.skipped)
            raise ForkNotRestored(run, f"no checkpoint restored ({reasons or 'none given'})")
        start = (
            f"continued from the checkpoint at episode {resumed.episode}"
            if resumed.episode
            else "started again from scratch (no checkpoint restored)"
        )
        self.note = f"{start}; {skipped}" if skipped else start
        log = _LOGGER.warning if resumed.skipped else _LOGGER.info
        log(
            "run %s: %s",
            run.id,
            self.note,
            extra={"run_id": run.id, "event": "resumed", "episode": resumed.episode},
        )
        return resumed.episode
