"""What the core needs from a trainer, without grpc: capabilities, an episode stream, grants
and cancellation.

``gateway.trainer_client`` implements ``TrainerConnector`` over gRPC; tests may plug in others.
A stream yields ``Episode`` messages and ``None`` for heartbeats, and raises one of the
``TrainerError`` subclasses below when it fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from trainwire.v1 import episode_pb2


class TrainerError(Exception):
    """A trainer stream failed; ``str(exc)`` is the detail for the log."""


class TrainerBusy(TrainerError):
    """The trainer has no free slot (``RESOURCE_EXHAUSTED`` with reason ``SLOTS_BUSY``, and only
    that); the run goes back in the queue."""


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


class TrainerLost(TrainerError):
    """The stream broke (connection lost, trainer killed)."""


class TrainerBrokeContract(TrainerError):
    """The trainer's own contract check stopped its stream (``INTERNAL`` with reason
    ``CONTRACT_VIOLATION``): users read what a violation the gateway catches reads."""


class TrainerCrashed(TrainerError):
    """Any other failure of the trainer."""


@dataclass(frozen=True)
class Capabilities:
    """What a trainer offers and how busy it is: the fields of the trainer's own
    ``trainer_service.core.jobs.Capabilities`` (``GetCapabilitiesResponse``). Placement reads
    the first three; the rest say where a run trains."""

    providers: tuple[str, ...]
    slots_total: int
    slots_free: int
    device: str = ""
    torch_version: str = ""
    trl_version: str = ""
    server_version: str = ""


class TrainerStream(Protocol):
    """One ``Train`` call: an async iterator of episodes (``None`` = heartbeat)."""

    def __aiter__(self) -> AsyncIterator[episode_pb2.Episode | None]: ...

    async def __anext__(self) -> episode_pb2.Episode | None: ...

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
    ) -> TrainerStream:
        """Starts a ``Train`` call: a new job, or a re-attach after ``attach_after_episode``."""
        ...

    async def grant(self, address: str, run_id: str, through_episode: int, timeout: float) -> int:
        """Moves a job's grant forward; returns its last produced episode. Raises
        ``TrainerError``."""
        ...

    async def cancel_job(self, address: str, run_id: str, timeout: float) -> None:
        """Cancels a job at once (a job that is already gone is fine). Raises
        ``TrainerError``."""
        ...

    async def close(self) -> None:
        """Closes every connection."""
        ...
