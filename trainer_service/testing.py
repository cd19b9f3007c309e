"""Test doubles for the trainer: scriptable fake providers and request builders.

A :class:`FakeProvider` behaves like a provider module (``run`` and ``validate``) and can be
registered under any name in a ``ProviderRegistry``, so servicer and integration tests exercise
the whole trainer without torch. It can fail at a chosen episode, hold (stay busy without
yielding) until the job is stopped, tamper with episodes to break the contract, and it records
how its runs ended so tests can wait on events instead of sleeping.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable, Iterator, Sequence

from trainer_service.core.provider import EpisodeCounter, TrainJob
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2, trainer_service_pb2


def imitation_request(
    run_id: str = "run-1",
    max_episodes: int = 5,
    seed: int = 0,
    clip_name: str = "wave",
    group_size: int = 0,
) -> trainer_service_pb2.TrainRequest:
    """A valid imitation ``TrainRequest`` (stickman rig, a built-in clip)."""
    return trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(
                avatar_id="avatar-1",
                rig_name="stickman",
                clip_name=clip_name,
                group_size=group_size,
            )
        ),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=seed),
    )


class FakeProvider:
    """A scriptable provider.

    Args:
        fail_at: Raise ``error`` instead of producing this episode.
        error: What to raise at ``fail_at``.
        hold_after: After yielding this many episodes, stay busy (yield nothing) until the job is
            stopped; ``0`` holds before the first episode.
        violations: What ``validate`` returns.
        tamper: Applied to each episode before it is yielded (to break the contract on purpose).
        phase: Reported through ``set_phase`` before the first episode.

    Attributes:
        started: Set when a run starts.
        stopped: Set when a run saw its stop event and returned early.
        finished: Set when a run's generator exited for any reason.
        runs: Number of runs started.
        jobs: The ``TrainJob`` of every run, in order.
    """

    def __init__(
        self,
        *,
        fail_at: int | None = None,
        error: BaseException | None = None,
        hold_after: int | None = None,
        violations: Sequence[FieldViolation] = (),
        tamper: Callable[[episode_pb2.Episode], episode_pb2.Episode] | None = None,
        phase: str = "training",
    ) -> None:
        self.fail_at = fail_at
        self.error = error or RuntimeError("fake provider failure")
        self.hold_after = hold_after
        self.violations = list(violations)
        self.tamper = tamper
        self.phase = phase
        self.started = threading.Event()
        self.stopped = threading.Event()
        self.finished = threading.Event()
        self.runs = 0
        self.jobs: list[TrainJob] = []
        self._lock = threading.Lock()

    def validate(
        self,
        task: episode_pb2.TrainTask,
        data_roots: Sequence[pathlib.Path],
        reward_modules: Sequence[str] = (),
    ) -> list[FieldViolation]:
        """Returns the configured violations."""
        del task, data_roots, reward_modules
        return list(self.violations)

    def run(self, job: TrainJob) -> Iterator[episode_pb2.Episode]:
        """Yields scripted episodes with rewards 0.1, 0.2, ... capped at 1."""
        with self._lock:
            self.runs += 1
            self.jobs.append(job)
        self.started.set()
        try:
            job.set_phase(self.phase)
            counter = EpisodeCounter(job.config.max_episodes)
            while not counter.finished:
                if self.hold_after is not None and counter.episode >= self.hold_after:
                    job.stop_event.wait()
                if job.stop_event.is_set():
                    self.stopped.set()
                    return
                n = counter.next_episode
                if n == self.fail_at:
                    raise self.error
                episode = counter.make(min(1.0, 0.1 * n), {"loss": 1.0 / n})
                yield self.tamper(episode) if self.tamper else episode
        finally:
            self.finished.set()
