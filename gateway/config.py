"""The gateway's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwire.contract import check_episode_rate
from trainwire_ops.tls import check_plaintext_bind

DEFAULT_DB = "var/trainwire.sqlite3"


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway can be told; ``__main__`` builds it from flags.

    Attributes:
        host: Interface to listen on.
        port: Port to listen on; 0 picks a free one.
        trainers: Trainer addresses (``HOST:PORT``), tried in order.
        db: SQLite database file, ``:memory:``, or a ``postgresql://`` URL (a database that
            gateway replicas share; ``gateway.core.replicas``).
        migrate: Migrate a database of an older schema on start (otherwise it is refused with
            one line saying how to migrate it).
        episode_rate: Default publication rate (episodes per second) of a run that sets none.
        keepalive_s: A watch stream idle this long gets a keepalive.
        heartbeat_timeout_s: A trainer stream silent this long is considered lost (a broken
            stream is re-attached for this long before the run fails).
        lead_s: How far ahead of publication a paced run's trainer may train, in seconds of
            the run's rate x speed (at least 4 episodes); unpaced runs get 256 episodes.
        shutdown_grace_s: How long shutdown waits for in-flight RPCs.
        schedule_poll_s: How often PENDING runs re-ask busy trainers for a slot.
        trainer_call_timeout_s: Deadline of a ``GetCapabilities`` call.
        history_cache_mb: Capacity of the page cache of finished runs' histories.
        live_coalesce_s: Upper bound of a run's live wake window: its watchers are woken at
            most once per window (0.2 ms per attached watcher, at most this); episodes
            published in between go out together as a batch (0: one wake-up per episode).
        client_ping_interval_s: Seconds between the gateway's HTTP/2 pings to its clients.
        client_ping_timeout_s: A client that does not answer a ping within this long (frozen,
            vanished) is cut off: its watches end and free their memory.
        lease_s: With PostgreSQL: how long a replica's lease on a run it drives holds without
            renewal (it renews every third of it); a run whose replica died is taken over by
            another one within about this long.
        max_pending: The most PENDING runs the gateway holds; CreateRun beyond answers
            ``RESOURCE_EXHAUSTED``.
        metrics_port: Port of the Prometheus ``/metrics`` endpoint on ``host``; ``None`` = off,
            0 picks a free one.
        http_port: Port of the HTTP side (JSON API, event streams, the page) on ``host``;
            ``None`` = off (``python -m gateway`` serves it on 8080 unless told otherwise), 0
            picks a free one.
        metrics_host: Interface of the metrics endpoint (loopback unless told otherwise: the
            metrics are for the local scraper, not for the network).
        tls_cert: PEM certificate chain to serve gRPC and HTTP over TLS (with ``tls_key``);
            re-read on SIGHUP.
        tls_key: Its PEM private key.
        tls_client_ca: Also require client certificates signed by this PEM CA (mutual TLS).
        trainer_ca: Reach trainers over TLS, trusting this PEM CA.
        trainer_cert: Present this PEM client certificate to trainers (with ``trainer_key``;
            for trainers started with ``--tls-client-ca``).
        trainer_key: Its PEM private key.
        auth_tokens: File of ``TOKEN_SHA256 ROLE NAME`` lines; every call but health then needs
            ``authorization: Bearer TOKEN`` of a role that may make it (``gateway.auth``).
        insecure: Serve plaintext on an address other machines can reach (refused otherwise).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    trainers: tuple[str, ...] = ("127.0.0.1:50052",)
    db: str = DEFAULT_DB
    migrate: bool = False
    episode_rate: float = 20.0
    keepalive_s: float = 15.0
    heartbeat_timeout_s: float = 30.0
    lead_s: float = 2.0
    shutdown_grace_s: float = 2.0
    schedule_poll_s: float = 1.0
    trainer_call_timeout_s: float = 5.0
    history_cache_mb: float = 64.0
    live_coalesce_s: float = 0.02
    max_pending: int = 1000
    lease_s: float = 10.0
    client_ping_interval_s: float = 30.0
    client_ping_timeout_s: float = 10.0
    metrics_port: int | None = None
    http_port: int | None = None
    metrics_host: str = "127.0.0.1"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    trainer_ca: str | None = None
    trainer_cert: str | None = None
    trainer_key: str | None = None
    auth_tokens: str | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not self.metrics_host:
            raise ValueError("metrics_host must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        if (self.trainer_cert is None) != (self.trainer_key is None):
            raise ValueError("--trainer-cert and --trainer-key go together")
        check_plaintext_bind(self.host, tls=self.tls_cert is not None, insecure=self.insecure)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535, got {self.http_port}")
        if not self.trainers:
            raise ValueError("at least one trainer address is required")
        for address in self.trainers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"trainer address {address!r} is not HOST:PORT")
        if not self.db:
            raise ValueError("db must be a file path, ':memory:' or a postgresql:// URL")
        if self.episode_rate == 0 or check_episode_rate(self.episode_rate, "episode_rate"):
            raise ValueError(
                f"episode_rate must be 0.01..10000 episodes per second (negative = unpaced), "
                f"got {self.episode_rate}"
            )
        if not 1 <= self.max_pending <= 1_000_000:
            raise ValueError(f"max_pending must be in 1..1000000, got {self.max_pending}")
        for name in (
            "keepalive_s",
            "heartbeat_timeout_s",
            "lead_s",
            "schedule_poll_s",
            "trainer_call_timeout_s",
            "client_ping_interval_s",
            "client_ping_timeout_s",
            "lease_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not (math.isfinite(self.live_coalesce_s) and 0 <= self.live_coalesce_s <= 1):
            raise ValueError(f"live_coalesce_s must be in 0..1, got {self.live_coalesce_s}")
        if not (math.isfinite(self.history_cache_mb) and self.history_cache_mb >= 0):
            raise ValueError(f"history_cache_mb must be >= 0, got {self.history_cache_mb}")

    @property
    def trainer_tls(self) -> bool:
        """Whether trainers are reached over TLS."""
        return self.trainer_ca is not None or self.trainer_cert is not None
