"""How the job runner runs jobs and what it reports of itself: :class:`RunnerSettings` (with the
defaults of its stream settings) and :class:`Capabilities` (``GetCapabilities``, with each
:class:`Gpu` its jobs may use). The runner itself lives in ``trainer_service.core.jobs``, which
re-exports them."""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer_service.core.placement import DEFAULT_RENDEZVOUS_HOST
from trainwire.v1 import trainer_service_pb2

#: The folder of the system's temporary directory that trainers keep their scratch in.
SCRATCH_BASE_NAME = "trainwire-scratch"


def default_scratch_base() -> pathlib.Path:
    """``$TMPDIR/trainwire-scratch``: the scratch of a runner given no ``scratch_dir``, and the
    parent of every trainer process's own (``trainer_service.scratch``)."""
    return pathlib.Path(tempfile.gettempdir()) / SCRATCH_BASE_NAME


#: Episodes a job may run ahead of its stream when it has no grant (direct use). Small, so that
#: a slow reader throttles the provider quickly, but more than one so the provider can compute
#: ahead of a slow send.
DEFAULT_QUEUE_SIZE = 4
#: Episodes a job holds for a re-attach. The gateway's lead (paced runs) and window (unpaced
#: runs) stay far below it, so a restarted gateway always finds what it has not committed.
DEFAULT_RETAIN = 1024
DEFAULT_DETACH_GRACE_S = 60.0


@dataclass(frozen=True)
class Gpu:
    """One GPU a trainer's jobs may use, as read when asked (``GetCapabilitiesResponse.gpus``).

    Attributes:
        index: Its CUDA device index in the trainer (``cuda:N``: after
            ``CUDA_VISIBLE_DEVICES``).
        name: The device's name (``NVIDIA H200``).
        memory_total_bytes: Its memory.
        memory_used_bytes: Memory in use by every process on it.
        utilization: Compute utilization over the driver's last sample period, 0..1.
    """

    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float


@dataclass(frozen=True)
class Capabilities:
    """What this trainer offers and how busy it is; ``gpus`` in CUDA index order (empty on a
    CPU trainer)."""

    providers: tuple[str, ...]
    device: str
    slots_total: int
    slots_free: int
    torch_version: str
    trl_version: str
    server_version: str
    gpus: tuple[Gpu, ...] = ()
    #: Every reward function name a task may use here (GRPO's built-in ones, then those of
    #: the trainer's reward modules).
    reward_functions: tuple[str, ...] = ()
    #: Each offered provider's defaults (its ``defaults()``), by provider name; a provider
    #: without ``defaults`` is absent.
    provider_defaults: Mapping[str, trainer_service_pb2.ProviderDefaults] = field(
        default_factory=dict
    )


@dataclass(frozen=True)
class RunnerSettings:
    """How the runner runs jobs.

    Attributes:
        device: The torch device jobs run on (``cpu``, ``cuda:0``) when the slot pool names
            no device of its own.
        device_description: The device for humans (``cuda:0 NVIDIA H200``).
        data_roots: The directories training data may come from: relative task paths resolve
            against the first; an absolute one must lie inside one of them.
        image_cache_dir: Image cache for providers that decode images; ``None`` = off.
        heartbeat_s: Seconds without an episode after which a heartbeat goes out.
        queue_size: Episodes a job without a grant may run ahead of its stream.
        retain: Episodes a job holds for a re-attach.
        detach_grace_s: Seconds a job whose stream broke stays alive for a re-attach (0: it is
            cancelled at once).
        scratch_dir: Where jobs write checkpoints before they go into the store, and fetch
            the ones they resume from (a directory per job, removed when it ends); None: the
            system's temporary directory.
        rendezvous_host: The address of this machine that jobs spanning several trainers
            meet on: rank 0's trainer binds the job's rendezvous there, and every rank's
            collectives use the interface that owns it.
        reward_modules: The trainer's ``--reward-module`` specs (modules or ``.py`` files),
            which providers import for their reward functions; no request can add one.
    """

    device: str = "cpu"
    device_description: str = "cpu"
    data_roots: tuple[pathlib.Path, ...] = (pathlib.Path("var/data"),)
    image_cache_dir: pathlib.Path | None = None
    heartbeat_s: float = 5.0
    queue_size: int = DEFAULT_QUEUE_SIZE
    retain: int = DEFAULT_RETAIN
    detach_grace_s: float = DEFAULT_DETACH_GRACE_S
    scratch_dir: pathlib.Path | None = None
    rendezvous_host: str = DEFAULT_RENDEZVOUS_HOST
    reward_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.data_roots:
            raise ValueError("data_roots must name at least one directory")
