#!/usr/bin/env bash
# GPU benchmark: a few GRPO steps of the grpo provider on CUDA with bf16 on the offline tiny VLM;
# prints the step time. Run from anywhere on a GPU machine holding a copy of the repo:
#
#   bash bench/gpu_grpo.sh [STEPS]            # default 8 steps
#   BENCH_DEVICE=cpu bash bench/gpu_grpo.sh 2 # dry run of the same path without a GPU
#
# It runs the provider in this process on one GPU, then as the trainer runs it: in processes of
# its own, one per GPU (num_processes = the number of visible GPUs, under NCCL; on a one-GPU host
# a single child process). BENCH_PROCESSES=N picks N instead (BENCH_PROCESSES=2 with
# BENCH_DEVICE=cpu dry-runs two ranks under gloo; 0 skips the processes case).
# Then, on a host with two GPUs or more, one job across two trainer processes (one GPU each,
# ranks 0 and 1 of 2, NCCL, rendezvous on 127.0.0.1: bench/_two_trainers.py), as the gateway
# places a job no single trainer fits. BENCH_TRAINERS=2 forces it (with BENCH_DEVICE=cpu: a dry
# run under gloo); BENCH_TRAINERS=0 skips it. NCCL refuses two ranks on one GPU, so a one-GPU
# host skips it.
#
# Python selection (first that imports torch with CUDA and trl):
#   $PYTHON, .venv/bin/python, .venv-gpu/bin/python, python3.
# If none qualifies, it creates .venv-gpu (with --system-site-packages, so a preinstalled CUDA
# torch is reused) and installs what is missing OFFLINE from a wheel folder: $WHEELS_DIR, else
# ./wheels, else ./bench/wheels (pip install --no-index --find-links). Fill that folder on a
# connected machine with, e.g.:
#   pip download -d wheels -c constraints.txt torch trl transformers accelerate datasets \
#       pillow tokenizers numpy protobuf grpcio googleapis-common-protos safetensors
# The repo's packages are used from source (PYTHONPATH), nothing of it is installed.
set -euo pipefail

STEPS="${1:-8}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO/clients:$REPO${PYTHONPATH:+:$PYTHONPATH}"

export BENCH_DEVICE="${BENCH_DEVICE:-cuda:0}"
CHECK='import os, torch, trl, transformers, datasets, PIL, google.protobuf, google.rpc.error_details_pb2
assert os.environ["BENCH_DEVICE"] == "cpu" or torch.cuda.is_available()'

usable() { [ -n "$1" ] && [ -x "$(command -v "$1" 2>/dev/null || echo "$1")" ] && "$1" -c "$CHECK" >/dev/null 2>&1; }

PY=""
for candidate in "${PYTHON:-}" .venv/bin/python .venv-gpu/bin/python python3; do
    if usable "$candidate"; then PY="$candidate"; break; fi
done

if [ -z "$PY" ]; then
    WHEELS="${WHEELS_DIR:-}"
    for dir in "$WHEELS" wheels bench/wheels; do
        if [ -n "$dir" ] && [ -d "$dir" ]; then WHEELS="$dir"; break; fi
    done
    BASE_PY="$(command -v python3.11 || command -v python3)"
    echo "no Python with CUDA torch + trl found; creating .venv-gpu from $BASE_PY" >&2
    [ -x .venv-gpu/bin/python ] || "$BASE_PY" -m venv --system-site-packages .venv-gpu
    if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
        echo "installing from wheels in $WHEELS (offline)" >&2
        PKGS=(trl transformers accelerate datasets pillow tokenizers numpy protobuf grpcio
              googleapis-common-protos safetensors)
        # Keep a preinstalled CUDA torch; install torch only when there is none.
        .venv-gpu/bin/python -c 'import torch' 2>/dev/null || PKGS=(torch "${PKGS[@]}")
        CONSTRAINTS=()
        [ -f constraints.txt ] && CONSTRAINTS=(-c constraints.txt)
        .venv-gpu/bin/python -m pip install --quiet --no-index --find-links "$WHEELS" \
            "${CONSTRAINTS[@]}" "${PKGS[@]}"
    else
        echo "no wheel folder (set WHEELS_DIR); trying with what the system has" >&2
    fi
    PY=.venv-gpu/bin/python
    if ! "$PY" -c "$CHECK"; then
        echo "FAILED: $PY cannot import torch with CUDA, trl, transformers and datasets" >&2
        exit 2
    fi
