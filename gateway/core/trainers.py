"""What the core needs from a trainer, without grpc: capabilities, an episode stream, grants,
cancellation and live hyperparameters.

``gateway.trainer_client`` implements ``TrainerConnector`` over gRPC; tests may plug in others.
A stream yields ``Episode`` messages, ``None`` for heartbeats, the checkpoint events
(``CheckpointSaved``, ``Resumed``, ``CheckpointFailed``) and, from rank 0's trainer of a job
that spans trainers, where the other trainers' ranks join it (``Rendezvous``); it raises one of
the ``TrainerError`` subclasses below when it fails. A ``train`` call with a ``JobPlacement``
starts one trainer's share of such a job. A connector that also implements ``CheckpointMerger``
asks trainers for LoRA checkpoints merged into their base model (merged downloads).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2


class TrainerError(Exception):
    """A trainer stream failed; ``str(exc)`` is the detail for the log."""


class TrainerBusy(TrainerError):
    """The trainer has no free slot (``RESOURCE_EXHAUSTED`` with reason ``SLOTS_BUSY``, and only
    that); the run goes back in the queue."""


class TrainerGoneBeforeStart(TrainerBusy):
    """A new job's ``Train`` call found the trainer's address refusing connections: the trainer
    is gone and the job never ran anywhere. Like a busy trainer, the run goes back in the queue
    (no restart counted) and is placed on a trainer that answers."""


class TrainerJobExists(TrainerError):
    """The trainer already has a live job of this run (``ALREADY_EXISTS``): one the gateway
    started before it restarted. The gateway re-attaches to it."""


class TrainerJobGone(TrainerError):
    """A re-attach found no job of this run (``NOT_FOUND``), or one that no longer holds the
    episodes the gateway needs (``FAILED_PRECONDITION`` ``EPISODES_NOT_HELD``)."""


class TrainerFailed(TrainerError):
    """The provider failed and said why, for users (a ``google.rpc.LocalizedMessage``)."""

    def __init__(self, detail: str, user_message: str) -> None:
        super().__init__(detail)
        self.user_message = user_message


class TrainerProcessDied(TrainerFailed):
    """A process of the job died (reason ``PROCESS_DIED``: killed, out of memory): not the
    user's error, so a run with a checkpoint is restarted from it."""


class TrainerLost(TrainerError):
    """The stream broke (connection lost, trainer killed)."""


class TrainerUnreachable(TrainerLost):
    """The trainer's address refuses connections: no process listens there, so the trainer is
    gone and its jobs died with it (a job never outlives its trainer's process). A re-attach
    cannot succeed: a run with a checkpoint is restarted from it at once, without waiting out
    the heartbeat timeout. A trainer that is merely silent (stopped, or cut off by the network)
    accepts connections, or lets them time out, and is never this."""


class TrainerBrokeContract(TrainerError):
    """The trainer's own contract check stopped its stream (``INTERNAL`` with reason
    ``CONTRACT_VIOLATION``): users read what a violation the gateway catches reads."""


class TrainerCrashed(TrainerError):
    """Any other failure of the trainer."""


class TrainerRefused(TrainerError):
    """The trainer refused a change of a job's hyperparameters (``INVALID_ARGUMENT``): a beta
    the job cannot take. ``user_message`` says why, ``violations`` name the fields."""

    def __init__(
        self, detail: str, user_message: str, violations: Sequence[FieldViolation] = ()
    ) -> None:
        super().__init__(detail)
        self.user_message = user_message
        self.violations = tuple(violations)


class TrainerMergeFailed(TrainerError):
    """A trainer could not merge a checkpoint: ``code`` is its status code's name
    (``NOT_FOUND``: no such checkpoint in its store, ``DATA_LOSS``: the checkpoint is damaged,
    ``FAILED_PRECONDITION``: not a LoRA checkpoint, or its base model is not there...) and
    ``user_message`` says why, for people."""

    def __init__(self, detail: str, code: str, user_message: str) -> None:
        super().__init__(detail)
        self.code = code
        self.user_message = user_message


