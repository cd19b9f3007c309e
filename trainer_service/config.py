"""The trainer service's configuration: one frozen, validated dataclass built by ``__main__``."""

from __future__ import annotations

import math
import pathlib
import re
from dataclasses import dataclass

from trainwire.logs import LOG_FORMATS, parse_level
from trainwire_ops.addresses import host_port
from trainwire_ops.tls import check_plaintext_bind

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer service runs.

    Attributes:
        host: Interface to listen on.
        port: TCP port; 0 picks a free one.
        slots: Training slots: jobs (or processes of a job) that run at once; ``"auto"`` gives
            one slot per visible GPU when the device is CUDA (``auto`` or ``cuda``), else one.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        data_root: Root of task-relative paths (models, datasets).
        heartbeat_s: Seconds without an episode after which a heartbeat goes out.
        detach_grace_s: Seconds a job whose stream broke (its gateway restarted or died) stays
            alive, blocked at its grant, for a re-attach; 0 cancels it at once.
        image_cache_dir: Decoded-image cache for the GRPO provider; ``None`` = off.
        extra_workers: RPC threads beyond one per slot (GetCapabilities, health, reflection,
            refused Train calls).
        grace_s: Seconds running RPCs get to finish on shutdown.
        metrics_port: Port of the Prometheus ``/metrics`` endpoint on ``host``; ``None`` = off,
            0 picks a free one.
        log_level: Logging level name (``DEBUG``, ``INFO``, ...).
        log_format: ``text`` or ``json`` (one JSON object per line).
        metrics_host: Interface of the metrics endpoint (loopback unless told otherwise).
        tls_cert: PEM certificate chain to serve TLS with (with ``tls_key``); re-read on SIGHUP.
        tls_key: Its PEM private key.
        tls_client_ca: Accept only callers with a client certificate signed by this PEM CA
            (mutual TLS: only gateways holding one can start training).
        insecure: Serve plaintext on an address other machines can reach (refused otherwise).
    """

    host: str = "127.0.0.1"
    port: int = 50052
    slots: int | str = 1
    device: str = "auto"
    data_root: pathlib.Path = pathlib.Path("var/data")
    heartbeat_s: float = 5.0
    detach_grace_s: float = 60.0
    image_cache_dir: pathlib.Path | None = None
    extra_workers: int = 8
    grace_s: float = 3.0
    metrics_port: int | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_host: str = "127.0.0.1"
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    tls_client_ca: pathlib.Path | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.host:
            problems.append("host must not be empty")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} must be in 0..65535")
        counted = isinstance(self.slots, int) and not isinstance(self.slots, bool)
        if self.slots != "auto" and not (counted and 1 <= int(self.slots) <= 64):
            problems.append(f"slots {self.slots!r} must be auto or in 1..64")
        if not _DEVICE.match(self.device):
            problems.append(f"device {self.device!r} must be auto, cpu, cuda or cuda:N")
        if not (math.isfinite(self.heartbeat_s) and 0 < self.heartbeat_s <= 3600):
            problems.append(f"heartbeat {self.heartbeat_s} must be in (0, 3600] seconds")
        if not (math.isfinite(self.detach_grace_s) and 0 <= self.detach_grace_s <= 86400):
            problems.append(f"detach grace {self.detach_grace_s} must be in 0..86400 seconds")
        if not 1 <= self.extra_workers <= 256:
            problems.append(f"extra_workers {self.extra_workers} must be in 1..256")
        if not (math.isfinite(self.grace_s) and 0 <= self.grace_s <= 60):
            problems.append(f"grace {self.grace_s} must be in 0..60 seconds")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics port {self.metrics_port} must be in 0..65535")
        try:
            parse_level(self.log_level)
        except ValueError as exc:
            problems.append(str(exc))
        if self.log_format not in LOG_FORMATS:
            problems.append(f"log format {self.log_format!r} must be text or json")
        if not self.metrics_host:
            problems.append("metrics host must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        if problems:
            raise ValueError("invalid trainer config: " + "; ".join(problems))
        check_plaintext_bind(self.host, tls=self.tls_cert is not None, insecure=self.insecure)

    @property
    def address(self) -> str:
        """``host:port`` to bind (IPv6 hosts bracketed)."""
        return host_port(self.host, self.port)

    @property
    def max_workers(self) -> int:
        """Size of the RPC thread pool: one per slot plus ``extra_workers``."""
        return (self.slots if isinstance(self.slots, int) else 1) + self.extra_workers
