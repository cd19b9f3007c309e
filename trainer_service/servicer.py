"""The TrainerService servicer: parses requests, calls the job runner, converts events."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial

import grpc

from trainer_service.core.jobs import Heartbeat, JobRunner
from trainer_service.status import apply_status, to_status
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

_LOGGER = logging.getLogger(__name__)


def heartbeat_to_proto(heartbeat: Heartbeat) -> trainer_service_pb2.Heartbeat:
    """Converts a core heartbeat to its message."""
    message = trainer_service_pb2.Heartbeat(
        last_episode=heartbeat.last_episode, phase=heartbeat.phase
    )
    message.time.FromNanoseconds(heartbeat.time_ns)
    return message


class TrainerServicer(trainer_service_pb2_grpc.TrainerServiceServicer):
    """Serves ``trainwire.v1.TrainerService`` over a :class:`JobRunner`."""

    def __init__(self, runner: JobRunner) -> None:
        self._runner = runner

    def Train(
        self, request: trainer_service_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Runs a training job and streams its episodes and heartbeats."""
        run_id = request.run_id
        try:
            stream = self._runner.open(request)
        except Exception as exc:
            apply_status(context, to_status(exc, run_id))
            return
        # Fires when the RPC ends for any reason (client cancel, deadline, disconnect, success):
        # a stream that broke leaves its job detached, kept for a re-attach.
        detach = partial(self._runner.detach, stream)
        if not context.add_callback(detach):
            detach()  # the RPC already ended: nobody will read the stream
            return
        try:
            for event in stream.events():
                if isinstance(event, Heartbeat):
                    yield trainer_service_pb2.TrainResponse(heartbeat=heartbeat_to_proto(event))
                else:
                    yield trainer_service_pb2.TrainResponse(episode=event)
        except Exception as exc:
            apply_status(context, to_status(exc, run_id))
        finally:
            detach()

    def Grant(
        self, request: trainer_service_pb2.GrantRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GrantResponse:
        """Moves a job's grant forward."""
        try:
            last = self._runner.grant(request.run_id, request.through_episode)
        except Exception as exc:
            apply_status(context, to_status(exc, request.run_id))
            return trainer_service_pb2.GrantResponse()
        return trainer_service_pb2.GrantResponse(last_episode=last)

    def CancelJob(
        self, request: trainer_service_pb2.CancelJobRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.CancelJobResponse:
        """Cancels a job at once."""
        try:
            last = self._runner.cancel_job(request.run_id)
        except Exception as exc:
            apply_status(context, to_status(exc, request.run_id))
            return trainer_service_pb2.CancelJobResponse()
        return trainer_service_pb2.CancelJobResponse(last_episode=last)

    def GetCapabilities(
        self, request: trainer_service_pb2.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GetCapabilitiesResponse:
        """Describes the providers, device and slots of this trainer."""
        caps = self._runner.capabilities()
        return trainer_service_pb2.GetCapabilitiesResponse(
            providers=caps.providers,
            device=caps.device,
            slots_total=caps.slots_total,
            slots_free=caps.slots_free,
            torch_version=caps.torch_version,
            trl_version=caps.trl_version,
            server_version=caps.server_version,
        )