fi

echo "python: $PY"
# Run from a real file: DataLoader workers (fork server) re-import the main module by path,
# which a script read from stdin does not have.
RUNNER="$(mktemp -t gpu_grpo_XXXXXX.py)"
trap 'rm -f "$RUNNER"' EXIT
cat > "$RUNNER" <<'PYEOF'
import pathlib
import statistics
import sys
import tempfile
import threading
import os
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)
import torch
import transformers
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process, provider, validate
from trainer_service.tools import make_demo_dataset, make_tiny_vlm



def main() -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    steps = int(sys.argv[1])
    device = os.environ["BENCH_DEVICE"]
    cuda = device.startswith("cuda")
    bf16 = cuda and torch.cuda.is_bf16_supported()
    gpu = torch.cuda.get_device_name(0) if cuda else "none (dry run on CPU)"
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {device}: {gpu}, bf16: {bf16}")
    with tempfile.TemporaryDirectory(prefix="gpu-grpo-") as tmp:
        root = pathlib.Path(tmp)
        make_tiny_vlm.build(root / "model")
        make_demo_dataset.build(root / "data", rows=64, size=(640, 480))
        task = episode_pb2.TrainTask(
            grpo=episode_pb2.GrpoTask(
                model_path="model",
                dataset_path="data/train.jsonl",
                reward_functions=["exact_match", "format", "length"],
                num_generations=8,
                batch_size=16,
                max_completion_length=32,
                dataloader_num_workers=2,
            )
        )
        assert validate(task, root) == []
        config = episode_pb2.TrainConfig(max_episodes=steps, seed=1)
        job = TrainJob("gpu-bench", task, config, device, root, None, threading.Event())
        measure("in-thread", provider.run, job, steps, f"device={device} bf16={bf16}")
        gpus = torch.cuda.device_count() if cuda else 0
        processes = int(os.environ.get("BENCH_PROCESSES", max(1, gpus) if cuda else 0))
        if processes > 0:
            # As the trainer runs it: one process per GPU (batch_size is per process).
            task.grpo.num_processes = processes
            devices = tuple(f"cuda:{i}" for i in range(processes)) if cuda else ("cpu",) * processes
            job = TrainJob("gpu-bench-processes", task, config, device, root, None,
                           threading.Event(), devices=devices)
            measure(f"{processes} process(es)", process.run, job, steps,
                    f"devices={','.join(devices)} processes={processes}")
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


def measure(name, run, job, steps, what) -> None:
    print(f"== {name}")
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    walls, step_times = [], []
    last = time.perf_counter()
    for episode in run(job):
        now = time.perf_counter()
        checker.check(episode)
        walls.append(now - last)
        last = now
        step_times.append(episode.metrics.get("step_time", float("nan")))
        print(f"step {episode.episode:3d}  reward {episode.reward:+.3f}  "
              f"step_time {step_times[-1] * 1000:8.1f} ms  wall {walls[-1] * 1000:8.1f} ms")
    checker.finish()
    steady = step_times[1:] or step_times
    print(f"RESULT mode={name.replace(' ', '_')} {what} steps={steps} "
          f"median_step_time_ms={statistics.median(steady) * 1000:.1f} "
          f"median_wall_ms={statistics.median(walls[1:] or walls) * 1000:.1f} "
          f"first_step_wall_ms={walls[0] * 1000:.1f}")


# DataLoader workers start from a fork server and re-import this file: guard the entry point.
if __name__ == "__main__":
    main()
PYEOF
"$PY" "$RUNNER" "$STEPS"
