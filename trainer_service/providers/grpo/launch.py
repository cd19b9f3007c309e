"""Starting the processes of a GRPO job: devices, environment, the launcher and the job spec.

Each rank is forked by the trainer's rank launcher (:func:`launcher`: multiprocessing's fork
server, a fresh interpreter that imported the training stack once, so a rank starts in
milliseconds instead of importing torch, transformers and TRL for seconds; never a fork of the
trainer itself, whose gRPC threads do not survive a fork). The forked process joins the job's
process group (the first rank leads a new one; the others join it), takes the rank's
environment and runs ``python -m trainer_service.providers.grpo.worker`` as it would run alone
(:func:`_run_rank`), with its end of the job's channel (:mod:`.wire`) as ``--fd``; ``ps``
shows it as that module, its rank and its trainer. The rank's first message is its ``JOB``
spec (:func:`job_spec`): everything it needs to build the same trainer as every other rank.
The launcher lives as long as the trainer and exits when the trainer dies; the ranks are its
children (it reaps them and tells the trainer how each exited). What the training libraries read
from the environment when they are imported (``HF_HOME``, ``HF_HUB_OFFLINE``...) is the
trainer's environment when its first GRPO job started; a rank's own variables (``RANK``,
``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``...) are read after the fork, and nothing in the
launcher touches CUDA before it.

A trainer's share of a job whose ranks span trainers (``TrainJob.placement``) starts its own
ranks only, ``first_rank`` onwards, on its own slots: ``RANK`` and ``WORLD_SIZE`` are the
job's, ``LOCAL_RANK`` (and the device, ``CUDA_VISIBLE_DEVICES``) this trainer's. Its ranks
meet the others in rank 0's ``TCPStore`` (:mod:`.rendezvous`): rank 0's trainer binds a
listening socket on its ``--rendezvous-host`` (:func:`rendezvous_listener`) and passes it to
rank 0 (``--listen-fd``); the spec's ``meeting`` says where and in which role. Every rank of
such a job has ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` on CUDA) set to the
interface that owns its trainer's ``--rendezvous-host`` (:func:`interface_of`), so the
collectives listen there only, and ``MASTER_ADDR``/``MASTER_PORT`` set to the rendezvous
(accelerate wants them when the ranks are not all on one machine).

:mod:`.process` drives what happens once a rank is started.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import multiprocessing
import multiprocessing.context
import os
import pathlib
import pickle
import runpy
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from multiprocessing import forkserver, reduction, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import setproctitle

from trainer_service.core.placement import Placement, split_host_port
from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.grpo import wire
from trainer_service.providers.grpo.library_output import WorkerLogging

#: Seconds between a rank's BEAT messages.
BEAT_S = 1.0
#: The module each rank runs (as ``python -m`` would).
WORKER_MODULE = "trainer_service.providers.grpo.worker"
#: What the rank launcher imports once, so that a rank starts with the training stack loaded
#: instead of importing it itself, with the cyclic collector paused meanwhile and the result
#: frozen (``preload_begin``/``preload_end``). Nothing here may touch CUDA: the ranks fork from it.
LAUNCHER_PRELOAD = (
    "trainer_service.providers.grpo.preload_begin",
    "torch",
    "transformers",
    "trl",
    "datasets",
    "PIL.Image",
    "trainer_service.providers.grpo.build",
    "trainer_service.providers.grpo.preload_end",
)
#: The longest path of a Unix socket, less its terminating NUL (Linux's ``sun_path``).
UNIX_PATH_MAX = 107
#: A rank's process title (``ps``): its module, its rank in the job and its trainer's pid.
RANK_TITLE = "{module} (GRPO rank {rank}, trainer {trainer})"
#: How long a rank's start is tried again while the launcher it met is dead.
LAUNCHER_RETRY_S = 10.0
#: How long a started rank may take to join its job's process group.
GROUP_TIMEOUT_S = 30.0
#: A rank's role in the rendezvous of a job that spans trainers: rank 0 (it hosts the store
#: and relays its controls), another rank of rank 0's trainer, a rank of another trainer.
HOST, PEER, FOLLOW = "host", "peer", "follow"
# Launcher variables a trainer may itself have been started with; a job sets its own.
_DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
)


def rank_devices(job: TrainJob, processes: int) -> tuple[list[str], str, dict[str, str]]:
    """(device of each rank as the rank sees it, backend, environment for every rank).

    The job's ``devices`` name one device per process; with fewer, every process runs on
    ``job.device``.
    """
    devices = list(job.devices) if len(job.devices) == processes else []
    devices = devices or [job.device] * processes
    env: dict[str, str] = {}
    if not devices[0].startswith("cuda"):
        # A CPU job never touches a GPU, and runs one torch thread per process (more stall a
        # small box); OMP_NUM_THREADS also silences accelerate.
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        return ["cpu"] * processes, "gloo", env
    # Each rank sees the job's GPUs only, as cuda:0..n-1 in rank order.
    indices = [int(d.split(":", 1)[1]) if ":" in d else 0 for d in devices]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else None
    env["CUDA_VISIBLE_DEVICES"] = ",".join(
        names[i] if names is not None and i < len(names) else str(i) for i in indices
    )
    return [f"cuda:{rank}" for rank in range(processes)], "nccl", env


def rank_env(
    extra: dict[str, str], rank: int, processes: int, placement: Placement | None = None
) -> dict[str, str]:
    """The environment of this trainer's ``rank``-th process of the job: the trainer's, less its
    launcher variables, plus ``extra``, the import roots of this code and, with several
    processes in the job, the rank's place (global ``RANK`` and ``WORLD_SIZE`` of a job that
    spans trainers, ``LOCAL_RANK`` on this trainer)."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env.update(extra)
    import trainer_service
    import trainwire

    roots = {
        str(pathlib.Path(trainer_service.__file__).resolve().parents[1]),
        str(pathlib.Path(trainwire.__file__).resolve().parents[1]),
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [*sorted(roots), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if placement is not None:
        env.update(RANK=str(placement.first_rank + rank), LOCAL_RANK=str(rank))
        env.update(WORLD_SIZE=str(placement.world_size), LOCAL_WORLD_SIZE=str(processes))
    elif processes > 1:
        world = str(processes)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world)
        env.update(LOCAL_WORLD_SIZE=world)
    return env


def interface_of(host: str) -> str | None:
    """The network interface that owns ``host`` (an address, or a name resolved here);
    ``None`` when no interface of this machine has it."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    wanted = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in found}
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(address.address.split("%", 1)[0]) in wanted:
                    return name
            except ValueError:
                continue
    return None


def meeting_env(job: TrainJob, address: str, backend: str) -> dict[str, str]:
    """What every rank of a job that spans trainers adds to its environment (see the module
    docstring).

    Raises:
        ProviderError: ``--rendezvous-host`` is no address of this machine.
    """
    host = job.rendezvous_host
    interface = interface_of(host)
    if interface is None:
        raise ProviderError(
            "This trainer cannot take part in a job that spans trainers: its "
            f"--rendezvous-host {host} is not an address of this machine.",
            detail=f"no network interface has {host}",
            code="INTERNAL",
            reason="PROVIDER_UNAVAILABLE",
        )
    parsed = split_host_port(address)
    assert parsed is not None, address  # checked with the request, or bound here
    env = {"GLOO_SOCKET_IFNAME": interface, "MASTER_ADDR": parsed[0], "MASTER_PORT": str(parsed[1])}
    if backend == "nccl":
        env["NCCL_SOCKET_IFNAME"] = interface
    return env


def rendezvous_listener(host: str) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` and listening: rank 0 hosts the job's
    store on it, and a rank that connects before rank 0 is up waits in its backlog.

    Raises:
        ProviderError: It could not be bound.
    """
    listener: socket.socket | None = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), 0, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        if listener is not None:
            listener.close()
        raise ProviderError(
            "The trainer could not open the rendezvous of a job that spans trainers.",
            detail=f"--rendezvous-host {host}: {exc}",
            code="INTERNAL",
            reason="PROVIDER_UNAVAILABLE",
        ) from exc
    return listener


