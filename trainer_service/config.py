"""The trainer service's configuration: one frozen dataclass, validated on construction.

Each field carries its command-line help (``trainwire_ops.settings.option``):
``python -m trainer_service`` builds its flags from this class, so a default or a help text is
written once, and every flag can also come from the environment (``TRAINWIRE_TRAINER_`` + the
flag in upper case; the image cache also from ``TRAINWIRE_IMAGE_CACHE_DIR``, an alias that
deployments set).
"""

from __future__ import annotations

import math
import pathlib
import re
from dataclasses import dataclass

from trainer_service.core.placement import DEFAULT_RENDEZVOUS_HOST
from trainwire_ops.addresses import host_port
from trainwire_ops.checkpoints import DEFAULT_STORE
from trainwire_ops.logs import LOG_FORMATS, parse_level
from trainwire_ops.settings import option, port_or_off
from trainwire_ops.tls import check_plaintext_bind

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_TLS = "TLS (the certificate files are re-read on SIGHUP)"
_LOGS = "logging"
#: Addresses that name no one interface: other trainers cannot reach a rendezvous there.
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def parse_slots(text: str) -> int | str:
    """``--slots``: ``auto`` or a count."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError("neither auto nor a number") from None


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the trainer can be told; ``__main__`` builds it from flags (each field's help
    is its flag's help; ``python -m trainer_service --help`` lists them with defaults and
    variables). ``grace_s`` has no flag: the seconds running RPCs get to finish on shutdown.
    """

    host: str = option("127.0.0.1", "interface to listen on")
    port: int = option(50052, "TCP port; 0 picks a free one")
    slots: int | str = option(
        1,
        "training slots: jobs (or processes of multi-process jobs) that run at once; auto: one "
        "per visible GPU with CUDA (a job of N processes takes N GPUs), else 1",
        metavar="N|auto",
        parse=parse_slots,
    )
    device: str = option(
        "auto", "torch device: auto (CUDA when available, else CPU), cpu, cuda or cuda:N"
    )
    data_roots: tuple[pathlib.Path, ...] = option(
        (pathlib.Path("var/data"),),
        "a directory training data may come from; repeat the flag for more (datasets on shared "
        "filesystems): a task's relative model/dataset paths resolve against the first, and an "
        "absolute path must lie inside one of them",
        flag="--data-root",
        metavar="DIR",
        repeat=True,
    )
    heartbeat_s: float = option(
        5.0, "seconds without an episode (or while a job waits) after which a heartbeat is sent"
    )
    detach_grace_s: float = option(
        60.0,
        "seconds a job whose stream broke (gateway restart or crash) stays alive, blocked at its "
        "grant, for the gateway to re-attach; 0 cancels it at once",
    )
    image_cache_dir: pathlib.Path | None = option(
        None,
        "cache decoded dataset images here (also from $TRAINWIRE_IMAGE_CACHE_DIR; none: off)",
        metavar="DIR",
    )
    reward_modules: tuple[str, ...] = option(
        (),
        "a module of reward functions for GRPO tasks: a module name (importable here) or a .py "
        "file; each public function in it is a reward named MODULE:FUNCTION, called as TRL "
        "calls reward functions. Repeat the flag for more. Imported at start-up, and in each "
        "GRPO job's processes: only this flag makes the trainer import code",
        flag="--reward-module",
        metavar="MODULE|FILE.py",
        repeat=True,
    )
    checkpoint_store: str = option(
        DEFAULT_STORE,
        "where jobs write checkpoints and find those they resume from: a directory (shared "
        "by the trainers and the gateway: NFS, Lustre) or s3://BUCKET/PREFIX (endpoint from "
        "$AWS_ENDPOINT_URL, credentials from the usual AWS variables); checked at start-up",
        metavar="DIR|URL",
    )
    rendezvous_host: str = option(
        DEFAULT_RENDEZVOUS_HOST,
        "an address of this machine that the other trainers reach: the rendezvous of a GRPO "
        "job whose processes span trainers binds here (on a free port) when this trainer runs "
        "its rank 0, and every rank's collectives use the network interface that owns it. "
        "Neither is encrypted nor authenticated: use a private network",
        metavar="HOST",
    )
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics on this port (0 picks a free "
        "one; -1 or none: off)",
        metavar="PORT",
        parse=port_or_off,
    )
    metrics_host: str = option(
        "127.0.0.1", "interface of the metrics endpoint (loopback unless you say otherwise)"
    )
    tls_cert: pathlib.Path | None = option(
        None, "serve TLS with this PEM certificate chain", metavar="FILE", group=_TLS
    )
    tls_key: pathlib.Path | None = option(
        None, "the PEM private key of --tls-cert", metavar="FILE", group=_TLS
    )
    tls_client_ca: pathlib.Path | None = option(
        None,
        "accept only callers whose client certificate this PEM CA signed (mutual TLS: only "
        "gateways holding one can start training)",
        metavar="FILE",
        group=_TLS,
    )
    insecure: bool = option(
        False, "serve plaintext on a non-loopback --host (refused without it)", group=_TLS
    )
    log_level: str = option(
        "INFO", "logging level (DEBUG, INFO, WARNING, ...)", metavar="LEVEL", group=_LOGS
    )
    log_format: str = option(
        "text",
        "text: one line for people; json: one JSON object per line",
        choices=LOG_FORMATS,
        group=_LOGS,
    )
    grace_s: float = 3.0

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
        if not self.data_roots:
            problems.append("--data-root must name at least one directory")
        if not (math.isfinite(self.heartbeat_s) and 0 < self.heartbeat_s <= 3600):
            problems.append(f"heartbeat {self.heartbeat_s} must be in (0, 3600] seconds")
        if not (math.isfinite(self.detach_grace_s) and 0 <= self.detach_grace_s <= 86400):
            problems.append(f"detach grace {self.detach_grace_s} must be in 0..86400 seconds")
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
        if any(not spec.strip() for spec in self.reward_modules):
            problems.append("--reward-module must not be empty")
        if not self.checkpoint_store.strip():
            problems.append("--checkpoint-store must not be empty")
        if not self.metrics_host:
            problems.append("metrics host must not be empty")
        if self.rendezvous_host.strip("[]") in _WILDCARDS or any(
            c.isspace() for c in self.rendezvous_host
        ):
            problems.append(
                f"rendezvous host {self.rendezvous_host!r} must be one address of this machine "
                "that the other trainers reach (not empty, not a wildcard)"
            )
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
