"""Benchmark: what running a GRPO job in processes of its own costs, side by side.

``python bench/grpo_process.py`` builds the offline tiny VLM and a demo dataset into a temp dir
and runs the same GRPO task (same seed, model, data and per-process settings) four ways:

- **this process**: TRL training the task right here (``build.build_trainer(...).train()``),
  with no channel and no episodes, a callback noting when each step's log arrives: the
  baseline; the training stack is imported first, as in a process that has trained before;
- **child process**: the trainer's provider (``process.run``): one rank process, driven one
  optimizer step per pull over the local channel; twice: the trainer's first job (the rank
  launcher starts and imports the training stack) and the next one (the rank forks from it);
- **2 processes, same per-process batch**: two ranks under gloo, each with the batch above
  (twice the completions per step);
- **2 processes, same total batch**: two ranks, each with half the batch (the same
  completions per step as one process);
- **2 trainers, same total batch**: the same two ranks, one on each of two trainer processes
  (``python -m trainer_service``, one slot each), placed as the gateway places a job that fits
  in no single trainer: rank 0's trainer hosts the rendezvous and relays every step to the
  other's rank through it (``bench/_two_trainers.py``; gloo over loopback). Its start-up counts
  from the first ``Train`` call (the trainers are up before it, as services are).

For each it prints the start-up time (from the start until the first step is done, less the
median step: loading, for the child also the interpreter and the imports) and the median and
90th-percentile step time (wall time between consecutive steps, first step excluded; the
consumer asks for the next episode at once). The process boundary's cost per step is the child's
median step less this process's. Everything runs on the CPU with one torch thread per process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import _offline  # noqa: F401  (first: offline libraries, the repository importable)

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from bench._two_trainers import across_trainers
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


def _child_processes(job: TrainJob) -> list[float]:
    """When each episode of the trainer's provider (``process.run``) arrived."""
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    stamps = []
    for episode in process.run(job):
        stamps.append(time.perf_counter())
        checker.check(episode)
    checker.finish()
    return stamps


def _this_process(job: TrainJob) -> list[float]:
    """When each optimizer step's log arrived, with TRL training ``job`` in this process."""
    from transformers import TrainerCallback

    from trainer_service.providers.grpo.build import build_trainer
    from trainer_service.providers.grpo.callback import is_step_log

    stamps: list[float] = []

    class Stamp(TrainerCallback):  # type: ignore[misc]
        last_step = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
            if is_step_log(logs, state.global_step, self.last_step):
                self.last_step = state.global_step
                stamps.append(time.perf_counter())
            return control

    with tempfile.TemporaryDirectory(prefix="grpo-process-bench-run-") as scratch:
        build_trainer(job, [Stamp()], output_dir=scratch).train()
    return stamps


def _measure(run: Callable[[TrainJob], list[float]], job: TrainJob) -> tuple[float, list[float]]:
    """(seconds to the first step, seconds between consecutive steps)."""
    start = time.perf_counter()
    stamps = run(job)
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]


def _row(
    name: str, first: float, steps: list[float], case: TrainJob
) -> tuple[str, float, float, float, TrainJob]:
    """(name, start-up less one step, step p50, step p90, job)."""
    median = statistics.median(steps)
    p90 = statistics.quantiles(steps, n=10)[-1] if len(steps) >= 2 else median
    return (name, first - median, median, p90, case)


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

        import torch

        from trainer_service.providers.grpo import build  # noqa: F401  the stack, once

        torch.set_num_threads(1)  # as in a job's process

        cases = [
            ("this process", _this_process, job(1, batch)),
            ("child process, trainer's first job", _child_processes, job(1, batch)),
            ("child process", _child_processes, job(1, batch)),
            ("2 processes, same per-process batch", _child_processes, job(2, batch)),
            ("2 processes, same total batch", _child_processes, job(2, batch // 2)),
        ]
        rows = []
        for name, run, case in cases:
            first, steps = _measure(run, case)
            rows.append(_row(name, first, steps, case))
        across = job(2, batch // 2)
        logs = root / "logs"
        logs.mkdir()
        cpu = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        started, stamps = across_trainers(
            root, across.task, across.config, [("cpu", cpu), ("cpu", cpu)], logs
        )
        steps = [b - a for a, b in itertools.pairwise(stamps)]
        rows.append(_row("2 trainers, same total batch", stamps[0] - started, steps, across))
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
    here, child = rows[0][2], rows[2][2]
    print(
        f"process boundary: {(child - here) * 1000:+.1f} ms per step "
        f"({(child / here - 1) * 100:+.1f} %); start-up {rows[2][1] - rows[0][1]:+.2f} s "
        f"({rows[1][1] - rows[0][1]:+.2f} s for the trainer's first job: its launcher starts)"
    )
    one, two = rows[4], rows[5]
    print(
        f"two trainers vs one: step p50 x{two[2] / one[2]:.2f} "
        f"({(two[2] - one[2]) * 1000:+.1f} ms), start-up {two[1] - one[1]:+.2f} s"
    )


if __name__ == "__main__":
    main()