def job_spec(
    job: TrainJob,
    rank: int,
    processes: int,
    device: str,
    backend: str,
    scratch: pathlib.Path,
    resume: Mapping[str, Any] | None = None,
    meeting: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``JOB`` message's payload for this trainer's ``rank``-th process of the job (it also
    makes the rank's output dir).

    ``resume``: the checkpoint to resume from (``directory``, ``episode``, ``best_reward``,
    ``last_reward``), checked by the trainer. ``meeting``: for a job that spans trainers
    (``job.placement``), where its ranks meet (:func:`meeting_spec`); the spec's ``rank`` and
    ``world_size`` are then the job's.
    """
    logging_like = WorkerLogging.like_this_process(None)
    formatter = None
    if logging_like.formatter is not None:
        formatter = base64.b64encode(pickle.dumps(logging_like.formatter)).decode()
    output = scratch / f"rank{rank}"
    output.mkdir(exist_ok=True)
    placement = job.placement
    first, world = (placement.first_rank, placement.world_size) if placement else (0, processes)
    return {
        "run_id": job.run_id,
        "rank": first + rank,
        "local_rank": rank,
        "world_size": world,
        "device": device,
        "backend": backend if world > 1 else "",
        "rendezvous": (scratch / "rendezvous").as_uri(),
        "task": base64.b64encode(job.task.SerializeToString()).decode(),
        "config": base64.b64encode(job.config.SerializeToString()).decode(),
        "data_roots": [str(root) for root in job.data_roots],
        "image_cache_dir": str(job.image_cache_dir) if job.image_cache_dir else None,
        "reward_modules": list(job.reward_modules),
        "output_dir": str(output),
        "log": {"formatter": formatter, "level": logging_like.level},
        "beat_s": BEAT_S,
        "resume": dict(resume) if resume is not None else None,
        "meeting": dict(meeting) if meeting is not None else None,
    }


def meeting_spec(placement: Placement, rank: int, address: str) -> dict[str, Any]:
    """The ``meeting`` of this trainer's ``rank``-th process of a job that spans trainers: the
    rendezvous and the process's role in it (:mod:`.rendezvous`): ``host`` (rank 0, which gets
    the listening socket as ``--listen-fd``), ``peer`` (another rank of rank 0's trainer) or
    ``follow`` (a rank of another trainer)."""
    parsed = split_host_port(address)
    assert parsed is not None, address
    role = (HOST if rank == 0 else PEER) if placement.hosts_rendezvous else FOLLOW
    return {
        "address": address,
        "host": parsed[0],
        "port": parsed[1],
        "role": role,
        # The ranks rank 0 relays its controls to: every rank of the other trainers.
        "remote_ranks": list(range(placement.processes, placement.world_size))
        if role == HOST
        else [],
    }


def launcher() -> multiprocessing.context.ForkServerContext:
    """The rank launcher: multiprocessing's fork server, with :data:`LAUNCHER_PRELOAD` imported
    in it once (it starts with the first rank, and again after it died)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(LAUNCHER_PRELOAD))
    return context


def spawn_rank(
    env: dict[str, str], pgid: int | None, rank: int, listener: socket.socket | None = None
) -> tuple[BaseProcess, wire.ChannelEnd]:
    """Starts one rank process, forked by the :func:`launcher`, and returns it with the trainer's
    end of its channel once it is in the job's process group.

    Args:
        env: The rank's environment (:func:`rank_env`).
        pgid: The job's process group; ``None`` for the first rank, which leads a new one.
        rank: The rank's index on this trainer (its process title names it).
        listener: Rank 0's rendezvous socket, passed as ``--listen-fd``.

    Raises:
        ProviderError: The process could not be started.
    """
    parent, child = wire.ChannelEnd.pair()
    args = (WORKER_MODULE, env, pgid or 0, rank, os.getpid(), child, listener, _Inherited(2))
    process: BaseProcess | None = None
    try:
        process = _start(args, rank)
        _await_group(process, pgid)
    except (OSError, ValueError, EOFError, ProviderError) as exc:
        parent.close()
        if process is not None and process.pid is not None and process.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
        if isinstance(exc, ProviderError):
            raise
        message = "The trainer could not start a training process."
        if isinstance(exc, OSError) and "AF_UNIX path too long" in str(exc):
            message = (
                f"The trainer could not start a training process: its temporary directory "
                f"{tempfile.gettempdir()} is too deep for the Unix sockets of its job processes "
                f"(a socket path has at most {UNIX_PATH_MAX} bytes); give the trainer a shorter "
                f"TMPDIR."
            )
        raise ProviderError(
            message,
            detail=f"{type(exc).__name__}: {exc}",
            code="INTERNAL",
            reason="PROCESS_DIED",
        ) from exc
    finally:
        child.close()
    return process, parent


def _start(args: tuple[Any, ...], rank: int) -> BaseProcess:
    """Has the launcher fork a rank running :func:`_run_rank` with ``args``.

    A launcher that died is started again by the next request, once it can be reaped: until
    then (its threads still exiting) a request meets the dead one, and is made again.
    """
    deadline = time.monotonic() + LAUNCHER_RETRY_S
    while True:
        process = launcher().Process(
            target=_run_rank,
            args=args,
            name=f"grpo-rank-{rank}",
            # Daemonic: a trainer that exits with a job still running sends its ranks SIGTERM
            # (the lifeline's signal) rather than waiting for them.
            daemon=True,
        )
        try:
            process.start()
            return process
        except (EOFError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _await_group(process: BaseProcess, pgid: int | None) -> None:
    """Waits until ``process`` is in the job's process group (its own, led by it, when ``pgid``
    is ``None``): from then on one ``killpg`` reaches it."""
    assert process.pid is not None
    wanted = process.pid if pgid is None else pgid
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while True:
        try:
            if os.getpgid(process.pid) == wanted:
                return
        except ProcessLookupError:
            pass
        if process.exitcode is not None or time.monotonic() > deadline:
            raise ProviderError(
                "The trainer could not start a training process.",
                detail=f"pid {process.pid} never joined process group {wanted} "
                f"(exit code {process.exitcode})",
                code="INTERNAL",
                reason="PROCESS_DIED",
            )
        time.sleep(0.002)


class _Inherited:
    """A descriptor of the trainer that a forked rank gets a copy of (the launcher passes it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _inherited_fd, (reduction.DupFd(self.fd),)


def _inherited_fd(duplicate: Any) -> int:
    return int(duplicate.detach())


def _run_rank(
    module: str,
    env: dict[str, str],
    pgid: int,
    rank: int,
    trainer_pid: int,
    channel: Connection,
    listener: socket.socket | None,
    stderr: int,
) -> None:
    """A forked rank's first moves, then ``python -m module`` as the rank would run it alone.

    It joins the job's process group (``pgid`` 0: leads a new one), writes to the trainer's
    stderr (stdout too: the trainer's stdout carries its announcements only), takes the rank's
    environment (and the thread count it names: torch read it before the fork) and starts
    from multiprocessing's state of a fresh interpreter; ``ps`` names it after its module, its
    rank and its trainer.
    """
    # First: the title takes its room from the environment's original strings.
    title = RANK_TITLE.format(module=module, rank=env.get("RANK", rank), trainer=trainer_pid)
    setproctitle.setproctitle(title)
    for target in (1, 2):  # before anything can fail: a failure's traceback goes there
        os.dup2(stderr, target)
    os.close(stderr)
    os.setpgid(0, pgid)
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    _leave_the_launchers_descriptors()
    # As in a fresh interpreter: the default start method (the fork server's child inherits
    # "forkserver"), and the rank may start processes of its own (DataLoader workers).
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().daemon = False
    fd = os.dup(channel.fileno())
    channel.close()
    argv = ["--fd", str(fd), "--parent-pid", str(os.getppid())]
    if listener is not None:
        argv += ["--listen-fd", str(listener.detach())]
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _leave_the_launchers_descriptors() -> None:
    """Closes the two descriptors of the trainer that the fork server hands every child.

    The trainer's "alive" pipe: while a rank held it, the launcher would not see the trainer die
    and the ranks' parent-death signal would never fire. The trainer's resource tracker: a rank
    registers its semaphores with a tracker of its own, in the job's process group, as when it
    was started alone, rather than leaving them to the trainer's.
    """
    for owner, name in (
        (forkserver._forkserver, "_forkserver_alive_fd"),
        (resource_tracker._resource_tracker, "_fd"),
    ):
        fd = getattr(owner, name, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(owner, name, None)
