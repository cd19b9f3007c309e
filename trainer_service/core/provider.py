"""The provider interface: what a training provider receives and what it yields.

A provider is a module exposing ``run(job: TrainJob) -> Iterator[Episode]`` (fully filled
episodes: ``episode``, ``reward``, ``best_reward``, ``done``, ``metrics``, ``produce_time`` and
``detail``), optionally ``validate(task, data_roots, reward_modules) -> list[FieldViolation]``
(called before a slot is taken, with the trainer's data roots and ``--reward-module`` specs; any
violation answers ``INVALID_ARGUMENT``), optionally ``reward_functions(reward_modules) ->
Sequence[str]`` (the reward names its tasks may use on this trainer: ``GetCapabilities``) and
optionally
``slots_needed(task) -> int`` (slots, i.e. devices, the job takes: one per process it runs; 1
without it), and ``DEFAULT_CHECKPOINT_EVERY`` (its checkpoint interval when the config leaves
``checkpoint_every`` at 0), optionally ``defaults() -> ProviderDefaults`` (what its jobs train
with where a task leaves a field at 0, ``checkpoint_every`` included: ``GetCapabilities``
advertises it), and optionally ``hyperparameters(task)`` and
``check_hyperparameters(task, change)`` (its live hyperparameters, see
``trainer_service.core.hyperparameters``: it takes ``job.hyperparameters``' changes before each
optimizer step and reports the values each step used as metrics). The service pulls ``run``'s
generator from a thread it owns, one credited episode at a time, and checks every episode against
the stream contract before sending it; a provider may train in that thread (imitation) or in
processes it starts and drives from there (grpo). A provider whose jobs may span trainers (grpo)
reads ``job.placement``: rank 0's share announces its rendezvous and yields the episodes; any
other share yields none and returns when its part of the job is done.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from trainer_service.core.hyperparameters import LiveHyperparameters
from trainer_service.core.placement import DEFAULT_RENDEZVOUS_HOST, Placement
from trainwire.v1 import episode_pb2

__all__ = [
    "CheckpointUnusable",
    "Checkpoints",
    "EpisodeCounter",
    "NoCheckpoints",
    "Provider",
    "ProviderError",
    "RestoredCheckpoint",
    "TrainJob",
]


class ProviderError(Exception):
    """A provider failure the user should read about (bad model path, unreadable dataset, ...).

    The stream ends with ``code`` and status details holding a ``google.rpc.LocalizedMessage``
    (``user_message``) and a ``google.rpc.ErrorInfo`` (domain ``trainwire``, ``reason``);
    ``detail`` goes to the log only.

    Attributes:
        user_message: What the gateway shows the user; names no internals.
        detail: Diagnostic detail for the log.
        code: A ``grpc.StatusCode`` name, e.g. ``"FAILED_PRECONDITION"``.
        reason: ``ErrorInfo.reason``, UPPER_SNAKE_CASE.
    """

    def __init__(
        self,
        user_message: str,
        detail: str = "",
        code: str = "FAILED_PRECONDITION",
        reason: str = "PROVIDER_FAILED",
    ) -> None:
        super().__init__(user_message)
        self.user_message = user_message
        self.detail = detail
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.user_message} ({self.detail})" if self.detail else self.user_message


class CheckpointUnusable(Exception):
    """Raised by a provider's ``run`` before its first episode when ``job.resume`` does not load
    (a file missing or unreadable, shapes that do not fit the task). The job then tries the next
    resume candidate, or starts from scratch; ``str()`` says why, for the run's detail."""


@dataclass(frozen=True)
class RestoredCheckpoint:
    """The checkpoint a job starts from, fetched to local disk and its digest verified.

    Attributes:
        directory: A local directory holding the checkpoint's files, as the provider wrote them.
        episode: The episode it was taken after: the job's first episode is ``episode + 1``.
        best_reward: The running maximum of the reward through ``episode``.
    """

    directory: pathlib.Path
    episode: int
    best_reward: float


