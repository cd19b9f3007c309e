#!/usr/bin/env bash
# GPU benchmark: a few GRPO steps of the offline tiny VLM on CUDA in bf16, as the trainer runs a
# job (the grpo provider's processes, ``process.run``); prints each step and a RESULT line.
#
#   bash bench/gpu_grpo.sh [STEPS]            # default 8 steps
#   BENCH_DEVICE=cpu bash bench/gpu_grpo.sh 2 # dry run of the same path without a GPU
#
# The job runs in processes of its own, one per GPU (num_processes = the number of visible
# GPUs, under NCCL; on a one-GPU host a single process). BENCH_PROCESSES=N picks N instead
# (BENCH_PROCESSES=2 with BENCH_DEVICE=cpu dry-runs two ranks under gloo). Then, on a host with
# two GPUs or more, one job across two trainer processes (one GPU each, ranks 0 and 1 of 2,
# NCCL, rendezvous on 127.0.0.1: bench/_two_trainers.py), as the gateway places a job no single
# trainer fits. BENCH_TRAINERS=2 forces it (with BENCH_DEVICE=cpu: a dry run under gloo);
# BENCH_TRAINERS=0 skips it. NCCL refuses two ranks on one GPU, so a one-GPU host skips it.
# On the CPU the task is smaller (2 completions of 8 tokens per step, one DataLoader worker,
# 64 x 64 images instead of 640 x 480).
#
# BENCH_MODEL=DIR: the offline tiny VLM is copied from DIR when DIR holds one, else built and
# also written to DIR (bench/gpu_check.sh's dry run hands it on to bench/gpu_real_size.py).
#
# Python: $PYTHON, else .venv/bin/python, else python3: the first that imports torch (with CUDA
# unless BENCH_DEVICE=cpu), trl and the client's protobuf modules. On a bare GPU machine run it
# through bench/gpu_check.sh, which installs the carried wheels and sets PYTHON and PYTHONPATH.
# The repository's packages are used from source (PYTHONPATH), nothing of it is installed.
set -euo pipefail

STEPS="${1:-8}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO/clients:$REPO"

export BENCH_DEVICE="${BENCH_DEVICE:-cuda:0}"
# Found, not imported (the benchmark imports them), except torch on a GPU: it must see CUDA.
CHECK='import importlib.util as u, os, sys
names = ("torch", "trl", "transformers", "datasets", "PIL", "google.rpc.error_details_pb2")
if any(u.find_spec(name) is None for name in names):
    sys.exit(1)
if os.environ["BENCH_DEVICE"] != "cpu":
    import torch
    sys.exit(not torch.cuda.is_available())'

usable() { [ -n "$1" ] && command -v "$1" >/dev/null 2>&1 && "$1" -c "$CHECK" >/dev/null 2>&1; }

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
    if usable "$candidate"; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
    echo "FAILED: no Python here imports torch${BENCH_DEVICE/cpu/} with trl, transformers and" \
        "datasets (BENCH_DEVICE=$BENCH_DEVICE); on a bare GPU machine run bench/gpu_check.sh," \
        "which installs the wheels bench/gpu_wheels.sh carries" >&2
    exit 2
fi

echo "python: $PY"
# Run from a real file: DataLoader workers (fork server) re-import the main module by path,
# which a script read from stdin does not have.
RUNNER="$(mktemp -t gpu_grpo_XXXXXX.py)"
trap 'rm -f "$RUNNER"' EXIT
cat > "$RUNNER" <<'PYEOF'
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)
import torch
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process, validate
from trainer_service.tools import make_demo_dataset, make_tiny_vlm


