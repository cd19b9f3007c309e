"""Builds the trainer's gRPC server: TrainerService, health and reflection on one port.

The server is a sync ``grpc.server`` with a bounded thread pool: one thread per job slot plus a
few for capabilities, health, reflection and refused calls. Training runs in threads the job
runner owns, not in the pool. Health reports NOT_SERVING until the providers have been imported
(torch and friends take a while), then SERVING, and NOT_SERVING again once shutdown starts.

Every RPC goes through the metrics interceptor; with ``config.metrics_port`` set, the server also
serves its Prometheus metrics over HTTP from ``start`` to ``stop``.
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
from trainer_service.metrics import MetricsEndpoint, TrainerMetrics
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
        metrics: The server's metrics (its own registry).
        metrics_endpoint: The HTTP ``/metrics`` endpoint while it serves; ``None`` when off.
    """

    def __init__(
        self,
        grpc_server: grpc.Server,
        runner: JobRunner,
        health_servicer: health.HealthServicer,
        metrics: TrainerMetrics | None = None,
        metrics_bind: tuple[str, int] | None = None,
    ) -> None:
        self.grpc_server = grpc_server
        self.runner = runner
        self.health = health_servicer
        self.metrics = metrics or TrainerMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._metrics_bind = metrics_bind
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

        Raises:
            OSError: The metrics port could not be bound (nothing was started).
        """
        if self._metrics_bind is not None:
            self.metrics_endpoint = MetricsEndpoint.start(
                self.metrics.registry, *self._metrics_bind
            )
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
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
            self.metrics_endpoint = None
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops; returns False on timeout."""
        return self.grpc_server.wait_for_termination(timeout)


def build_server(
    config: TrainerConfig, runner: JobRunner, metrics: TrainerMetrics | None = None
) -> tuple[TrainerServer, int]:
    """Builds (but does not start) the trainer server and binds its port.

    Args:
        config: Address, pool size and metrics port.
        runner: The job runner behind the service.
        metrics: Where RPC and slot metrics go (a fresh ``TrainerMetrics`` by default). Job,
            episode and heartbeat counters come from the runner's observer: build the runner
            with ``observer=metrics.jobs`` to have them in the same registry.

    Returns:
        The server and the port it bound (the free port picked when ``config.port`` is 0).

    Raises:
        RuntimeError: The address could not be bound.
    """
    metrics = metrics or TrainerMetrics()
    metrics.track_slots(runner.slots)
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.max_workers, thread_name_prefix="trainer-rpc"
        ),
        interceptors=(metrics.interceptor(),),
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
    metrics_bind = None if config.metrics_port is None else (config.host, config.metrics_port)
    return TrainerServer(grpc_server, runner, health_servicer, metrics, metrics_bind), port
