"""The gRPC side of reaching trainers: ``GrpcTrainerConnector`` implements the core's
``TrainerConnector`` over ``trainwire.v1.TrainerService`` and maps trainer statuses to the
core's ``TrainerError`` kinds, whose text the core logs as is: a TLS name mismatch says there
what to set (``--trainer-server-name``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2

from gateway.convert import capabilities_from_proto, checkpoint_to_proto
from gateway.core.trainers import (
    Cancelled,
    Capabilities,
    CheckpointFailed,
    CheckpointSaved,
    JobPlacement,
    MergedCheckpoint,
    Rendezvous,
    Resumed,
    ResumePoint,
    StreamEvent,
    TrainerBrokeContract,
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobFinished,
    TrainerJobGone,
    TrainerLost,
    TrainerMergeFailed,
    TrainerProcessDied,
    TrainerRefused,
    TrainerUnreachable,
)
from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters
from trainwire.reasons import ERROR_DOMAIN, ErrorReason
from trainwire.tls import is_name_mismatch, target_host
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

_LOGGER = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 16 << 20),
    # Reconnect quickly after a trainer restart instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
)
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
#: How gRPC words a refused TCP connection in the status of a call that could not connect
#: (``failed to connect to all addresses; last error: ...: Connection refused``).
_REFUSED = "connection refused"
_LOST_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def _rich_details(error: grpc.aio.AioRpcError) -> list[object]:
    """The unpacked ``LocalizedMessage``, ``ErrorInfo`` and ``BadRequest`` details of a
    status."""
    found: list[object] = []
    for key, value in error.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # malformed details are the trainer's bug, not ours
            return found
        for detail in status.details:
            for kind in (
                error_details_pb2.LocalizedMessage,
                error_details_pb2.ErrorInfo,
                error_details_pb2.BadRequest,
            ):
                if detail.Is(kind.DESCRIPTOR):
                    message = kind()
                    detail.Unpack(message)
                    found.append(message)
    return found


def localized_message(error: grpc.aio.AioRpcError) -> str | None:
    """The ``google.rpc.LocalizedMessage`` text in a status's details, if any."""
    for detail in _rich_details(error):
        if isinstance(detail, error_details_pb2.LocalizedMessage) and detail.message:
            return detail.message
    return None


def error_reason(error: grpc.aio.AioRpcError) -> str:
    """The ``google.rpc.ErrorInfo`` reason in a status's details ("" when none)."""
    for detail in _rich_details(error):
        if isinstance(detail, error_details_pb2.ErrorInfo) and detail.domain == ERROR_DOMAIN:
            return detail.reason
    return ""


#: ErrorInfo reasons of the trainer (trainwire.reasons) that the gateway acts on.
_REASONS: dict[str, type[TrainerError]] = {
    ErrorReason.SLOTS_BUSY: TrainerBusy,
    ErrorReason.JOB_EXISTS: TrainerJobExists,
    ErrorReason.JOB_NOT_FOUND: TrainerJobGone,
    ErrorReason.EPISODES_NOT_HELD: TrainerJobGone,
    ErrorReason.CONTRACT_VIOLATION: TrainerBrokeContract,
}


def failure_detail(error: grpc.aio.AioRpcError, address: str, server_name: str | None) -> str:
    """The log text of a failed trainer call: the address and the status; for a certificate
    that does not carry the name checked, first what to set.

    Args:
        error: The failed call.
        address: The trainer's address.
        server_name: The gateway's ``--trainer-server-name`` (``None`` when not set).
    """
    status = f"{error.code().name}: {error.details()}"
    if not is_name_mismatch(error.details() or ""):
        return f"trainer {address}: {status}"
    if server_name is None:
        hint = (
            f"its TLS certificate does not name {target_host(address)}: start the gateway with "
            "--trainer-server-name set to a name the certificate carries"
        )
    else:
        hint = (
            f"its TLS certificate does not name {server_name} (--trainer-server-name): set it to "
            "a name the certificate carries"
        )
    return f"trainer {address}: {hint} ({status})"


def refused(error: grpc.aio.AioRpcError) -> bool:
    """Whether a call failed because the trainer's address refused the connection: gRPC's own
    ``UNAVAILABLE`` before any answer (no reason from the trainer), naming ``ECONNREFUSED``."""
    if error.code() != grpc.StatusCode.UNAVAILABLE or error_reason(error):
        return False
    return _REFUSED in (error.details() or "").lower()


