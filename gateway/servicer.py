"""``GatewayService`` over the core: each method parses, calls the core once, converts.

Errors are mapped to statuses by ``gateway.status.map_errors``; the API contract (fields,
status codes) is documented in ``protos/trainwire/v1/gateway_service.proto``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from gateway import convert
from gateway.auth import current_principal
from gateway.core.errors import InvalidRequest
from gateway.core.registry import EpisodeFrames, RunRegistry
from gateway.status import map_errors, to_status
from trainwire.contract import FieldViolation
from trainwire.v1 import gateway_service_pb2 as pb


class GatewayServicer:
    """The ``trainwire.v1.GatewayService`` implementation (``grpc.aio``)."""

    def __init__(self, core: RunRegistry) -> None:
        self._core = core
        # The last live event converted and its message: the watchers a wake-up wakes at the
        # same place get one shared event (``EpisodeLog.frames_event``), encoded once here.
        self._shared: tuple[EpisodeFrames, bytes | pb.WatchRunResponse] | None = None

    @map_errors
    async def CreateRun(
        self, request: pb.CreateRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateRunResponse:
        """Creates a run (idempotent per request_id)."""
        spec = convert.run_spec_from_proto(request)
        caller = current_principal()
        if caller is not None:
            spec = dataclasses.replace(spec, creator=caller.name)
        run = await self._core.create(spec)
        return pb.CreateRunResponse(run=convert.run_to_proto(run))

    @map_errors
    async def GetRun(
        self, request: pb.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRunResponse:
        """Returns one run."""
        return pb.GetRunResponse(run=convert.run_to_proto(await self._core.get(request.run_id)))

    @map_errors
    async def ListRuns(
        self, request: pb.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRunsResponse:
        """Lists the runs a filter finds, newest first unless order_by says otherwise."""
        view = convert.view_from_proto(request.view)
        runs, token = await self._core.list_runs(
            request.page_size,
            request.page_token,
            convert.state_from_proto(request.state),
            request.filter,
            request.order_by,
        )
        return pb.ListRunsResponse(
            runs=[convert.run_to_proto(r, view) for r in runs], next_page_token=token
        )

    @map_errors
    async def PauseRun(
        self, request: pb.PauseRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseRunResponse:
        """Pauses a run."""
        return pb.PauseRunResponse(run=convert.run_to_proto(await self._core.pause(request.run_id)))

    @map_errors
    async def ResumeRun(
        self, request: pb.ResumeRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeRunResponse:
        """Resumes a run."""
        run = await self._core.resume(request.run_id)
        return pb.ResumeRunResponse(run=convert.run_to_proto(run))

    @map_errors
    async def StopRun(
        self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopRunResponse:
        """Stops a run."""
        return pb.StopRunResponse(run=convert.run_to_proto(await self._core.stop(request.run_id)))

    @map_errors
    async def SetRunSpeed(
        self, request: pb.SetRunSpeedRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRunSpeedResponse:
        """Changes a run's speed."""
        run = await self._core.set_speed(request.run_id, request.speed)
        return pb.SetRunSpeedResponse(run=convert.run_to_proto(run))

    @map_errors
    async def DeleteRun(
        self, request: pb.DeleteRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteRunResponse:
        """Deletes a finished run and its history."""
        run = await self._core.delete(request.run_id)
        return pb.DeleteRunResponse(run=convert.run_to_proto(run))

    @map_errors
    async def WatchRun(
        self, request: pb.WatchRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes | pb.WatchRunResponse]:
        """Streams a run: history (batched), caught_up, live episodes, keepalives, finished."""
        if isinstance(request, Undecodable):
            # Checked here, not by a wrapping generator: every message of a watch would pay
            # for one more generator layer.
            raise request.error()
        scalars = convert.scalars_from_proto(request.view, request.run_id)
        async for event in self._core.watch(request.run_id, request.after_episode, scalars):
            if type(event) is EpisodeFrames:
                shared = self._shared
                if shared is None or shared[0] is not event:
                    shared = self._shared = (event, convert.watch_event_to_wire(event))
                yield shared[1]
            else:
                yield convert.watch_event_to_wire(event)

    @map_errors
    async def UpdateRun(
        self, request: pb.UpdateRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateRunResponse:
        """Sets a run's display_name and/or labels, as its update_mask says."""
        name, labels = convert.update_from_proto(request)
        run = await self._core.update(request.run.id, name, labels)
        return pb.UpdateRunResponse(run=convert.run_to_proto(run))

    @map_errors
    async def SetRunHyperparameters(
        self, request: pb.SetRunHyperparametersRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRunHyperparametersResponse:
        """Changes a live run's hyperparameters from its next optimizer step."""
        change = convert.hyperparameters_from_proto(request)
        run = await self._core.set_hyperparameters(request.run_id, change)
        return pb.SetRunHyperparametersResponse(run=convert.run_to_proto(run))

    @map_errors
    async def GetRunCurve(
        self, request: pb.GetRunCurveRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRunCurveResponse:
        """A run's curve as contiguous buckets (see ``gateway.core.curve``)."""
        buckets, last = await self._core.curve(
            request.run_id,
            request.buckets,
            list(request.metrics),
            request.first_episode,
            request.last_episode,
        )
        return pb.GetRunCurveResponse(
            buckets=[convert.bucket_to_proto(b) for b in buckets], last_episode=last
        )

    @map_errors
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        """Lists a run's checkpoints, oldest first."""
        records = await self._core.list_checkpoints(request.run_id)
        return pb.ListCheckpointsResponse(
            checkpoints=[convert.checkpoint_to_proto(r) for r in records]
        )

    @map_errors
    async def DownloadCheckpoint(
        self, request: pb.DownloadCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DownloadCheckpointResponse]:
        """Streams a checkpoint (or a LoRA checkpoint merged into its base model): its record,
        then its tar in chunks (each written before the next is read, so memory stays flat in
        the checkpoint's size)."""
        if isinstance(request, Undecodable):
            raise request.error()
        record, chunks = await self._core.open_checkpoint(
            request.run_id, request.episode, request.merged
        )
        yield pb.DownloadCheckpointResponse(checkpoint=convert.checkpoint_to_proto(record))
        async for chunk in chunks:
            yield pb.DownloadCheckpointResponse(chunk=chunk)


def _serialize_watch_response(message: bytes | pb.WatchRunResponse) -> bytes:
    # Episodes arrive pre-encoded (gateway.core.framing): send those bytes untouched.
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


class Undecodable:
    """What a request that does not parse deserializes to; the handler answers it
    ``INVALID_ARGUMENT`` instead of gRPC's ``UNKNOWN``/``INTERNAL``."""

    def __init__(self, message_type: type[Message]) -> None:
        self.full_name = message_type.DESCRIPTOR.full_name

    def error(self) -> InvalidRequest:
        """The domain error it is answered with."""
        return InvalidRequest(
            f"the request is not a valid {self.full_name}",
            [FieldViolation("(request)", f"does not parse as {self.full_name}")],
        )


def _deserializer(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError, or worse: never a traceback to the client
            return Undecodable(message_type)

    return deserialize


def _guard_unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort_with_status(to_status(request.error()))
        return await handler(request, context)

    return guarded


#: The unary methods and their message types: the one hand-kept copy of the service
#: (``tests/unit/test_proto_copies.py`` checks it against the proto).
UNARY_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "CreateRun": (pb.CreateRunRequest, pb.CreateRunResponse),
    "GetRun": (pb.GetRunRequest, pb.GetRunResponse),
    "ListRuns": (pb.ListRunsRequest, pb.ListRunsResponse),
    "PauseRun": (pb.PauseRunRequest, pb.PauseRunResponse),
    "ResumeRun": (pb.ResumeRunRequest, pb.ResumeRunResponse),
    "StopRun": (pb.StopRunRequest, pb.StopRunResponse),
    "SetRunSpeed": (pb.SetRunSpeedRequest, pb.SetRunSpeedResponse),
    "DeleteRun": (pb.DeleteRunRequest, pb.DeleteRunResponse),
    "ListCheckpoints": (pb.ListCheckpointsRequest, pb.ListCheckpointsResponse),
    "GetRunCurve": (pb.GetRunCurveRequest, pb.GetRunCurveResponse),
    "UpdateRun": (pb.UpdateRunRequest, pb.UpdateRunResponse),
    "SetRunHyperparameters": (pb.SetRunHyperparametersRequest, pb.SetRunHyperparametersResponse),
}


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """Registers the servicer; like the generated ``add_GatewayServiceServicer_to_server``
    except that ``WatchRun`` responses may be pre-encoded bytes and a request that does not
    parse is answered ``INVALID_ARGUMENT``. The streams (``WatchRun``, ``DownloadCheckpoint``)
    are registered apart from ``UNARY_METHODS``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            _guard_unary(getattr(servicer, name)),
            request_deserializer=_deserializer(req),
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in UNARY_METHODS.items()
    }
    handlers["WatchRun"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchRun,
        request_deserializer=_deserializer(pb.WatchRunRequest),
        response_serializer=_serialize_watch_response,
    )
    handlers["DownloadCheckpoint"] = grpc.unary_stream_rpc_method_handler(
        servicer.DownloadCheckpoint,
        request_deserializer=_deserializer(pb.DownloadCheckpointRequest),
        response_serializer=pb.DownloadCheckpointResponse.SerializeToString,
    )
    service = pb.DESCRIPTOR.services_by_name["GatewayService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