class TrainerJobFinished(TrainerError):
    """The job has trained its last episode or stopped (``FAILED_PRECONDITION``
    ``JOB_FINISHED``): a change of its hyperparameters has no step left to act on."""


@dataclass(frozen=True)
class Gpu:
    """One GPU a trainer's jobs may use, as the trainer last read it (``Gpu``).

    Attributes:
        index: Its CUDA device index on the trainer.
        name: The device's name.
        memory_total_bytes: Its memory.
        memory_used_bytes: Memory in use by every process on it.
        utilization: Compute utilization, 0..1.
    """

    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float


@dataclass(frozen=True)
class Capabilities:
    """What a trainer offers and how busy it is: the fields of the trainer's own
    ``trainer_service.core.jobs.Capabilities`` (``GetCapabilitiesResponse``). Placement reads
    the first three; the rest say where a run trains (``gpus``: empty on a CPU trainer)."""

    providers: tuple[str, ...]
    slots_total: int
    slots_free: int
    device: str = ""
    torch_version: str = ""
    trl_version: str = ""
    server_version: str = ""
    gpus: tuple[Gpu, ...] = ()
    #: Every reward function name a GRPO task may use there (placement reads it too).
    reward_functions: tuple[str, ...] = ()
    #: Each provider's defaults, by provider name (``GetCapabilitiesResponse.provider_defaults``;
    #: empty from a trainer that does not advertise them).
    provider_defaults: Mapping[str, trainer_service_pb2.ProviderDefaults] = field(
        default_factory=dict
    )


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """A checkpoint complete in the checkpoint store (``TrainResponse.checkpoint``): taken after
    ``episode``, which the stream sent before it.

    Attributes:
        episode: The episode it was taken after.
        create_time: When it was complete (Unix nanoseconds).
        size_bytes: Size of its canonical tar.
        sha256: Hex digest of that tar.
    """

    episode: int
    create_time: int
    size_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """A checkpoint a new job may start from: the run that wrote it and its record."""

    run_id: str
    checkpoint: CheckpointSaved


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a job started with resume points started from (the stream's first message).

    Attributes:
        episode: The restored checkpoint's episode; 0 when none restored (from scratch).
        best_reward: The best reward through ``episode``.
        skipped: The candidates that did not restore: (episode, why).
    """

    episode: int
    best_reward: float
    skipped: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class CheckpointFailed:
    """A checkpoint the job could not write; training went on."""

    episode: int
    message: str


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the other trainers' ranks of a job that spans trainers join it
    (``TrainResponse.rendezvous``): sent by rank 0's trainer after ``Resumed``, if any, and
    before any episode.

    Attributes:
        address: ``HOST:PORT`` on rank 0's trainer.
    """

    address: str


@dataclass(frozen=True, slots=True)
class JobPlacement:
    """One trainer's share of a job whose ranks span several trainers
    (``TrainRequest.placement``).

    Attributes:
        world_size: Processes in the whole job (the task's ``grpo.num_processes``).
        first_rank: The rank of this trainer's first process.
        processes: Processes (slots) of the job on this trainer, at least 1.
        rendezvous: ``HOST:PORT`` of the job's rendezvous: "" on rank 0's trainer (it
            announces one), the address it announced on the others.
    """

    world_size: int
    first_rank: int
    processes: int
    rendezvous: str = ""


#: What a trainer stream yields: an episode, a heartbeat (None), a checkpoint event or the
#: rendezvous of a job that spans trainers.
StreamEvent: TypeAlias = (
    episode_pb2.Episode | CheckpointSaved | Resumed | CheckpointFailed | Rendezvous | None
)


@dataclass(frozen=True, slots=True)
class Cancelled:
    """What ``cancel_job`` achieved.

    Attributes:
        last_episode: The job's last produced episode (0: none, or the job was gone).
        checkpoint: The final checkpoint, when one was asked for and written.
        checkpoint_error: Why the final checkpoint was not written, when one was asked for.
    """

    last_episode: int = 0
    checkpoint: CheckpointSaved | None = None
    checkpoint_error: str = ""


class TrainerStream(Protocol):
    """One ``Train`` call: an async iterator of ``StreamEvent``."""

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    async def __anext__(self) -> StreamEvent: ...

    def cancel(self) -> None:
        """Cancels the call (the trainer frees its slot)."""


class TrainerConnector(Protocol):
    """Reaches trainers by address."""

    async def capabilities(self, address: str, timeout: float) -> Capabilities:
        """Asks a trainer what it offers; raises ``TrainerError`` when it cannot be reached."""
        ...

    def train(
        self,
        address: str,
        run_id: str,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig,
        grant_through_episode: int = 0,
        attach_after_episode: int | None = None,
        resume_from: Sequence[ResumePoint] = (),
        placement: JobPlacement | None = None,
    ) -> TrainerStream:
        """Starts a ``Train`` call: a new job (from the first of ``resume_from`` that restores,
        newest first, else from scratch), or a re-attach after ``attach_after_episode``. With
        ``placement``, the job's share on this trainer of a job that spans trainers (None: the
        whole job runs here)."""
        ...

    async def grant(self, address: str, run_id: str, through_episode: int, timeout: float) -> int:
        """Moves a job's grant forward; returns its last produced episode. Raises
        ``TrainerError``."""
        ...

    async def cancel_job(
        self, address: str, run_id: str, timeout: float, checkpoint: bool = False
    ) -> Cancelled:
        """Cancels a job (a job that is already gone is fine), at once or, with ``checkpoint``,
        once it wrote a final checkpoint of its last episode. Raises ``TrainerError``."""
        ...

    async def set_hyperparameters(
        self, address: str, run_id: str, change: Hyperparameters, timeout: float
    ) -> None:
        """Changes a job's hyperparameters from its next optimizer step. Raises
        ``TrainerRefused``, ``TrainerJobFinished``, ``TrainerJobGone`` (no such job) or another
        ``TrainerError``."""
        ...

    async def close(self) -> None:
        """Closes every connection."""
        ...


async def next_event(
    events: AsyncIterator[StreamEvent], timeout: float, silent: str
) -> StreamEvent:
    """The next event of a trainer stream, waiting at most ``timeout`` seconds.

    Raises:
        StopAsyncIteration: The stream ended.
        TrainerLost: Nothing came for ``timeout`` seconds (``silent`` says what did not come
            from whom: ``no heartbeat from HOST:PORT``), or the stream broke.
    """
    try:
        async with asyncio.timeout(timeout):
            return await events.__anext__()
    except TimeoutError:
        raise TrainerLost(f"{silent} for {timeout:g} s") from None


@dataclass(frozen=True, slots=True)
class MergedCheckpoint:
    """A merged model a trainer streams: its record (the checkpoint's episode and time, the
    merged tar's size and digest) and the tar's bytes. ``chunks`` raises ``TrainerError`` when
    the stream breaks; ``cancel`` ends the call."""

    record: CheckpointSaved
    chunks: AsyncIterator[bytes]
    cancel: Callable[[], None]


@runtime_checkable
class CheckpointMerger(Protocol):
    """Asks trainers for LoRA checkpoints merged into their base model (``MergeCheckpoint``)."""

    async def merge_checkpoint(
        self, address: str, run_id: str, checkpoint: CheckpointSaved, timeout: float
    ) -> MergedCheckpoint:
        """Has the trainer at ``address`` merge ``checkpoint`` of ``run_id``; returns once its
        record arrived. Raises ``TrainerMergeFailed`` when the trainer refused or failed, or
        another ``TrainerError`` when it cannot be reached."""
        ...