def classify(
    error: grpc.aio.AioRpcError, address: str, server_name: str | None = None
) -> TrainerError:
    """Maps a trainer's non-OK status to the core's error kinds.

    Busy is ``RESOURCE_EXHAUSTED`` with reason ``SLOTS_BUSY`` and nothing else: any other
    ``RESOURCE_EXHAUSTED`` (a message too large, out of memory) fails the run, with the trainer's
    ``LocalizedMessage`` when it sent one. A connection the trainer's address refused is
    ``TrainerUnreachable`` (the trainer is gone with its jobs). ``server_name`` is the gateway's
    ``--trainer-server-name``, for the text of a TLS name mismatch (``failure_detail``).
    """
    code = error.code()
    detail = failure_detail(error, address, server_name)
    kind = _REASONS.get(error_reason(error))
    if kind is not None:
        return kind(detail)
    text = localized_message(error)
    if text is not None:
        if error_reason(error) == ErrorReason.PROCESS_DIED:
            return TrainerProcessDied(detail, text)
        return TrainerFailed(detail, text)
    if refused(error):
        return TrainerUnreachable(detail)
    if code in _LOST_CODES:
        return TrainerLost(detail)
    return TrainerCrashed(detail)


def hyperparameters_error(
    error: grpc.aio.AioRpcError, address: str, server_name: str | None = None
) -> TrainerError:
    """Maps a failed ``SetHyperparameters`` to the core's error kinds: ``INVALID_ARGUMENT`` is
    ``TrainerRefused`` (its ``LocalizedMessage`` and ``BadRequest``), reason ``JOB_FINISHED``
    ``TrainerJobFinished``, the rest as ``classify`` says."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        details = _rich_details(error)
        violations = [
            FieldViolation(v.field, v.description)
            for d in details
            if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations
        ]
        text = localized_message(error) or error.details() or "refused by the trainer"
        return TrainerRefused(failure_detail(error, address, server_name), text, violations)
    if error_reason(error) == ErrorReason.JOB_FINISHED:
        return TrainerJobFinished(failure_detail(error, address, server_name))
    return classify(error, address, server_name)


def merge_error(
    error: grpc.aio.AioRpcError, address: str, server_name: str | None = None
) -> TrainerError:
    """A failed ``MergeCheckpoint``: ``TrainerLost`` when the trainer cannot be reached,
    ``TrainerMergeFailed`` (its code and message for people) when it answered."""
    detail = failure_detail(error, address, server_name)
    if error.code() in _LOST_CODES and error.code() != grpc.StatusCode.UNAVAILABLE:
        return TrainerLost(detail)
    if error.code() == grpc.StatusCode.UNAVAILABLE and not error_reason(error):
        return TrainerLost(detail)  # no answer from the service itself: not reachable
    user = localized_message(error) or (error.details() or error.code().name)
    return TrainerMergeFailed(detail, error.code().name, user)


def checkpoint_saved(message: episode_pb2.Checkpoint) -> CheckpointSaved:
    """The core's record of a ``Checkpoint`` message."""
    return CheckpointSaved(
        episode=message.episode,
        create_time=message.create_time.ToNanoseconds(),
        size_bytes=message.size_bytes,
        sha256=message.sha256,
    )


def stream_event(message: trainer_service_pb2.TrainResponse) -> StreamEvent:
    """The core's event of one ``TrainResponse``."""
    kind = message.WhichOneof("event")
    if kind == "episode":
        return message.episode
    if kind == "checkpoint":
        return checkpoint_saved(message.checkpoint)
    if kind == "resumed":
        resumed = message.resumed
        episode = resumed.checkpoint.checkpoint.episode if resumed.HasField("checkpoint") else 0
        return Resumed(
            episode=episode,
            best_reward=resumed.best_reward if episode else 0.0,
            skipped=tuple((s.episode, s.reason) for s in resumed.skipped),
        )
    if kind == "checkpoint_failure":
        failure = message.checkpoint_failure
        return CheckpointFailed(failure.episode, failure.message)
    if kind == "rendezvous":
        return Rendezvous(message.rendezvous.address)
    return None  # a heartbeat (or an event this gateway does not know yet)


