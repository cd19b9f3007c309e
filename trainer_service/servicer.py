"""The TrainerService servicer (``grpc.aio``): parses requests, calls the job runner, converts
events. Errors become statuses in ``trainer_service.status`` only."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from trainer_service.core.checkpointing import checkpoint_message
from trainer_service.core.errors import InvalidRequest
from trainer_service.core.job_stream import JobStream, StreamEvent
from trainer_service.core.jobs import Gpu, Heartbeat, JobRunner, RunningJob
from trainer_service.core.merging import CheckpointMerges, MergedModel
from trainer_service.status import apply_status, to_status
from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2

_LOGGER = logging.getLogger(__name__)

#: The longest a ``CancelJob`` with a checkpoint waits for the final checkpoint (a GRPO step
#: and the save of a model), shortened to the call's own deadline.
FINAL_CHECKPOINT_TIMEOUT_S = 900.0
#: What is kept of the call's deadline to answer in time.
_ANSWER_MARGIN_S = 1.0


def heartbeat_to_proto(heartbeat: Heartbeat) -> trainer_service_pb2.Heartbeat:
    """Converts a core heartbeat to its message."""
    message = trainer_service_pb2.Heartbeat(
        last_episode=heartbeat.last_episode, phase=heartbeat.phase
    )
    message.time.FromNanoseconds(heartbeat.time_ns)
    return message


def event_to_proto(event: StreamEvent | Heartbeat) -> trainer_service_pb2.TrainResponse:
    """The ``TrainResponse`` of a stream's event."""
    if isinstance(event, Heartbeat):
        return trainer_service_pb2.TrainResponse(heartbeat=heartbeat_to_proto(event))
    if isinstance(event, episode_pb2.Episode):
        return trainer_service_pb2.TrainResponse(episode=event)
    if isinstance(event, episode_pb2.Checkpoint):
        return trainer_service_pb2.TrainResponse(checkpoint=event)
    if isinstance(event, trainer_service_pb2.Resumed):
        return trainer_service_pb2.TrainResponse(resumed=event)
    if isinstance(event, trainer_service_pb2.Rendezvous):
        return trainer_service_pb2.TrainResponse(rendezvous=event)
    return trainer_service_pb2.TrainResponse(checkpoint_failure=event)


def gpu_to_proto(gpu: Gpu) -> trainer_service_pb2.Gpu:
    """Converts a GPU's reading to its message."""
    return trainer_service_pb2.Gpu(
        index=gpu.index,
        name=gpu.name,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_used_bytes=gpu.memory_used_bytes,
        utilization=gpu.utilization,
    )


def hyperparameters_from_proto(
    request: trainer_service_pb2.SetHyperparametersRequest,
) -> Hyperparameters:
    """The change a ``SetHyperparametersRequest`` asks for (unset fields stay ``None``)."""
    return Hyperparameters(
        **{
            name: getattr(request, name) if request.HasField(name) else None
            for name in ("learning_rate", "temperature", "beta")
        }
    )