class Checkpoints(Protocol):
    """How a provider writes checkpoints (``TrainJob.checkpoints``).

    A provider asks :meth:`due` after each episode it yielded; when it says so, it writes the
    whole state it needs to continue (and the model, loadable without trainwire) into a fresh
    :meth:`scratch` directory and hands it to :meth:`commit`. Before its generator returns or is
    closed (stop, cancel, park) it asks :meth:`final_wanted` and, if so, commits a checkpoint
    of its last episode unless it just did.
    """

    every: int

    def due(self, episode: int) -> bool:
        """Whether to checkpoint after ``episode``: every ``every`` episodes and at the last."""
        ...

    def final_wanted(self) -> bool:
        """Whether the job was asked to end with a checkpoint (stop and park)."""
        ...

    def scratch(self, episode: int) -> pathlib.Path:
        """A new empty local directory to write the checkpoint of ``episode`` into."""
        ...

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        """Puts ``directory`` into the checkpoint store as the checkpoint after ``episode`` and
        removes it locally. Never raises: a failed write is logged and reported to the stream
        (``CheckpointFailure``), and training goes on."""
        ...

    def fail(self, episode: int, message: str, directory: pathlib.Path | None = None) -> None:
        """Reports a checkpoint the provider could not write into its scratch directory (disk
        full) as :meth:`commit` reports a failed upload, and removes ``directory``. Never
        raises."""
        ...


class NoCheckpoints:
    """``Checkpoints`` that never asks for one (direct use, tests of other things)."""

    every = 0

    def due(self, episode: int) -> bool:
        return False

    def final_wanted(self) -> bool:
        return False

    def scratch(self, episode: int) -> pathlib.Path:
        raise RuntimeError("this job writes no checkpoints")

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        raise RuntimeError("this job writes no checkpoints")

    def fail(self, episode: int, message: str, directory: pathlib.Path | None = None) -> None:
        raise RuntimeError("this job writes no checkpoints")


@dataclass(frozen=True)
class TrainJob:
    """Everything a provider needs to run one training job.

    Attributes:
        run_id: The gateway's run id (for logs and error messages).
        task: The validated task (its kind matches the provider).
        config: The validated config (``max_episodes`` in 1..10,000,000, ``seed``).
        device: The torch device string, ``"cpu"`` or ``"cuda:0"``.
        data_root: The first data root: relative task paths (models, datasets) resolve against
            it.
        image_cache_dir: Where decoded images may be cached; ``None`` disables the cache.
        stop_event: Set on cancel or shutdown; providers check it at least once per
            episode/step and return promptly once it is set.
        set_phase: Reports what the job is doing (``"loading"``, ``"training"``); it goes into
            heartbeats.
        devices: The device of each slot the job holds, one per process (``device`` is the
            first); empty when the job was not started by a runner.
        more_data_roots: The trainer's other data roots: an absolute task or image path must
            lie inside ``data_root`` or one of these.
        checkpoints: Where the provider writes checkpoints.
        resume: The checkpoint to continue from (None: from scratch). The provider restores
            the whole training state from it, or raises ``CheckpointUnusable`` before its
            first episode; its first episode is then ``resume.episode + 1``. The task's
            hyperparameters win over those the checkpoint was written with.
        hyperparameters: Changes of the live hyperparameters asked for while the job runs;
            the provider takes them before each optimizer step.
        placement: This trainer's share of a job whose ranks span trainers (None: the whole
            job runs here). Rank 0's share (``placement.hosts_rendezvous``) yields the
            episodes and writes the checkpoints; any other share yields no episode, returns
            once its ranks are done, and writes, commits and deletes no checkpoint (its
            ``resume`` is the checkpoint rank 0 restores, fetched from this trainer's store).
        rendezvous_host: The address this trainer's jobs meet other trainers' ranks on (the
            trainer's ``--rendezvous-host``).
        announce_rendezvous: Called by rank 0's share with ``HOST:PORT`` once the job's
            rendezvous is bound: the job's stream sends it on (``TrainResponse.rendezvous``).
        reward_modules: The trainer's ``--reward-module`` specs: the provider imports them for
            the reward functions they define.
        scratch_dir: Where the job's own local files go (a folder of the job's inside it,
            removed when the job ends); None: the system's temporary directory.
    """

    run_id: str
    task: episode_pb2.TrainTask
    config: episode_pb2.TrainConfig
    device: str
    data_root: pathlib.Path
    image_cache_dir: pathlib.Path | None
    stop_event: threading.Event
    set_phase: Callable[[str], None] = field(default=lambda phase: None)
    devices: tuple[str, ...] = ()
    more_data_roots: tuple[pathlib.Path, ...] = ()
    checkpoints: Checkpoints = field(default_factory=NoCheckpoints)
    resume: RestoredCheckpoint | None = None
    hyperparameters: LiveHyperparameters = field(default_factory=LiveHyperparameters)
    placement: Placement | None = None
    rendezvous_host: str = DEFAULT_RENDEZVOUS_HOST
    announce_rendezvous: Callable[[str], None] = field(default=lambda address: None)
    reward_modules: tuple[str, ...] = ()
    scratch_dir: pathlib.Path | None = None

    @property
    def data_roots(self) -> tuple[pathlib.Path, ...]:
        """Every data root, ``data_root`` first."""
        return (self.data_root, *self.more_data_roots)


