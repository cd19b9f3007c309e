"""Builds the trainer's gRPC server: TrainerService, health and reflection on one port.

The RPC surface is ``grpc.aio`` on an event loop of its own thread, so an idle stream (a reflection
or health watch, a Train stream waiting for its grant) holds no thread: any number of them do not
slow ``GetCapabilities`` or ``Train``. Training runs in threads the job runner owns. Health reports
NOT_SERVING until the providers have been imported (torch and friends take a while), then SERVING,
and NOT_SERVING again once shutdown starts.

``TrainerServer`` is the synchronous face of it all (start, stop, wait), for ``__main__``, tests
and benchmarks. Every RPC goes through the metrics interceptor; with ``config.metrics_port``
set, the server also serves its Prometheus metrics over HTTP from ``start`` to ``stop``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner
from trainer_service.metrics import MetricsEndpoint, TrainerMetrics
from trainer_service.servicer import TrainerServicer, add_to_server
from trainwire.v1 import trainer_service_pb2
from trainwire_ops.addresses import port_problem
from trainwire_ops.checkpoints import CheckpointStore
from trainwire_ops.tls import ServerTls

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
T = TypeVar("T")


class _LoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="trainer-rpc-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs a coroutine on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules a coroutine on the loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Stops the loop and joins its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class TrainerServer:
    """The running trainer: a gRPC server plus the job runner behind it.

    Attributes:
        runner: The job runner.
        ready: Set once the providers are imported and health says SERVING.
        metrics: The server's metrics (its own registry).
        metrics_endpoint: The HTTP ``/metrics`` endpoint while it serves; ``None`` when off.
    """

    def __init__(
        self,
        loop: _LoopThread,
        grpc_server: grpc.aio.Server,
        runner: JobRunner,
        health_servicer: health.aio.HealthServicer,
        metrics: TrainerMetrics,
        metrics_bind: tuple[str, int] | None = None,
    ) -> None:
        self._loop = loop
        self._grpc_server = grpc_server
        self.runner = runner
        self._health = health_servicer
        self.metrics = metrics
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._metrics_bind = metrics_bind
        self.ready = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._health_set: int = health_pb2.HealthCheckResponse.NOT_SERVING
        self._warming: threading.Thread | None = None

    def _set_health(self, status: int) -> None:
        self._health_set = status

        async def apply() -> None:
            for service in ("", SERVICE_NAME):
                await self._health.set(service, status)

        self._loop.run(apply(), timeout=10)

    def health_status(self, service: str = "") -> int:
        """What the health service answers for ``service`` now (once stopped: what it was set
        to last)."""
        if self._stopped.is_set():
            return self._health_set

        async def check() -> int:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), None)
            return reply.status

        return self._loop.run(check(), timeout=10)

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
        self._loop.run(self._grpc_server.start(), timeout=30)
        if not warm_up:
            self._mark_ready()
            return
        self._warming = threading.Thread(target=self._warm_up, name="trainer-warm-up", daemon=True)
        self._warming.start()

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
            An event set once the server has stopped.
        """
        if self._stopping.is_set():
            return self._stopped
        self._stopping.set()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Jobs first: their streams end UNAVAILABLE while the server still delivers them.
        self.runner.shutdown()
        stopping = self._loop.submit(self._grpc_server.stop(grace))

        def finish() -> None:
            try:
                stopping.result()
            except Exception:  # the server is going away regardless
                _LOGGER.exception("stopping the gRPC server failed")
            self._loop.close()
            if self._warming is not None:
                # An interpreter that exits while a thread imports torch can crash on the way
                # out: a stop during warm-up waits for the import.
                self._warming.join(60)
            self._stopped.set()

        threading.Thread(target=finish, name="trainer-stop", daemon=True).start()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
            self.metrics_endpoint = None
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops; returns False on timeout."""
        return self._stopped.wait(timeout)


def open_checkpoint_store(config: TrainerConfig) -> CheckpointStore:
    """The store of ``--checkpoint-store``, checked by writing, reading back and deleting a probe.

    Raises:
        CheckpointStoreProblem: It cannot be written or read (one line naming it).
    """
    store = CheckpointStore(config.checkpoint_store)
    store.check()
    _LOGGER.debug("checkpoint store: %s", store.location)
    return store


def build_server(
    config: TrainerConfig,
    runner: JobRunner,
    metrics: TrainerMetrics | None = None,
    tls: ServerTls | None = None,
) -> tuple[TrainerServer, int]:
    """Builds (but does not start) the trainer server and binds its port.

    Args:
        config: Address and metrics port.
        runner: The job runner behind the service.
        metrics: Where RPC and slot metrics go (a fresh ``TrainerMetrics`` by default). Job,
            episode and heartbeat counters come from the runner's observer: build the runner
            with ``observer=metrics.jobs`` to have them in the same registry.
        tls: Serve TLS with these files (mutual TLS with their client CA: only callers with
            a certificate it signed get in); ``tls.reload()`` rotates them. Plaintext without.

    Returns:
        The server and the port it bound (the free port picked when ``config.port`` is 0).

    Raises:
        RuntimeError: The address could not be bound.
    """
    metrics = metrics or TrainerMetrics()
    metrics.track_slots(runner.slots)
    loop = _LoopThread()

    async def build() -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
        server = grpc.aio.server(
            interceptors=(metrics.interceptor(),),
            options=[("grpc.so_reuseport", 0)],
        )
        add_to_server(TrainerServicer(runner), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        problem = port_problem(config.host, config.port)
        if problem is not None:
            raise RuntimeError(f"cannot listen on {config.address}: {problem}")
        try:
            if tls is not None:
                port = server.add_secure_port(config.address, tls.grpc_credentials())
            else:
                port = server.add_insecure_port(config.address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {config.address}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {config.address}")
        return server, health_servicer, port

    try:
        server, health_servicer, port = loop.run(build(), timeout=30)
    except BaseException:
        loop.close()
        raise
    metrics_bind = (
        None if config.metrics_port is None else (config.metrics_host, config.metrics_port)
    )
    trainer = TrainerServer(loop, server, runner, health_servicer, metrics, metrics_bind)
    return trainer, port
