"""Starting the processes of a GRPO job: devices, environment, the command line and the job spec.

The trainer starts each rank as ``python -m trainer_service.providers.grpo.worker`` (a fresh
interpreter that finds its entry point by module name, never a fork of the trainer), with its
end of the job's channel (:mod:`.wire`) passed as ``--fd`` and its process group chosen by the
caller (rank 0 leads a new one; the others join it). The rank's first message is its ``JOB``
spec (:func:`job_spec`): everything it needs to build the same trainer as every other rank.

:mod:`.process` drives what happens once a rank is started.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import base64
import os
import pathlib
import pickle
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.grpo import wire
from trainer_service.providers.grpo.library_output import WorkerLogging

#: Seconds between a rank's BEAT messages.
BEAT_S = 1.0
#: The module each rank runs (``python -m``).
WORKER_MODULE = "trainer_service.providers.grpo.worker"
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
        # A CPU job never touches a GPU, and one torch thread per process (measured on a
        # small box: more threads stall it); OMP_NUM_THREADS also silences accelerate.
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


def rank_env(extra: dict[str, str], rank: int, processes: int) -> dict[str, str]:
    """The environment of rank ``rank``: the trainer's, less its launcher variables, plus
    ``extra``, the import roots of this code and, with several processes, the rank's place."""
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
    if processes > 1:
        world = str(processes)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world)
        env.update(LOCAL_WORLD_SIZE=world)
    return env


def job_spec(
    job: TrainJob,
    rank: int,
    processes: int,
    device: str,
    backend: str,
    scratch: pathlib.Path,
    resume: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``JOB`` message's payload for rank ``rank`` (it also makes the rank's output dir).

    ``resume``: the checkpoint to resume from (``directory``, ``episode``, ``best_reward``,
    ``last_reward``), checked by the trainer.
    """
    logging_like = WorkerLogging.like_this_process(None)
    formatter = None
    if logging_like.formatter is not None:
        formatter = base64.b64encode(pickle.dumps(logging_like.formatter)).decode()
    output = scratch / f"rank{rank}"
    output.mkdir(exist_ok=True)
    return {
        "run_id": job.run_id,
        "rank": rank,
        "world_size": processes,
        "device": device,
        "backend": backend if processes > 1 else "",
        "rendezvous": (scratch / "rendezvous").as_uri(),
        "task": base64.b64encode(job.task.SerializeToString()).decode(),
        "config": base64.b64encode(job.config.SerializeToString()).decode(),
        "data_roots": [str(root) for root in job.data_roots],
        "image_cache_dir": str(job.image_cache_dir) if job.image_cache_dir else None,
        "output_dir": str(output),
        "log": {"formatter": formatter, "level": logging_like.level},
        "beat_s": BEAT_S,
        "resume": dict(resume) if resume is not None else None,
    }


def spawn_rank(
    env: dict[str, str], pgid: int | None
) -> tuple[subprocess.Popen[bytes], wire.ChannelEnd]:
    """Starts one rank process and returns it with the trainer's end of its channel.

    Args:
        env: The rank's environment (:func:`rank_env`).
        pgid: The job's process group; ``None`` for rank 0, which leads a new one.

    Raises:
        ProviderError: The process could not be started.
    """
    parent, child = wire.ChannelEnd.pair()
    try:
        popen = subprocess.Popen(
            [
                *(sys.executable, "-m", WORKER_MODULE),
                *("--fd", str(child.fileno()), "--parent-pid", str(os.getpid())),
            ],
            pass_fds=(child.fileno(),),
            # Rank 0 leads a new group; the others join it. Everything they start
            # stays in it, so one killpg ends the whole job.
            process_group=0 if pgid is None else pgid,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=2,  # the trainer's stdout carries its announcements only
        )
    except OSError as exc:
        parent.close()
        raise ProviderError(
            "The trainer could not start a training process.",
            detail=f"{type(exc).__name__}: {exc}",
            code="INTERNAL",
            reason="PROCESS_DIED",
        ) from exc
    finally:
        child.close()
    return popen, parent