def main() -> None:
    steps = int(sys.argv[1])
    device = os.environ["BENCH_DEVICE"]
    cuda = device.startswith("cuda")
    bf16 = cuda and torch.cuda.is_bf16_supported()
    gpu = torch.cuda.get_device_name(0) if cuda else "none (dry run on CPU)"
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {device}: {gpu}, bf16: {bf16}")
    with tempfile.TemporaryDirectory(prefix="gpu-grpo-") as tmp:
        root = pathlib.Path(tmp)
        kept = os.environ.get("BENCH_MODEL")
        if kept and (pathlib.Path(kept) / "config.json").is_file():
            shutil.copytree(kept, root / "model")
        else:
            make_tiny_vlm.build(root / "model")
            if kept:  # whole or not at all: a reader looks for its config.json
                shutil.copytree(root / "model", kept + ".part")
                os.replace(kept + ".part", kept)
        # Camera-sized images on a GPU; on the CPU (a dry run) small ones decode in no time.
        make_demo_dataset.build(root / "data", rows=64, size=(640, 480) if cuda else (64, 64))
        generations, batch, tokens, workers = (8, 16, 32, 2) if cuda else (2, 2, 8, 1)
        task = episode_pb2.TrainTask(
            grpo=episode_pb2.GrpoTask(
                model_path="model",
                dataset_path="data/train.jsonl",
                reward_functions=["exact_match", "format", "length"],
                num_generations=generations,
                batch_size=batch,
                max_completion_length=tokens,
                dataloader_num_workers=workers,
            )
        )
        problems = validate(task, (root,))
        assert problems == [], problems
        config = episode_pb2.TrainConfig(max_episodes=steps, seed=1)
        gpus = torch.cuda.device_count() if cuda else 0
        processes = int(os.environ.get("BENCH_PROCESSES", max(1, gpus)))
        if processes > 0:
            # As the trainer runs it: one process per GPU (batch_size is per process).
            task.grpo.num_processes = processes
            devices = tuple(f"cuda:{i}" for i in range(processes)) if cuda else ("cpu",) * processes
            job = TrainJob("gpu-bench-processes", task, config, device, root, None,
                           threading.Event(), devices=devices)
            measure(f"{processes} process(es)", job, steps,
                    f"devices={','.join(devices)} processes={processes} bf16={bf16}")
        trainers = int(os.environ.get("BENCH_TRAINERS", 2 if gpus >= 2 else 0))
        if trainers >= 2:
            across(root, task, config, trainers, cuda, steps)


def across(root, task, config, trainers, cuda, steps) -> None:
    """One job, one rank on each of ``trainers`` trainer processes (one GPU each)."""
    from bench._two_trainers import across_trainers

    print(f"== {trainers} trainers, one process each")
    if cuda:
        devices = [("cuda:0", {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(trainers)]
    else:
        devices = [("cpu", {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})] * trainers
    logs = pathlib.Path(tempfile.mkdtemp(prefix="gpu-grpo-trainers-"))
    started, stamps = across_trainers(root, task, config, devices, logs)
    walls = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"RESULT mode={trainers}_trainers devices={','.join(d for d, _ in devices)} "
          f"steps={steps} median_wall_ms={statistics.median(walls or [0.0]) * 1000:.1f} "
          f"first_step_wall_ms={(stamps[0] - started) * 1000:.1f} (trainer logs: {logs})")


def measure(name, job, steps, what) -> None:
    """Runs the job as the trainer's provider does and prints each step and a RESULT line."""
    print(f"== {name}")
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    walls, step_times, peaks = [], [], []
    last = time.perf_counter()
    for episode in process.run(job):
        now = time.perf_counter()
        checker.check(episode)
        walls.append(now - last)
        last = now
        step_times.append(episode.metrics.get("step_time", float("nan")))
        if "gpu_memory_peak_gib" in episode.metrics:  # CUDA only
            peaks.append(episode.metrics["gpu_memory_peak_gib"])
        print(f"step {episode.episode:3d}  reward {episode.reward:+.3f}  "
              f"step_time {step_times[-1] * 1000:8.1f} ms  wall {walls[-1] * 1000:8.1f} ms")
    checker.finish()
    if len(walls) != steps:
        raise SystemExit(f"FAILED: {len(walls)} episodes for {steps} steps")
    steady = step_times[1:] or step_times
    print(f"RESULT mode={name.replace(' ', '_')} {what} steps={steps} "
          f"median_step_time_ms={statistics.median(steady) * 1000:.1f} "
          f"median_wall_ms={statistics.median(walls[1:] or walls) * 1000:.1f} "
          f"first_step_wall_ms={walls[0] * 1000:.1f}"
          + (f" gpu_memory_peak_gib={max(peaks):.2f}" if peaks else ""))


# DataLoader workers start from a fork server and re-import this file: guard the entry point.
if __name__ == "__main__":
    main()
PYEOF
"$PY" "$RUNNER" "$STEPS"
