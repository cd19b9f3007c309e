"""A job's checkpoints: :class:`JobCheckpoints`, the ``Checkpoints`` a provider writes through
(when, where to write, the commit into the shared store) and the record of what it committed or
failed to commit, which the job's streams report; :func:`fetch_candidate`, which brings a
resume candidate from the store to local disk, verified; and :func:`check_fork`, what a
candidate of another run (a fork's parent) must share with the job.

A commit never raises: a failed write (disk full, store unreachable) is logged, counted and
recorded as a failure event, and training goes on. Commits happen in episode order (a provider
checkpoints as it goes), so the record is in episode order too; a stream sends the record's
entries once it has sent their episode.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from trainer_service.core.observe import JobObserver, NullJobObserver
from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint
from trainwire.contract import fork_differences
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    CheckpointMissing,
    CheckpointStore,
)

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointEvent:
    """One checkpoint the job committed, or failed to.

    Attributes:
        episode: The episode the checkpoint is of.
        info: Its record in the store; None when the write failed.
        error: Why the write failed ("" when it did not).
    """

    episode: int
    info: CheckpointInfo | None
    error: str = ""

    def to_proto(self) -> episode_pb2.Checkpoint | trainer_service_pb2.CheckpointFailure:
        """The stream message of the event."""
        if self.info is None:
            return trainer_service_pb2.CheckpointFailure(episode=self.episode, message=self.error)
        return checkpoint_message(self.info)


def checkpoint_message(info: CheckpointInfo) -> episode_pb2.Checkpoint:
    """The ``Checkpoint`` message of a store record."""
    message = episode_pb2.Checkpoint(
        episode=info.episode, size_bytes=info.size_bytes, sha256=info.sha256
    )
    message.create_time.FromNanoseconds(info.create_time_ns)
    return message


def checkpoint_due(episode: int, every: int, max_episodes: int) -> bool:
    """Whether a job checkpoints after ``episode``: after every ``every`` episodes (0: none but
    the last) and, whatever ``every``, after its last (``max_episodes``)."""
    if episode >= max_episodes:
        return True
    return bool(every) and episode % every == 0


class JobCheckpoints:
    """The ``Checkpoints`` of one job over the shared store (see the module docstring).

    Thread-safe: the provider commits from its thread (or one of its own), streams read the
    record from theirs.

    Args:
        store: The shared checkpoint store.
        run_id: The job's run.
        kind: The task kind (``imitation``, ``grpo``), for the marker and the metrics.
        every: Checkpoint every this many episodes (0: only at the last).
        max_episodes: The job's last episode (always checkpointed).
        scratch_root: A local directory of this job alone; removed by :meth:`close`.
        meta: Recorded in each checkpoint's marker (the task and config, for people).
        on_change: Called (without locks held) after each commit, to wake the streams.
        observer: Hears of commits (the trainer's metrics).
    """

    def __init__(
        self,
        store: CheckpointStore,
        run_id: str,
        kind: str,
        every: int,
        max_episodes: int,
        scratch_root: pathlib.Path,
        meta: Mapping[str, Any] | None = None,
        on_change: Callable[[], None] = lambda: None,
        observer: JobObserver | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.kind = kind
        self.every = max(0, every)
        self.max_episodes = max_episodes
        self.scratch_root = scratch_root
        self._meta = dict(meta or {})
        self._on_change = on_change
        self._observer: JobObserver = observer or NullJobObserver()
        self._final = threading.Event()
        self._lock = threading.Lock()
        self._events: list[CheckpointEvent] = []
        self._by_episode: dict[int, CheckpointEvent] = {}

    # -- the provider's side (``Checkpoints``) -----------------------------------------------

    def due(self, episode: int) -> bool:
        """Whether to checkpoint after ``episode``: every ``every`` episodes and at the last."""
        return checkpoint_due(episode, self.every, self.max_episodes)

    def final_wanted(self) -> bool:
        """Whether the job was asked to end with a checkpoint (stop and park)."""
        return self._final.is_set()

    def request_final(self) -> None:
        """Asks the provider for a checkpoint of its last episode as it stops."""
        self._final.set()

    def scratch(self, episode: int) -> pathlib.Path:
        """A new empty local directory to write the checkpoint of ``episode`` into."""
        directory = self.scratch_root / f"{episode:012d}-{uuid.uuid4().hex[:8]}"
        directory.mkdir(parents=True)
        return directory

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        """Puts ``directory`` into the store as the checkpoint after ``episode``, removes it
        and records the outcome. Never raises."""
        started = time.monotonic()
        try:
            meta = {
                **self._meta,
                "run_id": self.run_id,
                "episode": episode,
                "best_reward": float(best_reward),
                "kind": self.kind,
            }
            info = self.store.put(self.run_id, episode, directory, meta)
        except Exception as exc:  # disk full, store unreachable, a bug: training goes on
            self.fail(episode, str(exc) if isinstance(exc, CheckpointError) else f"{exc!r}")
        else:
            seconds = time.monotonic() - started
            _LOGGER.info(
                "run %s: checkpoint at episode %d in %s (%d bytes, %.3f s)",
                self.run_id,
                episode,
                self.store.location,
                info.size_bytes,
                seconds,
                extra={"run_id": self.run_id, "episode": episode},
            )
            self._observer.checkpoint_written(self.kind, seconds, info.size_bytes)
            self._record(CheckpointEvent(episode, info))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def fail(self, episode: int, message: str, directory: pathlib.Path | None = None) -> None:
        """Records a checkpoint the provider could not write locally. Never raises."""
        _LOGGER.error(
            "run %s: checkpoint at episode %d failed: %s",
            self.run_id,
            episode,
            message,
            extra={"run_id": self.run_id, "episode": episode},
        )
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self._observer.checkpoint_failed(self.kind)
        self._record(CheckpointEvent(episode, None, message))

    def _record(self, event: CheckpointEvent) -> None:
        with self._lock:
            self._events.append(event)
            self._by_episode[event.episode] = event
        try:
            self._on_change()
        except Exception:  # waking streams must not fail a provider
            _LOGGER.exception("run %s: waking the streams failed", self.run_id)

    # -- the job's side ----------------------------------------------------------------------

    def event(self, index: int) -> CheckpointEvent | None:
        """The ``index``-th recorded event (in commit order), if there is one yet."""
        with self._lock:
            return self._events[index] if index < len(self._events) else None

    def of_episode(self, episode: int) -> CheckpointEvent | None:
        """The last outcome of a checkpoint of ``episode``, if one was attempted."""
        with self._lock:
            return self._by_episode.get(episode)

    def close(self) -> None:
        """Removes the job's scratch directory (what a provider left, fetched candidates)."""
        shutil.rmtree(self.scratch_root, ignore_errors=True)


def job_meta(task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig) -> dict[str, Any]:
    """What a checkpoint's marker records of its job: the task and config as JSON."""
    return {
        "task": json.loads(json_format.MessageToJson(task)),
        "config": json.loads(json_format.MessageToJson(config)),
    }


def fetch_candidate(
    store: CheckpointStore, ref: trainer_service_pb2.CheckpointRef, dest: pathlib.Path
) -> RestoredCheckpoint:
    """Fetches a resume candidate into ``dest`` and verifies its digest.

    Raises:
        CheckpointError: It is missing, damaged, or records no best reward (one line says
            which and why).
    """
    episode = ref.checkpoint.episode
    info = store.fetch(ref.run_id, episode, dest, ref.checkpoint.sha256)
    if info.best_reward is None:
        raise CheckpointError(ref.run_id, episode, "its record holds no best reward")
    return RestoredCheckpoint(directory=dest, episode=episode, best_reward=info.best_reward)


def check_fork(
    store: CheckpointStore,
    ref: trainer_service_pb2.CheckpointRef,
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig,
) -> None:
    """Checks that a candidate of another run (the parent of a fork) fits this job: a job may
    continue another run's checkpoint with other hyperparameters, seed and ``max_episodes``
    (``trainwire.contract.fork_differences``), never of another task kind or model, and only
    to train on after it. A checkpoint whose marker records no task is left to the provider.

    Raises:
        CheckpointUnusable: It does not fit (``str()`` names the field and both values).
        CheckpointError: Its marker cannot be read.
    """
    episode = ref.checkpoint.episode
    if episode >= config.max_episodes:
        raise CheckpointUnusable(
            f"it was taken after episode {episode}, and this job ends at episode "
            f"{config.max_episodes}"
        )
    recorded = (store.meta(ref.run_id, episode) or {}).get("task")
    if not isinstance(recorded, dict):
        return
    try:
        parent = json_format.ParseDict(
            recorded, episode_pb2.TrainTask(), ignore_unknown_fields=True
        )
    except json_format.ParseError as exc:
        raise CheckpointUnusable(f"the task its marker records does not parse: {exc}") from exc
    differences = fork_differences(parent, task)
    if differences:
        first = differences[0]
        raise CheckpointUnusable(
            f"it is of another task than this fork's ({first.field}: {first.description}); a "
            "fork may change only its hyperparameters, seed and max_episodes"
        )


def skip_reason(error: CheckpointError) -> str:
    """Why a candidate was skipped, for people: "missing: ...", "digest mismatch: ...", ..."""
    if isinstance(error, CheckpointMissing):
        return f"missing: {error.why}"
    return error.why
