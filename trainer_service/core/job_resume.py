"""Which checkpoint a job resumes from: :class:`ResumeChoice`.

A job started with ``resume_from`` opens its provider through :meth:`ResumeChoice.open` (in the
producer thread): each candidate, newest first, is fetched and verified
(``trainer_service.core.checkpointing``) and handed to the provider as ``TrainJob.resume``. A
candidate that is missing, damaged, of another run that this job may not continue
(``checkpointing.check_fork``: a fork continues its parent's task with other hyperparameters
only) or that the provider finds ``CheckpointUnusable`` before its first episode is skipped;
when none is left the job starts from scratch.

The choice is *decided* (``JobState.resumed`` set, the contract checker told where the job
continues) once a candidate produced its first episode or ended, once the producer was stopped
while it waited for credit, or when none is left. Rank 0 of a job spanning trainers decides
earlier, when it announces its rendezvous (:meth:`ResumeChoice.announce`): the other trainers
join on the candidate being opened, so a later failure to load it fails the job
(``ProviderError``) instead of trying the next candidate.

Invariants: the job's episodes are numbered from the candidate's episode + 1 before its
provider runs (from 0 + 1 when none is left); the decision is made at most once;
:attr:`ResumeChoice.restored` is the store's record of the candidate being tried or restored
when it is of this run, None otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainer_service.core.checkpointing import (
    JobCheckpoints,
    check_fork,
    fetch_candidate,
    skip_reason,
)
from trainer_service.core.job_state import JobState
from trainer_service.core.provider import (
    CheckpointUnusable,
    ProviderError,
    RestoredCheckpoint,
    TrainJob,
)
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointError, CheckpointInfo, CheckpointStore

_LOGGER = logging.getLogger(__name__)

#: A candidate being opened, as :meth:`ResumeChoice.decide` takes it.
_Opening = tuple[
    trainer_service_pb2.CheckpointRef, float, list[trainer_service_pb2.SkippedCheckpoint]
]


def fetch_resume_candidate(
    store: CheckpointStore,
    ref: trainer_service_pb2.CheckpointRef,
    run_id: str,
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig,
    dest: pathlib.Path,
) -> RestoredCheckpoint:
    """Brings candidate ``ref`` of a job of ``run_id`` (``task``, ``config``) from ``store`` to
    ``dest``, verified; another run's is first checked to fit the job (before fetching: a model
    may be large).

    Raises:
        CheckpointError: It is missing or damaged.
        CheckpointUnusable: It is another run's that this job may not continue.
    """
    if ref.run_id != run_id:
        check_fork(store, ref, task, config)
    return fetch_candidate(store, ref, dest)


class Candidates:
    """The resume candidates of a job that fetch, in the order given (newest first), each with
    what it restores; each one that does not is skipped, with its reason (for people): the
    store's for one missing or damaged (``checkpointing.skip_reason``), ``does not fit: ...``
    for another run's that the job may not continue.

    Args:
        resume_from: The candidates.
        fetch: Fetches the ``index``-th candidate (``fetch(ref, index)``); raises
            ``CheckpointError`` or ``CheckpointUnusable`` when it cannot.
        skip: Hears of each skipped candidate: ``skip(episode, reason)``.
        should_stop: Asked before each fetch; True ends the iteration, with :attr:`stopped`.

    Attributes:
        stopped: The iteration ended because ``should_stop()`` said so.
    """

    def __init__(
        self,
        resume_from: Sequence[trainer_service_pb2.CheckpointRef],
        fetch: Callable[[trainer_service_pb2.CheckpointRef, int], RestoredCheckpoint],
        skip: Callable[[int, str], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self._resume_from = tuple(resume_from)
        self._fetch = fetch
        self._skip = skip
        self._should_stop = should_stop
        self.stopped = False

    def __iter__(self) -> Iterator[tuple[trainer_service_pb2.CheckpointRef, RestoredCheckpoint]]:
        for index, ref in enumerate(self._resume_from):
            if self._should_stop():
                self.stopped = True
                return
            episode = ref.checkpoint.episode
            try:
                restored = self._fetch(ref, index)
            except CheckpointError as exc:
                self._skip(episode, skip_reason(exc))
                continue
            except CheckpointUnusable as exc:  # another run's that this job may not continue
                self._skip(episode, f"does not fit: {exc}")
                continue
            yield ref, restored


class ResumeChoice:
    """Chooses and restores the checkpoint a job starts from.

    Args:
        state: The job's shared state (its ``resume_from`` are the candidates).
        job: What the provider runs.
        provider: The provider (``run(job)`` yields episodes).
        checkpoints: The job's checkpoints; None when the trainer has no checkpoint store
            (every candidate is then skipped).

    Attributes:
        restored: The store's record of the candidate of this run being tried or restored.
    """

    def __init__(
        self,
        state: JobState,
        job: TrainJob,
        provider: Any,
        checkpoints: JobCheckpoints | None,
    ) -> None:
        self._state = state
        self._job = job
        self._provider = provider
        self._checkpoints = checkpoints
        self.restored: CheckpointInfo | None = None
        self._opening: _Opening | None = None  # the candidate being opened (None: none is)

    def open(
        self,
    ) -> tuple[Iterator[episode_pb2.Episode] | None, episode_pb2.Episode | None]:
        """Starts the provider on the first candidate that loads (from scratch when none
        does); returns its generator (None: stopped while restoring) and the first episode when
        restoring pulled it."""
        state = self._state
        skipped: list[trainer_service_pb2.SkippedCheckpoint] = []
        candidates = Candidates(
            state.resume_from,
            self.fetch,
            lambda episode, reason: self._skip(skipped, episode, reason),
            lambda: self._job.stop_event.is_set() or bool(state.stop_reason),
        )
        for ref, restored in candidates:
            episode = ref.checkpoint.episode
            with state.cond:
                state.start_at(episode)
            episodes = self._provider.run(dataclasses.replace(self._job, resume=restored))
            if not state.wait_credit(episode + 1):
                self.decide(ref, restored.best_reward, skipped)
                return episodes, None
            self._opening = (ref, restored.best_reward, skipped)
            try:
                first = next(episodes)
            except CheckpointUnusable as exc:
                if state.resumed is not None:  # announced: other trainers joined on it
                    raise ProviderError(
                        f"The checkpoint at episode {episode} could not be restored: {exc}",
                        detail=f"run {state.run_id}: after the rendezvous was announced",
                    ) from exc
                self._skip(skipped, episode, f"does not load: {exc}")
                continue
            except StopIteration:
                self._decide_once(ref, restored.best_reward, skipped)
                return episodes, None
            finally:
                self._opening = None
            self._decide_once(ref, restored.best_reward, skipped)
            return episodes, first
        if candidates.stopped:
            return None, None
        with state.cond:
            state.start_at(0)
        self.decide(None, 0.0, skipped)
        return self._provider.run(self._job), None

    def announce(self) -> None:
        """Decides on the candidate being opened, if any (rank 0 announced its rendezvous:
        the other trainers join on it)."""
        opening = self._opening
        if opening is not None:
            self._decide_once(*opening)

    def fetch(self, ref: trainer_service_pb2.CheckpointRef, index: int) -> RestoredCheckpoint:
        """Brings candidate ``ref`` (the ``index``-th) to local disk, verified.

        Raises:
            CheckpointError: It is missing or damaged, or there is no checkpoint store.
            CheckpointUnusable: It is another run's that this job may not continue.
        """
        if self._checkpoints is None:
            raise CheckpointError(
                ref.run_id, ref.checkpoint.episode, "this trainer has no checkpoint store"
            )
        state = self._state
        state.provider_phase = "loading"
        dest = self._checkpoints.scratch_root / f"resume-{index}-{ref.checkpoint.episode:012d}"
        restored = fetch_resume_candidate(
            self._checkpoints.store, ref, state.run_id, self._job.task, self._job.config, dest
        )
        if ref.run_id == state.run_id:
            self.restored = self._checkpoints.store.info(ref.run_id, ref.checkpoint.episode)
        else:
            self.restored = None
        return restored

    def decide(
        self,
        ref: trainer_service_pb2.CheckpointRef | None,
        best_reward: float,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
    ) -> None:
        """Records where the job started (``ref``; None: from scratch); its streams send it
        first."""
        state = self._state
        resumed = trainer_service_pb2.Resumed(skipped=skipped)
        if ref is not None:
            resumed.checkpoint.CopyFrom(ref)
            resumed.best_reward = best_reward
            state.checker.resume(ref.checkpoint.episode, best_reward)
            _LOGGER.info(
                "run %s: continues from the checkpoint of run %s at episode %d",
                state.run_id,
                ref.run_id,
                ref.checkpoint.episode,
                extra={"run_id": state.run_id, "episode": ref.checkpoint.episode},
            )
        else:
            _LOGGER.info(
                "run %s: no checkpoint restored; training from scratch",
                state.run_id,
                extra={"run_id": state.run_id},
            )
        with state.cond:
            state.resumed = resumed
            state.notify()

    def _decide_once(
        self,
        ref: trainer_service_pb2.CheckpointRef | None,
        best_reward: float,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
    ) -> None:
        """:meth:`decide`, unless the start is decided already."""
        if self._state.resumed is None:
            self.decide(ref, best_reward, skipped)

    def _skip(
        self,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
        episode: int,
        reason: str,
    ) -> None:
        run_id = self._state.run_id
        _LOGGER.warning(
            "run %s: skipped the checkpoint at episode %d: %s",
            run_id,
            episode,
            reason,
            extra={"run_id": run_id, "episode": episode},
        )
        skipped.append(trainer_service_pb2.SkippedCheckpoint(episode=episode, reason=reason))
        self.restored = None
