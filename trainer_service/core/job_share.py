"""Another trainer's share of a job whose ranks span trainers: :class:`Share`.

A job spanning trainers (``TrainJob.placement``, see ``trainer_service.core.placement``) is one
job per trainer. Rank 0's trainer hosts the rendezvous and runs the job proper; any other
trainer's job is a *share*, which runs its ranks beside rank 0's.

Invariants of a share:

- it takes no credit and produces no episode: rank 0's trainer paces the whole job (its
  streams send heartbeats meanwhile);
- it ends OK when its provider returns (:meth:`Share.end` marks its part done);
- with ``resume_from`` it restores exactly the first candidate (the checkpoint rank 0
  restores) or fails with ``FAILED_PRECONDITION``: it never trains from scratch, nor from any
  other checkpoint, beside a resumed rank 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainer_service.core.checkpointing import skip_reason
from trainer_service.core.job_resume import ResumeChoice
from trainer_service.core.job_state import JobState
from trainer_service.core.placement import Placement
from trainer_service.core.provider import (
    CheckpointUnusable,
    ProviderError,
    RestoredCheckpoint,
    TrainJob,
)
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointError


def is_share(placement: Placement | None) -> bool:
    """Whether a job of ``placement`` is another trainer's share (not rank 0's job)."""
    return placement is not None and not placement.hosts_rendezvous


def share_candidate(
    resume_from: Sequence[trainer_service_pb2.CheckpointRef],
    fetch: Callable[[trainer_service_pb2.CheckpointRef, int], RestoredCheckpoint],
    run_id: str,
) -> tuple[trainer_service_pb2.CheckpointRef, RestoredCheckpoint]:
    """The candidate a share of a job with ``resume_from`` restores: exactly the first (the one
    rank 0 restores), fetched with ``fetch(ref, 0)``.

    Raises:
        ProviderError: It cannot be fetched or does not fit (``FAILED_PRECONDITION``).
    """
    ref = resume_from[0]
    episode = ref.checkpoint.episode
    try:
        return ref, fetch(ref, 0)
    except (CheckpointError, CheckpointUnusable) as exc:
        reason = skip_reason(exc) if isinstance(exc, CheckpointError) else str(exc)
        raise ProviderError(
            f"This trainer cannot restore the checkpoint at episode {episode} that the "
            f"job resumes from ({reason}); every trainer of the job needs it in its "
            "checkpoint store.",
            detail=f"run {run_id}: {type(exc).__name__}: {exc}",
        ) from exc


class Share:
    """This trainer's share of a job that spans trainers.

    Args:
        state: The job's shared state.
        job: What the provider runs.
        provider: The provider (``run(job)`` yields the share's (no) episodes).
        resume: Fetches and records the checkpoint the share restores.
    """

    def __init__(self, state: JobState, job: TrainJob, provider: Any, resume: ResumeChoice) -> None:
        self._state = state
        self._job = job
        self._provider = provider
        self._resume = resume

    def open(self) -> Iterator[episode_pb2.Episode]:
        """The share's provider, restoring exactly the first candidate of a job with
        ``resume_from``.

        Raises:
            ProviderError: The checkpoint cannot be fetched or does not fit
                (``FAILED_PRECONDITION``).
        """
        state = self._state
        if not state.resume_from:
            return self._provider.run(self._job)  # type: ignore[no-any-return]
        ref, restored = share_candidate(state.resume_from, self._resume.fetch, state.run_id)
        with state.cond:
            state.start_at(ref.checkpoint.episode)
        self._resume.decide(ref, restored.best_reward, [])
        return self._provider.run(dataclasses.replace(self._job, resume=restored))  # type: ignore[no-any-return]

    def end(self) -> None:
        """The share's provider returned: its part of the job is done."""
        self._state.share_ended = True