class Provider(Protocol):
    """What a provider module looks like (``validate`` is optional)."""

    def run(self, job: TrainJob) -> Iterator[episode_pb2.Episode]:  # pragma: no cover
        """Yields the job's episodes, 1..max_episodes, the last with ``done`` set."""
        ...


class EpisodeCounter:
    """Builds a run's episodes in order with the running ``best_reward``.

    Providers call :meth:`make` once per episode/step; the counter numbers episodes from 1,
    keeps ``best_reward`` as the running maximum of ``reward``, sets ``done`` on the
    ``max_episodes``-th episode and stamps ``produce_time``.

    Example:
        counter = EpisodeCounter(job.config.max_episodes)
        while not counter.finished and not job.stop_event.is_set():
            yield counter.make(reward, {"loss": loss})
    """

    def __init__(self, max_episodes: int, resume: RestoredCheckpoint | None = None) -> None:
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        self.max_episodes = max_episodes
        self.episode = 0
        self.best_reward: float | None = None
        if resume is not None:
            # Continues the numbering and the running maximum of the checkpointed run.
            self.episode = resume.episode
            self.best_reward = resume.best_reward

    @property
    def finished(self) -> bool:
        """Whether the last episode has been made."""
        return self.episode >= self.max_episodes

    @property
    def next_episode(self) -> int:
        """The number the next :meth:`make` call gives its episode."""
        return self.episode + 1

    def make(
        self,
        reward: float,
        metrics: Mapping[str, float] | None = None,
        *,
        imitation: episode_pb2.ImitationDetail | None = None,
        grpo: episode_pb2.GrpoDetail | None = None,
        done: bool | None = None,
    ) -> episode_pb2.Episode:
        """Returns the next episode.

        Args:
            reward: The episode's reward (must be finite; the contract checker enforces it).
            metrics: Named finite scalars.
            imitation: Imitation detail to attach, if any.
            grpo: GRPO detail to attach, if any.
            done: Overrides ``done``; by default it is set on the ``max_episodes``-th episode.
                A provider that ends early (e.g. its dataset ran out) passes ``done=True``.

        Raises:
            RuntimeError: When called after the last episode.
        """
        if self.finished:
            raise RuntimeError(f"episode {self.max_episodes} was the last one")
        self.episode += 1
        reward = float(reward)
        if self.best_reward is None or reward > self.best_reward:
            self.best_reward = reward
        episode = episode_pb2.Episode(
            episode=self.episode,
            reward=reward,
            best_reward=self.best_reward,
            done=self.finished if done is None else done,
        )
        if done:
            # An early end: nothing may follow it.
            self.max_episodes = self.episode
        if metrics:
            for name, value in metrics.items():
                episode.metrics[name] = float(value)
        episode.produce_time.FromNanoseconds(time.time_ns())
        if imitation is not None:
            episode.imitation.CopyFrom(imitation)
        elif grpo is not None:
            episode.grpo.CopyFrom(grpo)
        return episode
