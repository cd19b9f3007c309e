"""The gateway's gRPC server: ``GatewayService`` on ``grpc.aio`` with health, reflection, an
HTTP/2 keepalive policy and the RPC metrics interceptor; ``Gateway`` ties server, core, store,
the HTTP side (``gateway.http``: JSON API, event streams, the page, with ``config.http_port``) and
metrics (``/metrics`` over HTTP with ``config.metrics_port``) together for ``__main__``, tests
and benchmarks."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.auth import Authenticator, AuthInterceptor
from gateway.config import GatewayConfig
from gateway.core.dblock import DatabaseLock
from gateway.core.registry import RunRegistry
from gateway.core.replicas import SharedReplicas
from gateway.core.store import PostgresStore, open_store
from gateway.core.trainers import TrainerConnector
from gateway.http import HttpFace
from gateway.http.auth import http_middleware
from gateway.metrics import GatewayMetrics
from gateway.servicer import GatewayServicer, add_to_server
from gateway.trainer_client import GrpcTrainerConnector
from trainwire.v1 import gateway_service_pb2
from trainwire_ops.addresses import host_port, port_problem
from trainwire_ops.checkpoints import CheckpointStore
from trainwire_ops.metrics_endpoint import MetricsEndpoint
from trainwire_ops.tls import ClientTls, ClientTlsFiles, ServerTls

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def freeze_startup_objects() -> None:
    """Moves every object alive now (modules, descriptors, the recovered runs: what a gateway
    keeps for its life) out of the cyclic garbage collector's sight, once per process.

    A full collection otherwise walks them all with the event loop stopped, holding every
    episode in flight for the pause; frozen, they are never walked again (figures: README).
    A collection first, so no garbage is frozen with them; once per process, so a process that
    starts many gateways (tests) pays it once.
    """
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()


_frozen = False


def server_options(config: GatewayConfig) -> tuple[tuple[str, int], ...]:
    """The HTTP/2 policy. Watches are long and mostly idle: accept clients' keepalive pings
    (every >= 10 s, also without an active call) so NATs keep the connection, and ping clients
    ourselves every ``client_ping_interval_s`` so a vanished or frozen watcher (one that stops
    answering pings) is cut off, its stream cancelled and freed, within
    ``client_ping_interval_s + client_ping_timeout_s`` seconds (40 by default)."""
    return (
        ("grpc.keepalive_time_ms", int(config.client_ping_interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.client_ping_timeout_s * 1000)),
        # What actually bounds an unanswered ping in this gRPC (the keepalive timeout alone
        # left a SIGSTOPped watcher attached for minutes).
        ("grpc.http2.ping_timeout_ms", int(config.client_ping_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        # Two gateways must never share a port silently.
        ("grpc.so_reuseport", 0),
        # Requests up to 16 MiB reach the servicer, so one over CreateRun's 1 MiB gets a clear
        # INVALID_ARGUMENT naming its size instead of gRPC's bare RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", 16 << 20),
    )


def build_server(
    config: GatewayConfig,
    core: RunRegistry,
    health_servicer: health.aio.HealthServicer | None = None,
    metrics: GatewayMetrics | None = None,
    authenticator: Authenticator | None = None,
    tls: ServerTls | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Builds (does not start) the aio server; returns it and the port it is bound to.

    Args:
        config: Address and options.
        core: The run registry the servicer calls.
        health_servicer: The health service to register (a fresh one by default).
        metrics: Where the RPC metrics go (unmeasured without).
        authenticator: Checks every call but health's (``gateway.auth``); none: all open.
        tls: Serve TLS (mutual with a client CA) with these files; none: plaintext.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if metrics is not None:  # outermost: refused calls are counted too
        interceptors.append(metrics.interceptor())
    if authenticator is not None:
        interceptors.append(AuthInterceptor(authenticator))
    server = grpc.aio.server(options=server_options(config), interceptors=interceptors)
    add_to_server(GatewayServicer(core), server)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = host_port(config.host, config.port)
    problem = port_problem(config.host, config.port)
    if problem is not None:
        raise RuntimeError(f"cannot listen on {address}: {problem}")
    if tls is not None:
        port = server.add_secure_port(address, tls.grpc_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return server, port


class Gateway:
    """A running gateway: store, core, server and metrics.

    Args:
        config: Settings.
        connector: How to reach trainers (gRPC by default).
        metrics: Its metrics (a fresh ``GatewayMetrics`` by default; always recorded, served
            over HTTP only with ``config.metrics_port``).

    Attributes:
        metrics: The gateway's metrics.
        metrics_endpoint: The HTTP ``/metrics`` endpoint while it serves; ``None`` when off.
        http: The HTTP side while it serves (``http.url``); ``None`` when off.
    """

    def __init__(
        self,
        config: GatewayConfig,
        connector: TrainerConnector | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self._connector = connector
        self.metrics = metrics or GatewayMetrics()
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.http: HttpFace | None = None
        self._health = health.aio.HealthServicer()
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._lock = DatabaseLock(config.db)
        self.tls: ServerTls | None = None
        self.trainer_tls: ClientTls | None = None
        self.authenticator: Authenticator | None = None
        self.core: RunRegistry | None = None
        self.server: grpc.aio.Server | None = None
        self.port = 0
        #: This gateway among the replicas of a PostgreSQL database (the owner of its runs).
        self.replica_id = uuid.uuid4().hex

    def _open_checkpoint_store(self) -> CheckpointStore | None:
        """The checkpoint store of ``--checkpoint-store``, checked by a write and a read.

        Raises:
            CheckpointStoreProblem: it cannot be written or read (one line naming it).
        """
        if self.config.checkpoint_store is None:
            return None
        store = CheckpointStore(self.config.checkpoint_store)
        store.check()
        _LOGGER.debug("checkpoint store: %s", store.location)
        return store

    async def start(self) -> int:
        """Opens the store, recovers, starts serving; returns the bound port.

        Raises:
            TlsFileError: A certificate, key or CA file cannot be used (nothing was started).
            TokenFileError: The tokens file cannot be used (nothing was started).
            CheckpointStoreProblem: The checkpoint store cannot be written or read (nothing was
                started).
            DatabaseLocked: Another gateway uses the database (nothing was started).
            DatabasePathProblem: The database's directory or lock file cannot be created
                (nothing was started).
            DatabaseProblem: The database cannot be used, or needs a migration (nothing was
                started).
            OSError: The metrics or HTTP port cannot be bound (nothing was started).
            RuntimeError: The gRPC port cannot be bound.
        """
        metrics = self.metrics
        # Ports first: a port in use is one line before anything starts (probes, the store).
        problem = port_problem(self.config.host, self.config.port)
        if problem is not None:
            raise RuntimeError(
                f"cannot listen on {host_port(self.config.host, self.config.port)}: {problem}"
            )
        self._load_security()
        checkpoint_files = self._open_checkpoint_store()
        self._lock.acquire()  # DatabaseLocked: another gateway uses this database
        if self.config.metrics_port is not None:
            self.metrics_endpoint = MetricsEndpoint.start(
                metrics.registry, self.config.metrics_host, self.config.metrics_port
            )
        try:
            store = open_store(
                self.config.db,
                migrate=self.config.migrate,
                on_commit=metrics.store_commit,
                replica_id=self.replica_id,
            )
            self.core = RunRegistry(
                self.config.core(),
                store,
                self._connector or self._grpc_connector(),
                metrics,
                on_health=self._health_changed,
                replicas=(
                    SharedReplicas(store, self.config.lease_s)
                    if isinstance(store, PostgresStore)
                    else None
                ),
                checkpoint_files=checkpoint_files,
            )
            await self.core.start()
            self.server, self.port = build_server(
                self.config, self.core, self._health, metrics, self.authenticator, self.tls
            )
            if self.config.http_port is not None:
                middlewares = (
                    [http_middleware(self.authenticator)] if self.authenticator is not None else []
                )
                self.http = HttpFace(self.core, self.config.shutdown_grace_s, middlewares)
                await self.http.start(
                    self.config.host,
                    self.config.http_port,
                    self.tls.ssl_context() if self.tls is not None else None,
                )
            await self.server.start()
        except BaseException:
            await self._stop_http()
            await self._stop_metrics()
            self._lock.release()
            raise
        await self._set_health(self.core.healthy)
        freeze_startup_objects()
        _LOGGER.info(
            "gateway serving on %s (db %s, checkpoint store %s)",
            host_port(self.config.host, self.port),
            getattr(store, "where", self.config.db),  # a URL without its password
            checkpoint_files.location if checkpoint_files is not None else "none",
        )
        return self.port

    def _load_security(self) -> None:
        config = self.config
        if config.tls_cert is not None and config.tls_key is not None:
            client_ca = Path(config.tls_client_ca) if config.tls_client_ca else None
            self.tls = ServerTls(Path(config.tls_cert), Path(config.tls_key), client_ca)
        if config.trainer_tls:
            self.trainer_tls = ClientTls(
                ClientTlsFiles(
                    ca=Path(config.trainer_ca) if config.trainer_ca else None,
                    cert=Path(config.trainer_cert) if config.trainer_cert else None,
                    key=Path(config.trainer_key) if config.trainer_key else None,
                )
            )
        if config.auth_tokens is not None:
            self.authenticator = Authenticator(Path(config.auth_tokens))

    def _grpc_connector(self) -> GrpcTrainerConnector:
        if self.trainer_tls is None:
            return GrpcTrainerConnector()
        connector = GrpcTrainerConnector(
            self.trainer_tls.current, server_name=self.config.trainer_server_name
        )
        self.trainer_tls.on_change.append(connector.set_credentials)
        return connector

    def reload(self) -> None:
        """SIGHUP: re-reads the certificates and the tokens file. New connections use the new
        ones; open connections and their streams go on. A bad file is logged and ignored."""
        _LOGGER.info("SIGHUP: re-reading certificates and tokens")
        if self.tls is not None:
            self.tls.reload()
        if self.trainer_tls is not None:
            self.trainer_tls.reload()
        if self.authenticator is not None:
            self.authenticator.reload()

    def _health_changed(self, healthy: bool) -> None:
        """The core's verdict: SERVING while a trainer answers and the store can be written."""
        if self.core is None or self.core.closing:
            return
        if healthy:
            _LOGGER.info("a trainer answers and the store can be written: health SERVING")
        else:
            _LOGGER.warning("no trainer answers or the store cannot be written: NOT_SERVING")
        task = asyncio.get_running_loop().create_task(self._set_health(healthy))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, healthy: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self) -> None:
        """Graceful stop: health NOT_SERVING, watches end UNAVAILABLE, in-flight calls get
        ``shutdown_grace_s``, trainer streams are cancelled (the trainers keep the jobs for the
        next start to re-attach), active runs are stored as they are and the store is
        flushed."""
        if self.core is None or self.server is None:
            return
        await self._health.enter_graceful_shutdown()
        self.core.begin_shutdown()
        await asyncio.gather(self.server.stop(self.config.shutdown_grace_s), self._stop_http())
        await self.core.shutdown()
        self._lock.release()
        await self._stop_metrics()
        _LOGGER.info("gateway stopped")

    async def _stop_http(self) -> None:
        http, self.http = self.http, None
        if http is not None:
            await http.stop()

    async def _stop_metrics(self) -> None:
        endpoint, self.metrics_endpoint = self.metrics_endpoint, None
        if endpoint is not None:
            # Joining the HTTP server's thread takes up to its 0.5 s poll: not on the loop.
            await asyncio.to_thread(endpoint.stop)

    async def wait_for_termination(self) -> None:
        """Returns when the server has stopped."""
        assert self.server is not None
        await self.server.wait_for_termination()
