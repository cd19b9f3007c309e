"""Benchmark: what running a GRPO job in processes of its own costs, side by side.

``python bench/grpo_process.py`` builds the offline tiny VLM and a demo dataset into a temp dir
and runs the same GRPO task (same seed, model, data and per-process settings) four ways:

- **in-thread**: the provider's generator in this process (``provider.run``), as the trainer
  ran GRPO before jobs had processes of their own; the training stack is imported first, as
  it was in a trainer that had run a GRPO job before;
- **child process**: the trainer's provider (``process.run``): one rank process, driven one
  optimizer step per pull over the local channel;
- **2 processes, same per-process batch**: two ranks under gloo, each with the batch above
  (twice the completions per step);
- **2 processes, same total batch**: two ranks, each with half the batch (the same
  completions per step as one process).

For each it prints the start-up time (from asking for the first episode until it arrives, less
the median step: loading, for the child also the interpreter and the imports) and the median and
90th-percentile step time (wall time between consecutive episodes, first step excluded; the
consumer asks for the next episode at once). The process boundary's cost per step is the child's
median step less the in-thread one. Everything runs on the CPU with one torch thread per process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process
from trainer_service.tools import make_demo_dataset, make_tiny_vlm
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2


def _task(args: argparse.Namespace, processes: int, batch: int) -> episode_pb2.TrainTask:
    return episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="model",
            dataset_path="data/train.jsonl",
            reward_functions=["exact_match", "format", "length"],
            num_generations=args.generations,
            batch_size=batch,
            max_completion_length=16,
            dataloader_num_workers=args.workers,
            num_processes=processes,
        )
    )


def _measure(
    run: Callable[[TrainJob], Iterator[episode_pb2.Episode]], job: TrainJob
) -> tuple[float, list[float]]:
    """(seconds to the first episode, seconds between consecutive episodes)."""
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    start = time.perf_counter()
    stamps = []
    for episode in run(job):
        stamps.append(time.perf_counter())
        checker.check(episode)
    checker.finish()
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step per process")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
    args = parser.parse_args()
    batch = args.prompts * args.generations
    if args.prompts % 2:
        parser.error("--prompts must be even (two processes split the total batch)")
    with tempfile.TemporaryDirectory(prefix="grpo-process-bench-") as tmp:
        root = pathlib.Path(tmp)
        make_tiny_vlm.build(root / "model")
        make_demo_dataset.build(root / "data", rows=64)

        def job(processes: int, per_process_batch: int) -> TrainJob:
            return TrainJob(
                run_id=f"bench-{processes}-{per_process_batch}",
                task=_task(args, processes, per_process_batch),
                config=episode_pb2.TrainConfig(max_episodes=args.steps, seed=3),
                device="cpu",
                data_root=root,
                image_cache_dir=None,
                stop_event=threading.Event(),
            )

        from trainer_service.providers.grpo import provider  # the stack, once, as a warm trainer

        cases = [
            ("in-thread", provider.run, job(1, batch)),
            ("child process", process.run, job(1, batch)),
            ("2 processes, same per-process batch", process.run, job(2, batch)),
            ("2 processes, same total batch", process.run, job(2, batch // 2)),
        ]
        rows = []
        for name, run, case in cases:
            first, steps = _measure(run, case)
            median = statistics.median(steps)
            p90 = statistics.quantiles(steps, n=10)[-1] if len(steps) >= 2 else median
            rows.append((name, first - median, median, p90, case))
    print(
        f"GRPO, tiny VLM on CPU, {args.steps} steps, {args.generations} completions per prompt, "
        f"{args.workers} DataLoader workers per process, 1 torch thread per process"
    )
    print(f"{'':38} {'start-up':>9} {'step p50':>9} {'step p90':>9}  completions/step")
    for name, startup, median, p90, case in rows:
        per_step = case.task.grpo.batch_size * max(1, case.task.grpo.num_processes)
        print(
            f"{name:38} {startup:8.2f}s {median * 1000:7.1f}ms {p90 * 1000:7.1f}ms  {per_step:>6}"
        )
    in_thread, child = rows[0][2], rows[1][2]
    print(
        f"process boundary: {(child - in_thread) * 1000:+.1f} ms per step "
        f"({(child / in_thread - 1) * 100:+.1f} %); start-up {rows[1][1] - rows[0][1]:+.2f} s"
    )


if __name__ == "__main__":
    main()
