"""One attempt at a run's job: one placement on trainers and everything it holds.

A ``JobAttempt`` is made each time the scheduler places a run (or a gateway restart re-attaches
its job). It owns what that placement holds, and nothing outlives it:

- the placement (rank 0's trainer first) and the scheduler's reservation of each share's slots
  until that share answers (``release``);
- the stream task and its ``TrainerFeed``;
- the other trainers' shares (``JobShares``) of a job that spans trainers;
- the checkpoints the job was given to resume from, and the one it restored.

How it is let go says what happens to the job: ``cancel_stream`` stops reading (a stop, a park,
a failure: the caller decides about the job), ``keep`` stops reading and leaves every trainer its
job (gateway shutdown, another replica taking the run over), ``cancel_job`` cancels rank 0's job
(with a final checkpoint when asked), ``cancel_shares`` the other trainers'. Every way out ends
the reservations that are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gateway.core.feed import TrainerFeed
from gateway.core.ledger import CheckpointLedger
from gateway.core.placement import JobPlacement, Placement
from gateway.core.runs import TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.shares import JobShares, SharesNotReattached
from gateway.core.store import NotOwner
from gateway.core.trainers import (
    Cancelled,
    CheckpointFailed,
    CheckpointSaved,
    Rendezvous,
    Resumed,
    ResumePoint,
    TrainerConnector,
    TrainerError,
)

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotHooks:
    """What an attempt tells the scheduler about slots."""

    #: A share of ``slots`` on a trainer answered (or gave up): its reservation ends.
    started: Callable[[str, int], None]
    #: A job's share on a trainer ended: a slot may be free there.
    run_ended: Callable[[str], None]


class JobAttempt:
    """One placement of a run's job (see the module docstring).

    Args:
        run_id: The run.
        trainer: Rank 0's trainer.
        placement: Where the job runs (None: a job re-attached after a gateway restart, on
            ``trainer`` alone).
        connector: How to reach trainers.
        settings: Call timeouts.
        slots: The scheduler's ears.
        ledger: The run's checkpoints (the feed's checkpoint events go there).
        answered: Awaited on rank 0's first answer (the run starts, or continues).
    """

    def __init__(
        self,
        run_id: str,
        trainer: str,
        placement: Placement | None,
        connector: TrainerConnector,
        settings: CoreSettings,
        slots: SlotHooks,
        ledger: CheckpointLedger,
        answered: Callable[[], Awaitable[None]],
    ) -> None:
        self.run_id = run_id
        self.trainer = trainer
        self.placement = placement
        self._connector = connector
        self._settings = settings
        self._slots = slots
        self._ledger = ledger
        self._answered = answered
        self._first_answer = True
        #: Slots the scheduler counts as starting, by trainer, until each answers.
        self._reserved: dict[str, int] = (
            {} if placement is None else {s.address: s.processes for s in placement.shares}
        )
        self.task: asyncio.Task[None] | None = None
        #: The other trainers' shares (None: it runs on one trainer, or they were let go).
        self.shares: JobShares | None = None
        #: The checkpoints the job was given, newest first, and the one it restored.
        self.resume_from: list[ResumePoint] = []
        self.restored: ResumePoint | None = None

    def describe(self) -> str:
        """Where its job runs, for people."""
        return self.placement.describe() if self.placement is not None else self.trainer

    def addresses(self) -> tuple[str, ...]:
        """Every trainer of its job, rank 0's first."""
        if self.placement is not None:
            return self.placement.addresses
        return (self.trainer,) if self.trainer else ()

    @property
    def spans(self) -> bool:
        """Whether the job is placed on several trainers."""
        return self.placement is not None and self.placement.spans

    def start(self, driving: Coroutine[Any, Any, None], name: str) -> None:
        """Starts reading the job: ``driving`` becomes its stream task."""
        self.task = asyncio.create_task(driving, name=name)

    def stream_ended(self) -> None:
        """Its stream task is over (it says so itself, on its way out)."""
        self.task = None

    def job_placement(self) -> JobPlacement | None:
        """Rank 0's share of a job that spans trainers (None: one trainer has it all)."""
        placement = self.placement
        return None if placement is None else placement.job_placement(placement.rank0)

    async def stream(
        self,
        run: TrainingRun,
        feed: TrainerFeed,
        attach_after: int | None,
        resume_from: list[ResumePoint],
        opening: Callable[[], int],
        cap: Callable[[], int],
        consume: Callable[[asyncio.Task[None]], Awaitable[None]],
    ) -> None:
        """Runs the job's stream (``TrainerFeed.stream``) to its end; a new job that spans
        trainers starts its other shares on rank 0's rendezvous and fails with any of them. A
        job re-attached after a gateway restart that spans trainers is cancelled instead.

        Raises:
            SharesNotReattached: the re-attached job spanned trainers.
        """
        if attach_after is not None and len(run.trainers) > 1:
            await self._drop_spanning(run.trainers)
        self.resume_from, self.restored = resume_from, None
        placement = self.placement
        if attach_after is None and placement is not None and placement.spans:
            self.shares = JobShares(run, placement, self._connector, self._settings, self)
        streaming = feed.stream(attach_after, opening, cap, consume, resume_from)
        if self.shares is None:
            await streaming
        else:
            await self.shares.run(streaming)

    async def _drop_spanning(self, trainers: tuple[str, ...]) -> None:
        listed = ", ".join(trainers)
        _LOGGER.warning(
            "run %s: its job spans trainers %s; the shares of trainers other than rank 0's "
            "cannot be re-attached, so every share is cancelled",
            self.run_id,
            listed,
            extra={"run_id": self.run_id},
        )
        await asyncio.gather(*(self.cancel_job(address) for address in trainers))
        for address in trainers:
            self._slots.run_ended(address)
        raise SharesNotReattached(
            f"the job of run {self.run_id} spanned trainers {listed}: its shares cannot be "
            "re-attached after a gateway restart"
        )

    # -- the feed's hooks ----------------------------------------------------------------------

    async def answered(self) -> None:
        """Rank 0's trainer answered (every message): its reservation ends; the first answer
        is the driver's."""
        self.release(self.trainer)
        if self.shares is not None:
            self.shares.rank0_answered()
        if self._first_answer:
            self._first_answer = False
            await self._answered()

    async def checkpoint_saved(self, saved: CheckpointSaved) -> None:
        """Records a checkpoint the trainer wrote (``CheckpointLedger.saved``).

        Raises:
            NotOwner: another replica owns the run now.
        """
        await self._ledger.saved(saved)

    def resumed(self, resumed: Resumed) -> None:
        """Notes where the job started from (``CheckpointLedger.resumed``) and which of its
        checkpoints it restored.

        Raises:
            ForkNotRestored: a fork's job restored none of its checkpoints.
        """
        episode = self._ledger.resumed(resumed)
        self.restored = next((p for p in self.resume_from if p.checkpoint.episode == episode), None)

    def rendezvous(self, rendezvous: Rendezvous) -> None:
        """Rank 0's trainer says where the other ranks join its job: the other trainers' shares
        start there, from the one checkpoint rank 0 restored (none when from scratch)."""
        if self.shares is None:
            _LOGGER.warning(
                "run %s: trainer %s announced a rendezvous for a job placed on it alone; ignored",
                self.run_id,
                self.trainer,
                extra={"run_id": self.run_id},
            )
            return
        restored = [] if self.restored is None else [self.restored]
        self.shares.start(rendezvous.address, restored)

    def stream_broke(self, reason: str) -> None:
        """Rank 0's stream broke: a share that fails now fails for want of rank 0."""
        if self.shares is not None:
            self.shares.rank0_broke(reason)

    def checkpoint_failed(self, failed: CheckpointFailed) -> None:
        """A checkpoint could not be written: said in the run's detail; training goes on."""
        self._ledger.failed(failed)

    # -- reservations (and the shares' hooks) ------------------------------------------------

    def release(self, address: str) -> None:
        """The share on ``address`` answered or ended: its reservation ends."""
        slots = self._reserved.pop(address, 0)
        if slots:
            self._slots.started(address, slots)

    def release_all(self) -> None:
        """Ends every reservation that is left."""
        for address in list(self._reserved):
            self.release(address)

    def share_answered(self, address: str) -> None:
        self.release(address)

    def share_ended(self, address: str) -> None:
        self._slots.run_ended(address)

    # -- letting go --------------------------------------------------------------------------

    def quiet(self) -> None:
        """The job ends on purpose now: its shares' failures are only logged."""
        if self.shares is not None:
            self.shares.quiet()

    def take_shares(self) -> JobShares | None:
        """The shares, quieted (their failures are only logged now) and no longer the
        attempt's to cancel."""
        shares, self.shares = self.shares, None
        if shares is not None:
            shares.quiet()
        return shares

    async def cancel_stream(self) -> None:
        """Cancels the stream task (unless it is the caller) and ends the reservations."""
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.release_all()

    async def keep(self) -> None:
        """Stops reading the job and its shares; the trainers keep them."""
        await self.cancel_stream()
        shares, self.shares = self.shares, None
        if shares is not None:
            await shares.stop_watching()

    async def cancel_shares(self) -> None:
        """Cancels every other trainer's share that may still have a job."""
        shares = self.take_shares()
        if shares is not None:
            await shares.cancel()

    async def park(
        self, heartbeat_s: float, parked: Callable[[Cancelled], Awaitable[None]]
    ) -> None:
        """Its job writes a final checkpoint at its last episode and ends (``parked`` is told
        what it wrote), its stream still read so that the run receives every episode up to
        that checkpoint (for up to ``heartbeat_s``); then the other trainers' shares go."""
        task = self.task
        self.quiet()  # the other ranks lose rank 0 on purpose now
        outcome = await self.cancel_job(checkpoint=True)
        if outcome is not None:
            await parked(outcome)
        if task is not None:
            done, _ = await asyncio.wait([task], timeout=heartbeat_s)
            if not done:
                await self.cancel_stream()
        await self.cancel_shares()

    async def stop_job(self, keep: bool) -> None:
        """After a stop: the job writes its final checkpoint (the trained model), recorded
        once rank 0's trainer wrote it, then the other trainers' shares are cancelled. With
        ``keep`` (another replica took the run over meanwhile) the job is left to the new
        owner."""
        if keep:
            await self.keep()
            return
        try:
            outcome = await self.cancel_job(checkpoint=True)
            if outcome is not None and outcome.checkpoint is not None:
                with contextlib.suppress(NotOwner):  # the new owner records what it sees
                    await self._ledger.saved(outcome.checkpoint)
        finally:
            await self.cancel_shares()

    async def cancel(self) -> None:
        """Cancels rank 0's job at once (its trainer was given up on, or the run ended)."""
        await self.cancel_job()

    async def cancel_job(self, trainer: str = "", checkpoint: bool = False) -> Cancelled | None:
        """Cancels the run's job on ``trainer`` (rank 0's by default); with ``checkpoint`` the
        job first writes its final checkpoint. None when the trainer could not be reached (the
        job ends after the trainer's detach grace)."""
        trainer = trainer or self.trainer
        settings = self._settings
        timeout = (
            settings.checkpoint_call_timeout_s if checkpoint else settings.trainer_call_timeout_s
        )
        try:
            return await self._connector.cancel_job(
                trainer, self.run_id, timeout, checkpoint=checkpoint
            )
        except TrainerError as exc:
            _LOGGER.warning(
                "run %s: could not cancel its job on %s (it ends after the trainer's detach "
                "grace): %s",
                self.run_id,
                trainer,
                exc,
                extra={"run_id": self.run_id},
            )
            return None
