"""The gRPC side of reaching trainers: ``GrpcTrainerConnector`` implements the core's
``TrainerConnector`` over ``trainwire.v1.TrainerService`` and maps trainer statuses to the
core's ``TrainerError`` kinds."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from google.rpc import error_details_pb2, status_pb2

from gateway.core.trainers import (
    Capabilities,
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerLost,
)
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

_LOGGER = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 16 << 20),
    # Reconnect quickly after a trainer restart instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
)
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_LOST_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def localized_message(error: grpc.aio.AioRpcError) -> str | None:
    """The ``google.rpc.LocalizedMessage`` text in a status's details, if any."""
    for key, value in error.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # malformed details are the trainer's bug, not ours
            return None
        for detail in status.details:
            if detail.Is(error_details_pb2.LocalizedMessage.DESCRIPTOR):
                message = error_details_pb2.LocalizedMessage()
                detail.Unpack(message)
                if message.message:
                    return message.message
    return None


def classify(error: grpc.aio.AioRpcError, address: str) -> TrainerError:
    """Maps a trainer's non-OK status to the core's error kinds."""
    code = error.code()
    detail = f"trainer {address}: {code.name}: {error.details()}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return TrainerBusy(detail)
    text = localized_message(error)
    if text is not None:
        return TrainerFailed(detail, text)
    if code in _LOST_CODES:
        return TrainerLost(detail)
    return TrainerCrashed(detail)


class _GrpcTrainerStream:
    """One ``Train`` call as an async iterator of episodes (``None`` for heartbeats)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self._call = call
        self._address = address

    def __aiter__(self) -> AsyncIterator[episode_pb2.Episode | None]:
        return self

    async def __anext__(self) -> episode_pb2.Episode | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise classify(exc, self._address) from None
        except grpc.RpcError as exc:  # pragma: no cover - defensive: other RpcError shapes
            raise TrainerCrashed(f"trainer {self._address}: {exc}") from None
        if message is grpc.aio.EOF:
            code = await self._call.code()
            if code != grpc.StatusCode.OK:  # pragma: no cover - read() raises for these
                raise TrainerCrashed(f"trainer {self._address}: {code.name}")
            raise StopAsyncIteration
        assert isinstance(message, trainer_service_pb2.TrainResponse)
        if message.WhichOneof("event") == "episode":
            return message.episode
        return None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcTrainerConnector:
    """Reaches trainers over gRPC, one channel per address (created on first use)."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, trainer_service_pb2_grpc.TrainerServiceStub] = {}

    def _stub(self, address: str) -> trainer_service_pb2_grpc.TrainerServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            self._stubs[address] = stub
        return stub

    async def capabilities(self, address: str, timeout: float) -> Capabilities:
        """Asks a trainer for its providers and free slots."""
        try:
            reply = await self._stub(address).GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise TrainerLost(f"trainer {address}: {exc.code().name}: {exc.details()}") from None
        return Capabilities(tuple(reply.providers), reply.slots_total, reply.slots_free)

    def train(
        self,
        address: str,
        run_id: str,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig,
    ) -> _GrpcTrainerStream:
        """Starts a ``Train`` call (no deadline: the heartbeat timeout guards it)."""
        request = trainer_service_pb2.TrainRequest(run_id=run_id, task=task, config=config)
        return _GrpcTrainerStream(self._stub(address).Train(request), address)

    async def close(self) -> None:
        """Closes every channel (cancelling calls still open)."""
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
        self._stubs.clear()