def train_request(
    run_id: str,
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig,
    grant_through_episode: int = 0,
    attach_after_episode: int | None = None,
    resume_from: Sequence[ResumePoint] = (),
    placement: JobPlacement | None = None,
) -> trainer_service_pb2.TrainRequest:
    """The ``TrainRequest`` of a ``train`` call (``placement`` None leaves it unset: the whole
    job runs on the trainer)."""
    return trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=task,
        config=config,
        grant_through_episode=grant_through_episode,
        attach_after_episode=attach_after_episode,
        resume_from=[
            trainer_service_pb2.CheckpointRef(
                run_id=point.run_id, checkpoint=checkpoint_to_proto(point.checkpoint)
            )
            for point in resume_from
        ],
        placement=None
        if placement is None
        else trainer_service_pb2.JobPlacement(
            world_size=placement.world_size,
            first_rank=placement.first_rank,
            processes=placement.processes,
            rendezvous=placement.rendezvous,
        ),
    )


class _GrpcTrainerStream:
    """One ``Train`` call as an async iterator of ``StreamEvent`` (``None`` for heartbeats)."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, address: str, server_name: str | None
    ) -> None:
        self._call = call
        self._address = address
        self._server_name = server_name

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise classify(exc, self._address, self._server_name) from None
        except grpc.RpcError as exc:  # pragma: no cover - defensive: other RpcError shapes
            raise TrainerCrashed(f"trainer {self._address}: {exc}") from None
        if message is grpc.aio.EOF:
            code = await self._call.code()
            if code != grpc.StatusCode.OK:  # pragma: no cover - read() raises for these
                raise TrainerCrashed(f"trainer {self._address}: {code.name}")
            raise StopAsyncIteration
        assert isinstance(message, trainer_service_pb2.TrainResponse)
        return stream_event(message)

    def cancel(self) -> None:
        self._call.cancel()


class GrpcTrainerConnector:
    """Reaches trainers over gRPC, one channel per address (created on first use).

    New credentials (a certificate reload) retire the channels in use: a retired channel is
    closed as soon as its last call ends, so each reload costs nothing once its streams are over.

    Args:
        credentials: TLS (and a client certificate for trainers that require one); plaintext
            without.
        server_name: With TLS, the name trainers' certificates must carry instead of the host
            in their address.
    """

    def __init__(
        self, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None
    ) -> None:
        self._credentials = credentials
        self._server_name = server_name
        self._options: tuple[tuple[str, int | str], ...] = _CHANNEL_OPTIONS
        if server_name is not None:
            self._options += (("grpc.ssl_target_name_override", server_name),)
        # The current channel to each address, and its stub.
        self._channels: dict[
            str, tuple[grpc.aio.Channel, trainer_service_pb2_grpc.TrainerServiceStub]
        ] = {}
        self._calls: dict[grpc.aio.Channel, int] = {}  # calls not yet ended, per channel
        self._retired: set[grpc.aio.Channel] = set()  # replaced, closed when their calls end
        self._closing: dict[grpc.aio.Channel, asyncio.Task[None]] = {}

    def set_credentials(self, credentials: grpc.ChannelCredentials) -> None:
        """New credentials (re-read certificates): later calls go over new channels with them;
        calls open on the old channels (Train streams) go on until they end, and each old
        channel is closed after its last call."""
        self._credentials = credentials
        for channel, _ in self._channels.values():
            if self._calls.get(channel):
                self._retired.add(channel)
            else:
                self._close_soon(channel)
        self._channels.clear()

    @property
    def open_channels(self) -> int:
        """Channels not yet closed: the current ones and retired ones with calls still open."""
        return len(self._channels) + len(self._retired) + len(self._closing)

    def _close_soon(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=None))
        self._closing[channel] = task
        task.add_done_callback(lambda _: self._closing.pop(channel, None))

    def _open(
        self, address: str
    ) -> tuple[grpc.aio.Channel, trainer_service_pb2_grpc.TrainerServiceStub]:
        """The channel to ``address`` and its stub, with one more call counted on it (end it
        with ``_ended``)."""
        if address not in self._channels:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
            else:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = (
                channel,
                trainer_service_pb2_grpc.TrainerServiceStub(channel),
            )
        channel, stub = self._channels[address]
        self._calls[channel] = self._calls.get(channel, 0) + 1
        return channel, stub

    def _ended(self, channel: grpc.aio.Channel) -> None:
        left = self._calls[channel] - 1
        if left:
            self._calls[channel] = left
            return
        del self._calls[channel]
        if channel in self._retired:
            self._retired.discard(channel)
            self._close_soon(channel)

    async def capabilities(self, address: str, timeout: float) -> Capabilities:
        """Asks a trainer for its providers and free slots."""
        channel, stub = self._open(address)
        try:
            reply = await stub.GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            detail = failure_detail(exc, address, self._server_name)
            raise (TrainerUnreachable if refused(exc) else TrainerLost)(detail) from None
        finally:
            self._ended(channel)
        return capabilities_from_proto(reply)

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
    ) -> _GrpcTrainerStream:
        """Starts a ``Train`` call (no deadline: the heartbeat timeout guards it)."""
        request = train_request(
            run_id,
            task,
            config,
            grant_through_episode,
            attach_after_episode,
            resume_from,
            placement,
        )
        channel, stub = self._open(address)
        call = stub.Train(request)
        call.add_done_callback(lambda _: self._ended(channel))
        return _GrpcTrainerStream(call, address, self._server_name)

    async def grant(self, address: str, run_id: str, through_episode: int, timeout: float) -> int:
        """Moves a job's grant forward; returns its last produced episode."""
        channel, stub = self._open(address)
        try:
            reply = await stub.Grant(
                trainer_service_pb2.GrantRequest(run_id=run_id, through_episode=through_episode),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise classify(exc, address, self._server_name) from None
        finally:
            self._ended(channel)
        return reply.last_episode

    async def cancel_job(
        self, address: str, run_id: str, timeout: float, checkpoint: bool = False
    ) -> Cancelled:
        """Cancels a job (with ``checkpoint``, once its final checkpoint is written); a job
        that is already gone is fine."""
        channel, stub = self._open(address)
        try:
            reply = await stub.CancelJob(
                trainer_service_pb2.CancelJobRequest(run_id=run_id, checkpoint=checkpoint),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise classify(exc, address, self._server_name) from None
            return Cancelled(checkpoint_error="the job was gone" if checkpoint else "")
        finally:
            self._ended(channel)
        return Cancelled(
            last_episode=reply.last_episode,
            checkpoint=checkpoint_saved(reply.checkpoint) if reply.HasField("checkpoint") else None,
            checkpoint_error=reply.checkpoint_error,
        )

    async def set_hyperparameters(
        self, address: str, run_id: str, change: Hyperparameters, timeout: float
    ) -> None:
        """Changes a job's hyperparameters from its next optimizer step."""
        channel, stub = self._open(address)
        try:
            await stub.SetHyperparameters(
                trainer_service_pb2.SetHyperparametersRequest(run_id=run_id, **change.as_dict()),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise hyperparameters_error(exc, address, self._server_name) from None
        finally:
            self._ended(channel)

    async def merge_checkpoint(
        self, address: str, run_id: str, checkpoint: CheckpointSaved, timeout: float
    ) -> MergedCheckpoint:
        """Has a trainer merge a LoRA checkpoint (``MergeCheckpoint``); returns once its record
        arrived, with the rest of its tar to read."""
        channel, stub = self._open(address)
        call = stub.MergeCheckpoint(
            trainer_service_pb2.MergeCheckpointRequest(
                run_id=run_id, checkpoint=checkpoint_to_proto(checkpoint)
            ),
            timeout=timeout,
        )
        call.add_done_callback(lambda _: self._ended(channel))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise merge_error(exc, address, self._server_name) from None
        if first is grpc.aio.EOF or first.WhichOneof("content") != "checkpoint":
            call.cancel()
            raise TrainerCrashed(f"trainer {address}: MergeCheckpoint sent no record first")

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                try:
                    message = await call.read()
                except grpc.aio.AioRpcError as exc:
                    raise merge_error(exc, address, self._server_name) from None
                if message is grpc.aio.EOF:
                    return
                if message.WhichOneof("content") == "chunk":
                    yield message.chunk

        return MergedCheckpoint(checkpoint_saved(first.checkpoint), chunks(), call.cancel)

    async def close(self) -> None:
        """Closes every channel (cancelling calls still open)."""
        channels = [channel for channel, _ in self._channels.values()] + [*self._retired]
        self._channels.clear()
        self._retired.clear()
        for channel in channels:
            await channel.close(grace=None)
        await asyncio.gather(*self._closing.values())
