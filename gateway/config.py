"""The gateway's configuration: one frozen dataclass, validated on construction.

Each field carries its command-line help (``trainwire_ops.settings.option``): ``python -m gateway``
builds its flags from this class, so a default or a help text is written once, and every flag can
also come from the environment (``TRAINWIRE_GATEWAY_`` + the flag in upper case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.core.live_log import WAKE_WINDOW_PER_WATCHER
from gateway.core.settings import DEFAULTS, CoreSettings
from trainwire.contract import check_episode_rate
from trainwire_ops.logs import LOG_FORMATS
from trainwire_ops.settings import option, port_or_off
from trainwire_ops.tls import check_plaintext_bind

DEFAULT_DB = "var/trainwire.sqlite3"
DEFAULT_CHECKPOINT_STORE = "var/checkpoints"
DEFAULT_HTTP_PORT = 8080
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_TLS = "TLS and authentication (certificates and the tokens file are re-read on SIGHUP)"
_LOGS = "logging"


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway can be told; ``__main__`` builds it from flags (each field's help
    is its flag's help; ``python -m gateway --help`` lists them with defaults and variables).

    ``http_port`` is the one default that differs: a gateway embedded in a program (tests,
    benchmarks) opens no HTTP port unless asked, ``python -m gateway`` serves it on 8080.
    """

    host: str = option("127.0.0.1", "interface to listen on")
    port: int = option(50051, "port to listen on; 0 picks a free one")
    trainers: tuple[str, ...] = option(
        DEFAULTS.trainers,
        "trainer address(es) HOST:PORT, comma-separated, tried in order",
        flag="--trainer",
        parse=_addresses,
    )
    db: str = option(
        DEFAULT_DB,
        "SQLite database file, :memory:, or postgresql://USER@HOST:PORT/DB (a database that "
        "gateway replicas share; gateway.core.replicas)",
    )
    migrate: bool = option(
        False,
        "migrate a database of an older schema on start (without it such a database is "
        "refused with one line saying how; see `python -m gateway migrate`)",
    )
    episode_rate: float = option(
        DEFAULTS.episode_rate,
        "default episodes per second of a run that sets none; negative = unpaced",
    )
    keepalive_s: float = option(
        DEFAULTS.keepalive_s, "seconds of silence on a watch stream before a keepalive is sent"
    )
    heartbeat_timeout_s: float = option(
        DEFAULTS.heartbeat_timeout_s,
        "seconds without an episode or heartbeat before a trainer counts as lost (a broken "
        "stream is re-attached for this long before the run fails)",
    )
    lead_s: float = option(
        DEFAULTS.lead_s,
        "seconds of a paced run's rate x speed its trainer may train ahead of publication (at "
        "least 4 episodes; unpaced runs get 256); a paused run's trainer gets no more",
    )
    shutdown_grace_s: float = option(
        DEFAULTS.shutdown_grace_s, "seconds in-flight calls get on SIGTERM"
    )
    schedule_poll_s: float = option(
        DEFAULTS.schedule_poll_s, "seconds between asking busy trainers again for a free slot"
    )
    trainer_call_timeout_s: float = option(
        DEFAULTS.trainer_call_timeout_s,
        "deadline (s) of a GetCapabilities call to a trainer",
        flag="--trainer-call-timeout",
    )
    history_cache_mb: float = option(
        DEFAULTS.history_cache_mb, "memory for cached history pages of finished runs (MiB)"
    )
    live_coalesce_s: float = option(
        DEFAULTS.live_coalesce_s,
        "upper bound (s) of a run's live wake window: its watchers are woken at most once per "
        f"window ({WAKE_WINDOW_PER_WATCHER * 1000:g} ms per attached watcher, at most this); "
        "0: one wake-up per episode",
    )
    max_pending: int = option(
        DEFAULTS.max_pending,
        "the most runs waiting for a trainer; CreateRun beyond answers RESOURCE_EXHAUSTED",
    )
    checkpoint_store: str | None = option(
        None,
        "where trainers write checkpoints (the same store as the trainers' "
        "--checkpoint-store): a directory (a shared filesystem for several machines) or "
        "s3://BUCKET/PREFIX (endpoint from AWS_ENDPOINT_URL); the gateway reads it for "
        "downloads and deletes from it for retention and DeleteRun",
        metavar="DIR|URL",
        cli_default=DEFAULT_CHECKPOINT_STORE,
    )
    park_after_s: float = option(
        DEFAULTS.park_after_s,
        "seconds a run stays paused before it is parked: its job writes a checkpoint and ends, "
        "freeing its trainer slot; resume places it again; 0: never",
        flag="--park-after",
    )
    max_restarts: int = option(
        DEFAULTS.max_restarts,
        "times a run whose trainer or job died is restarted from its latest checkpoint "
        "before it fails",
    )
    lease_s: float = option(
        10.0,
        "PostgreSQL: how long a replica's lease on a run it drives holds without renewal (it "
        "renews every third of it); another replica takes the runs of a dead one over after this",
        flag="--lease-seconds",
    )
    client_ping_interval_s: float = option(30.0, "seconds between HTTP/2 pings to clients")
    client_ping_timeout_s: float = option(
        10.0,
        "a client that does not answer a ping within this long (frozen, vanished) is cut off "
        "and its watches freed",
    )
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0 picks a free port; "
        "-1 or none: off)",
        parse=port_or_off,
    )
    http_port: int | None = option(
        None,
        "serve the page, the JSON API and event streams at http://HOST:PORT (0 picks a free "
        "port; -1: off)",
        parse=port_or_off,
        cli_default=DEFAULT_HTTP_PORT,
    )
    metrics_host: str = option(
        "127.0.0.1",
        "interface of the metrics endpoint (loopback unless told otherwise: the metrics are for "
        "the local scraper, not for the network)",
    )
    tls_cert: str | None = option(
        None,
        "serve gRPC and HTTP over TLS with this PEM certificate chain",
        metavar="FILE",
        group=_TLS,
    )
    tls_key: str | None = option(
        None, "the PEM private key of --tls-cert", metavar="FILE", group=_TLS
    )
    tls_client_ca: str | None = option(
        None,
        "also require client certificates signed by this PEM CA (mutual TLS)",
        metavar="FILE",
        group=_TLS,
    )
    trainer_ca: str | None = option(
        None, "reach trainers over TLS, trusting this PEM CA", metavar="FILE", group=_TLS
    )
    trainer_cert: str | None = option(
        None,
        "present this PEM client certificate to trainers (for trainers started with "
        "--tls-client-ca)",
        metavar="FILE",
        group=_TLS,
    )
    trainer_key: str | None = option(
        None, "the PEM private key of --trainer-cert", metavar="FILE", group=_TLS
    )
    trainer_server_name: str | None = option(
        None,
        "check trainers' certificates against this name instead of the host in --trainer "
        "(trainers dialled by IP address or through a proxy; needs --trainer-ca or "
        "--trainer-cert)",
        metavar="NAME",
        group=_TLS,
    )
    auth_tokens: str | None = option(
        None,
        "require 'authorization: Bearer TOKEN' of a role that may make the call on everything "
        "but health (lines TOKEN_SHA256 ROLE NAME; make them with python -m "
        "gateway.tools.add_token)",
        metavar="FILE",
        group=_TLS,
    )
    insecure: bool = option(
        False,
        "serve plaintext on an address other machines can reach (refused without it)",
        group=_TLS,
    )
    log_level: str = option(
        "INFO", "DEBUG, INFO, WARNING or ERROR", parse=str.upper, choices=LOG_LEVELS, group=_LOGS
    )
    log_format: str = option(
        "text",
        "text: one line for people; json: one JSON object per line",
        choices=LOG_FORMATS,
        group=_LOGS,
    )

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
        if self.trainer_server_name is not None and not self.trainer_tls:
            raise ValueError(
                "--trainer-server-name checks trainers' TLS certificates: give --trainer-ca "
                "(or --trainer-cert and --trainer-key) too"
            )
        if self.trainer_server_name == "":
            raise ValueError("--trainer-server-name must not be empty")
        check_plaintext_bind(self.host, tls=self.tls_cert is not None, insecure=self.insecure)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535, got {self.http_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
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
        if not (math.isfinite(self.park_after_s) and self.park_after_s >= 0):
            raise ValueError(f"park_after must be >= 0 (0: never), got {self.park_after_s}")
        if not 0 <= self.max_restarts <= 1000:
            raise ValueError(f"max_restarts must be in 0..1000, got {self.max_restarts}")
        if self.checkpoint_store == "":
            raise ValueError("--checkpoint-store must not be empty")
        if not (math.isfinite(self.history_cache_mb) and self.history_cache_mb >= 0):
            raise ValueError(f"history_cache_mb must be >= 0, got {self.history_cache_mb}")

    def core(self) -> CoreSettings:
        """The settings the gateway core runs on."""
        return CoreSettings(
            trainers=self.trainers,
            episode_rate=self.episode_rate,
            keepalive_s=self.keepalive_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            lead_s=self.lead_s,
            shutdown_grace_s=self.shutdown_grace_s,
            schedule_poll_s=self.schedule_poll_s,
            trainer_call_timeout_s=self.trainer_call_timeout_s,
            history_cache_mb=self.history_cache_mb,
            live_coalesce_s=self.live_coalesce_s,
            max_pending=self.max_pending,
            park_after_s=self.park_after_s,
            max_restarts=self.max_restarts,
        )

    @property
    def trainer_tls(self) -> bool:
        """Whether trainers are reached over TLS."""
        return self.trainer_ca is not None or self.trainer_cert is not None
