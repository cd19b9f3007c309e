"""Forks: a run started from another run's checkpoint (``RunSpec.fork_run_id``).

``fork_point`` checks a fork request against its parent and resolves where it starts; the
catalog creates the run from it. A fork:

- has the parent's task kind and model (``trainwire.contract.fork_differences`` names any other
  field that differs); its hyperparameters, seed and ``max_episodes`` may differ;
- starts from a checkpoint the parent has recorded at an episode it has published (0: the
  latest such), so the parent's curve up to the fork point is there to compare with;
- numbers its episodes from the fork episode + 1, and ``max_episodes`` stays the last episode's
  number, so it must be above the fork episode;
- starts with the parent's counters at the fork episode: ``episode`` is the fork episode,
  ``reward`` and ``best_reward`` the parent's there. Its running best goes on from the parent's
  best at the fork (as a run resumed from that checkpoint would), so its curve and the
  parent's line up on both the reward and the best.

A fork's first job restores the parent's checkpoint; a job placed again later restores the
fork's own newest usable checkpoint, or the parent's while it has none (``fork_resume_point``).
A fork never trains from scratch: when none of its candidates restores (the parent's
checkpoint was deleted with its run or by its retention, or it does not load), it fails
(``ForkNotRestored``), saying why.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.errors import InvalidRequest
from gateway.core.runs import TrainingRun
from gateway.core.store import CheckpointRecord, Store
from gateway.core.trainers import CheckpointSaved, ResumePoint, TrainerFailed
from trainwire.contract import FieldViolation, fork_differences
from trainwire.v1 import episode_pb2


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """Where a fork starts: its parent's checkpoint and the parent's counters there.

    Attributes:
        run_id: The parent run.
        episode: The checkpoint's episode (the fork's first episode is the next one).
        reward: The parent's reward at ``episode``.
        best_reward: The parent's best reward through ``episode``.
    """

    run_id: str
    episode: int
    reward: float
    best_reward: float


class ForkNotRestored(TrainerFailed):
    """A fork's job could not start from any of its checkpoints (the parent's is gone or does
    not load): a fork never trains from scratch, so the run fails with the reason."""

    def __init__(self, run: TrainingRun, why: str) -> None:
        message = (
            f"This fork could not start from the checkpoint of run {run.fork_run_id} at episode "
            f"{run.fork_episode}: {why}."
        )
        super().__init__(f"run {run.id}: {message}", message)


def _refuse(message: str, field: str, description: str) -> InvalidRequest:
    return InvalidRequest(f"cannot fork: {message}", [FieldViolation(field, description)])


def _listed(records: list[CheckpointRecord]) -> str:
    return ", ".join(str(r.episode) for r in records) or "none"


async def fork_point(
    store: Store,
    parent: TrainingRun,
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig,
    episode: int,
) -> ForkPoint:
    """Checks a fork of ``parent`` at its checkpoint of ``episode`` (0: its latest) with this
    task and config; returns where it starts.

    Raises:
        InvalidRequest: another task kind or model (the differing field named), no such
            checkpoint (the ones there are listed), a checkpoint beyond what the parent has
            published, or ``config.max_episodes`` not above the fork episode.
    """
    pid = parent.id
    differences = fork_differences(parent.task, task)
    if differences:
        first = differences[0]
        raise InvalidRequest(
            f"cannot fork run {pid!r}: {first.field} differs ({first.description}); a fork "
            "trains the same task kind and model, and may change only its hyperparameters, "
            "seed and max_episodes",
            differences,
        )
    records = await store.list_checkpoints(pid)
    published = [r for r in records if r.episode <= parent.episode]
    if episode == 0:
        if not published:
            have = (
                f"; its checkpoints ({_listed(records)}) are beyond the episodes it has "
                f"published (through {parent.episode})"
                if records
                else ""
            )
            raise _refuse(
                f"run {pid!r} has no checkpoint to fork from yet{have}",
                "fork_from.episode",
                f"0 (the latest); run {pid} has no checkpoint yet",
            )
        record = published[-1]
    else:
        found = [r for r in records if r.episode == episode]
        if not found:
            raise _refuse(
                f"run {pid!r} has no checkpoint at episode {episode}; it has {_listed(records)}",
                "fork_from.episode",
                f"{episode}; run {pid} has checkpoints at {_listed(records)}",
            )
        record = found[0]
        if record.episode > parent.episode:
            raise _refuse(
                f"run {pid!r} has published episodes only through {parent.episode}; its "
                f"checkpoint at episode {episode} is beyond them (fork from one of "
                f"{_listed(published)}, or once it has published episode {episode})",
                "fork_from.episode",
                f"{episode}; run {pid} has published through episode {parent.episode}",
            )
    if config.max_episodes <= record.episode:
        raise _refuse(
            f"config.max_episodes {config.max_episodes} is not after the fork episode "
            f"{record.episode}: a fork numbers its episodes from {record.episode + 1}, and "
            "max_episodes is its last episode's number",
            "config.max_episodes",
            f"{config.max_episodes}; need more than the fork episode {record.episode}",
        )
    data = await store.read_episodes(pid, record.episode, record.episode, True)
    if not data:
        raise _refuse(
            f"run {pid!r} no longer has its episode {record.episode}",
            "fork_from.run_id",
            f"run {pid} lost its history",
        )
    at = episode_pb2.Episode.FromString(data[0])
    return ForkPoint(pid, record.episode, at.reward, at.best_reward)


async def fork_resume_point(store: Store, run: TrainingRun) -> ResumePoint | None:
    """The parent's checkpoint a fork started from, while the parent still records it."""
    if not run.fork_run_id:
        return None
    for record in await store.list_checkpoints(run.fork_run_id):
        if record.episode == run.fork_episode:
            saved = CheckpointSaved(
                record.episode, record.create_time, record.size_bytes, record.sha256
            )
            return ResumePoint(record.run_id, saved)
    return None