class TrainerServicer:
    """Serves ``trainwire.v1.TrainerService`` over a :class:`JobRunner` (and the
    :class:`CheckpointMerges` of merged downloads, over the runner's providers and store by
    default)."""

    def __init__(self, runner: JobRunner, merges: CheckpointMerges | None = None) -> None:
        self._runner = runner
        self._merges = merges or CheckpointMerges(
            runner.providers,
            runner.checkpoint_store,
            runner.settings.data_roots,
            runner.settings.scratch_dir,
        )

    async def Train(
        self, request: trainer_service_pb2.TrainRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_service_pb2.TrainResponse]:
        """Runs (or re-attaches to) a training job and streams its episodes, checkpoint events
        and heartbeats."""
        run_id = request.run_id
        # Off the loop: validation reads files and a provider's first use imports torch.
        opening = asyncio.ensure_future(asyncio.to_thread(self._runner.open, request))
        try:
            stream = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The call is gone but open goes on in its thread: the job it opens is detached as
            # a cancelled stream's is (kept for the detach grace when it has a grant).
            opening.add_done_callback(self._detach_opened)
            raise
        except Exception as exc:
            apply_status(context, to_status(exc, run_id))
            return
        try:
            async for event in stream.aevents():
                yield event_to_proto(event)
        except Exception as exc:
            apply_status(context, to_status(exc, run_id))
        finally:
            # However the RPC ended (done, failed, cancelled, disconnected): a stream that broke
            # leaves its job detached, kept for a re-attach.
            self._runner.detach(stream)

    def _detach_opened(self, opening: asyncio.Future[JobStream[RunningJob]]) -> None:
        """Detaches the stream that ``open`` made for a ``Train`` call cancelled meanwhile."""
        if not opening.cancelled() and opening.exception() is None:
            self._runner.detach(opening.result())

    async def Grant(
        self, request: trainer_service_pb2.GrantRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.GrantResponse:
        """Moves a job's grant forward."""
        try:
            last = self._runner.grant(request.run_id, request.through_episode)
        except Exception as exc:
            apply_status(context, to_status(exc, request.run_id))
            return trainer_service_pb2.GrantResponse()
        return trainer_service_pb2.GrantResponse(last_episode=last)

    async def CancelJob(
        self, request: trainer_service_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.CancelJobResponse:
        """Cancels a job at once, or after a final checkpoint."""
        try:
            if not request.checkpoint:
                last = self._runner.cancel_job(request.run_id)
                return trainer_service_pb2.CancelJobResponse(last_episode=last)
            timeout = FINAL_CHECKPOINT_TIMEOUT_S
            remaining = context.time_remaining()
            if remaining is not None:
                timeout = max(0.0, min(timeout, remaining - _ANSWER_MARGIN_S))
            final = await asyncio.to_thread(
                self._runner.cancel_with_checkpoint, request.run_id, timeout
            )
        except Exception as exc:
            apply_status(context, to_status(exc, request.run_id))
            return trainer_service_pb2.CancelJobResponse()
        response = trainer_service_pb2.CancelJobResponse(
            last_episode=final.last_episode, checkpoint_error=final.error
        )
        if final.checkpoint is not None:
            response.checkpoint.CopyFrom(checkpoint_message(final.checkpoint))
        return response

    async def SetHyperparameters(
        self,
        request: trainer_service_pb2.SetHyperparametersRequest,
        context: grpc.aio.ServicerContext,
    ) -> trainer_service_pb2.SetHyperparametersResponse:
        """Changes a live job's hyperparameters from its next optimizer step."""
        try:
            values, last = self._runner.set_hyperparameters(
                request.run_id, hyperparameters_from_proto(request)
            )
        except Exception as exc:
            apply_status(context, to_status(exc, request.run_id))
            return trainer_service_pb2.SetHyperparametersResponse()
        return trainer_service_pb2.SetHyperparametersResponse(last_episode=last, **values.as_dict())

    async def GetCapabilities(
        self,
        request: trainer_service_pb2.GetCapabilitiesRequest,
        context: grpc.aio.ServicerContext,
    ) -> trainer_service_pb2.GetCapabilitiesResponse:
        """Describes the providers, device and slots of this trainer."""
        # Off the loop: the first call imports the providers.
        caps = await asyncio.to_thread(self._runner.capabilities)
        return trainer_service_pb2.GetCapabilitiesResponse(
            providers=caps.providers,
            device=caps.device,
            slots_total=caps.slots_total,
            slots_free=caps.slots_free,
            torch_version=caps.torch_version,
            trl_version=caps.trl_version,
            server_version=caps.server_version,
            gpus=[gpu_to_proto(gpu) for gpu in caps.gpus],
            reward_functions=caps.reward_functions,
            provider_defaults=caps.provider_defaults,
        )

    async def MergeCheckpoint(
        self,
        request: trainer_service_pb2.MergeCheckpointRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_service_pb2.MergeCheckpointResponse]:
        """Merges a LoRA checkpoint into its base model and streams the merged tar."""
        run_id, checkpoint = request.run_id, request.checkpoint
        stop = threading.Event()
        merged: MergedModel | None = None
        merging = asyncio.ensure_future(
            asyncio.to_thread(
                self._merges.merge, run_id, checkpoint.episode, checkpoint.sha256, stop
            )
        )
        try:
            try:
                merged = await asyncio.shield(merging)
            except asyncio.CancelledError:
                # The merge's thread goes on until it sees stop: what it made is removed.
                merging.add_done_callback(_close_merged)
                raise
            yield trainer_service_pb2.MergeCheckpointResponse(
                checkpoint=checkpoint_message(merged.info)
            )
            chunks = merged.chunks()
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield trainer_service_pb2.MergeCheckpointResponse(chunk=chunk)
        except Exception as exc:
            apply_status(context, to_status(exc, run_id))
        finally:
            stop.set()  # a cancelled call stops the merge it waits for
            if merged is not None:
                await asyncio.to_thread(merged.close)


def _close_merged(future: asyncio.Future[MergedModel]) -> None:
    """Removes the merged model of a merge whose caller is gone."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class _Undecodable:
    """What a request that does not parse deserializes to; the handler answers it
    ``INVALID_ARGUMENT`` instead of gRPC's ``INTERNAL``."""

    def __init__(self, message_type: type[Message]) -> None:
        self.full_name = message_type.DESCRIPTOR.full_name

    def status(self) -> grpc.Status:
        return to_status(
            InvalidRequest(
                "",
                [FieldViolation("(request)", f"does not parse as {self.full_name}")],
                f"the request is not a valid {self.full_name}",
            ),
            "",
        )


def _deserializer(message_type: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    def deserialize(data: bytes) -> Message | _Undecodable:
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError, or worse: never a traceback to the client
            return _Undecodable(message_type)

    return deserialize


def _guard_unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            apply_status(context, request.status())
            return None
        return await handler(request, context)

    return guarded


def _guard_stream(handler: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            apply_status(context, request.status())
            return
        async for item in handler(request, context):
            yield item

    return guarded


#: Every method and its message types: the one hand-kept copy of the service
#: (a test checks it against the proto).
METHODS: dict[str, tuple[type[Message], type[Message], bool]] = {
    "Train": (trainer_service_pb2.TrainRequest, trainer_service_pb2.TrainResponse, True),
    "Grant": (trainer_service_pb2.GrantRequest, trainer_service_pb2.GrantResponse, False),
    "CancelJob": (
        trainer_service_pb2.CancelJobRequest,
        trainer_service_pb2.CancelJobResponse,
        False,
    ),
    "SetHyperparameters": (
        trainer_service_pb2.SetHyperparametersRequest,
        trainer_service_pb2.SetHyperparametersResponse,
        False,
    ),
    "GetCapabilities": (
        trainer_service_pb2.GetCapabilitiesRequest,
        trainer_service_pb2.GetCapabilitiesResponse,
        False,
    ),
    "MergeCheckpoint": (
        trainer_service_pb2.MergeCheckpointRequest,
        trainer_service_pb2.MergeCheckpointResponse,
        True,
    ),
}


def add_to_server(servicer: TrainerServicer, server: grpc.aio.Server) -> None:
    """Registers the servicer; like the generated ``add_TrainerServiceServicer_to_server``
    except that a request that does not parse is answered ``INVALID_ARGUMENT``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, (request_type, response_type, streaming) in METHODS.items():
        method = getattr(servicer, name)
        if streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _guard_stream(method),
                request_deserializer=_deserializer(request_type),
                response_serializer=response_type.SerializeToString,
            )
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _guard_unary(method),
                request_deserializer=_deserializer(request_type),
                response_serializer=response_type.SerializeToString,
            )
    service = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
