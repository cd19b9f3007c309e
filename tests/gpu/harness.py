"""Helpers of the GPU checks: the device they train on, trainer processes on it, their rank
processes, and what ``nvidia-smi`` reads.

Trainer processes get the ``PYTHONPATH`` of this process after the repository's root and the
client package: on a GPU machine the packages carried as wheels (``bench/gpu_check.sh``) live on
it, and nothing of the repository is installed.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import psutil
import torch

from tests.fakes.gateway_harness import ROOT, trainer_process
from tests.grpo_fixtures import rank_in_title

#: Set to 1 to run the device-agnostic GPU checks on the CPU (see ``tests/gpu/conftest.py``).
ON_CPU_ENV = "TRAINWIRE_GPU_TESTS_ON_CPU"
MODEL_DIR = "models/tiny-vlm"
#: 64 rows of the colour demo: the provider's default 16 prompts a step learn it.
COLOURS_FILE = "datasets/colours/train.jsonl"


def job_device() -> str | None:
    """The device the GPU checks train on: ``cuda:0``, the CPU when asked, else None."""
    if torch.cuda.is_available():
        return "cuda:0"
    if os.environ.get(ON_CPU_ENV) == "1":
        return "cpu"
    return None


def child_environment(device: str) -> dict[str, str]:
    """The environment a trainer process on ``device`` adds to this one's."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if device.startswith("cuda"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible or ",".join(
            str(i) for i in range(torch.cuda.device_count())
        )
    return env


@contextlib.contextmanager
def gpu_trainer(
    log: pathlib.Path,
    device: str,
    data_root: pathlib.Path,
    store: pathlib.Path,
    *flags: str,
    slots: int = 1,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``python -m trainer_service`` on ``device`` (``trainer_process``), reading
    ``data_root`` and writing checkpoints to ``store``; yields the process and its address."""
    with trainer_process(
        log,
        *("--device", device, "--data-root", str(data_root), "--checkpoint-store", str(store)),
        *flags,
        slots=slots,
        env=child_environment(device),
    ) as started:
        yield started


def rank_processes(trainer_pid: int) -> list[psutil.Process]:
    """The GRPO rank processes below a trainer process (by their title)."""
    try:
        below = psutil.Process(trainer_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if rank_in_title(process) is not None:
                found.append(process)
    return found


def alive(process: psutil.Process) -> bool:
    """Whether a process still runs (a zombie does not)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _nvidia_smi(query: str) -> list[list[str]]:
    """``nvidia-smi --query-...=FIELDS`` for every GPU or process of the machine, as rows."""
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def _job_gpu_uuid() -> str:
    """The UUID of this process's ``cuda:0`` without its ``GPU-`` prefix (``nvidia-smi`` counts
    every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` hides)."""
    return str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")


def gpu_memory_used_mib() -> int:
    """Memory in use on the job's GPU (``cuda:0`` of this process), every process counted, as
    ``nvidia-smi`` reads it."""
    uuid = _job_gpu_uuid()
    for gpu, used in _nvidia_smi("--query-gpu=uuid,memory.used"):
        if gpu.removeprefix("GPU-") == uuid:
            return int(used)
    raise AssertionError(f"nvidia-smi lists no GPU {uuid}")


def gpu_process_ids() -> set[int]:
    """The processes ``nvidia-smi`` lists on the job's GPU (in a container it may list none)."""
    uuid = _job_gpu_uuid()
    rows = _nvidia_smi("--query-compute-apps=gpu_uuid,pid")
    return {
        int(row[1])
        for row in rows
        if len(row) == 2 and row[0].removeprefix("GPU-") == uuid and row[1].isdigit()
    }
