"""What the core needs from a trainer, without grpc: capabilities and an episode stream.

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
    """The trainer has no free slot (``RESOURCE_EXHAUSTED``); the run goes back in the queue."""


class TrainerFailed(TrainerError):
    """The provider failed and said why, for users (a ``google.rpc.LocalizedMessage``)."""

    def __init__(self, detail: str, user_message: str) -> None:
        super().__init__(detail)
        self.user_message = user_message


class TrainerLost(TrainerError):
    """The stream broke (connection lost, trainer killed)."""


class TrainerCrashed(TrainerError):
    """Any other failure of the trainer."""


@dataclass(frozen=True)
class Capabilities:
    """What a trainer offers and how busy it is."""

    providers: tuple[str, ...]
    slots_total: int
    slots_free: int


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
    ) -> TrainerStream:
        """Starts a ``Train`` call."""
        ...

    async def close(self) -> None:
        """Closes every connection."""
        ...
