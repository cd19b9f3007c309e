"""Builds the trainer's gRPC server: TrainerService, health and reflection on one port.

The server is a sync ``grpc.server`` with a bounded thread pool: one thread per job slot plus a
few for capabilities, health, reflection and refused calls. Training runs in threads the job
runner owns, not in the pool. Health reports NOT_SERVING until the providers have been imported
(torch and friends take a while), then SERVING, and NOT_SERVING again once shutdown starts.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner
from trainer_service.servicer import TrainerServicer
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


class TrainerServer:
    """The running trainer: a gRPC server plus the job runner behind it.

    Attributes:
        grpc_server: The underlying ``grpc.Server``.
        runner: The job runner.
        health: The health servicer (overall ``""`` and ``trainwire.v1.TrainerService``).
        ready: Set once the providers are imported and health says SERVING.
    """

    def __init__(
        self, grpc_server: grpc.Server, runner: JobRunner, health_servicer: health.HealthServicer
    ) -> None:
        self.grpc_server = grpc_server
        self.runner = runner
        self.health = health_servicer
        self.ready = threading.Event()
        self._stopping = threading.Event()

    def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

    def start(self, warm_up: bool = True) -> None:
        """Starts serving; health turns SERVING once the providers are imported.

        Args:
            warm_up: Import the providers in a background thread first (health NOT_SERVING
                meanwhile). Without it the server is ready at once and providers import on
                first use.
        """
        self.grpc_server.start()
        if not warm_up:
            self._mark_ready()
            return
        threading.Thread(target=self._warm_up, name="trainer-warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        try:
            providers = self.runner.capabilities().providers
            _LOGGER.info("providers ready: %s", ", ".join(providers) or "(none)")
        except Exception:  # a broken provider must not keep the others from serving
            _LOGGER.exception("warming up the providers failed")
        self._mark_ready()

    def _mark_ready(self) -> None:
        if not self._stopping.is_set():
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self.ready.set()

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stops accepting calls, stops running jobs at their next episode and shuts down.

        Returns:
            An event set once the server has stopped (see ``grpc.Server.stop``).
        """
        self._stopping.set()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        stopped = self.grpc_server.stop(grace)
        self.runner.shutdown()
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops; returns False on timeout."""
        return self.grpc_server.wait_for_termination(timeout)


def build_server(config: TrainerConfig, runner: JobRunner) -> tuple[TrainerServer, int]:
    """Builds (but does not start) the trainer server and binds its port.

    Returns:
        The server and the port it bound (the free port picked when ``config.port`` is 0).

    Raises:
        RuntimeError: The address could not be bound.
    """
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.max_workers, thread_name_prefix="trainer-rpc"
        ),
        options=[("grpc.so_reuseport", 0)],
    )
    trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server(
        TrainerServicer(runner), grpc_server
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server
    )
    try:
        port = grpc_server.add_insecure_port(config.address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {config.address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot listen on {config.address}")
    return TrainerServer(grpc_server, runner, health_servicer), port
