"""Benchmark: LoRA against full fine-tuning on the offline tiny VLM, through the real provider.

``python bench/grpo_lora.py`` builds the tiny VLM (random weights) and the four-colour demo
dataset into a temp dir, then trains the same task twice with the ``grpo`` provider's generator
as the trainer runs it (``process.run(job)``: the job in a process of its own), every setting at
the provider's default except the reward (``exact_match``) and the steps: once with full
fine-tuning, once with LoRA (``GrpoTask.lora`` set, empty: rank 16, alpha 32, every linear
layer of the language model). Each run writes one checkpoint, at its last step. It prints, side
by side:

- trainable parameters (what the optimizer updates) against all of them;
- the checkpoint's size on disk (model or adapter, processor, optimizer state, RNG states) and
  what of it is the model or adapter;
- the step time (median and 90th percentile of the time between two episodes, the first two
  left out: they include the job's start);
- the mean ``exact_match`` reward of the first and last 10 steps, and the first step at which
  the trailing 10-step mean reaches 0.9.

Target (exit status 1 when missed): LoRA's last-10 mean >= chance + 0.4. ``--lora-rates`` runs
LoRA at several learning rates (how the default was chosen). The tiny LLaVA is built with a
LeCun-normal LM head (``--head-std``, default 0.125, ``make_tiny_vlm --head-std``): with the
library's 0.02 (``--head-std 0``) every logit is capped near +-1.3, so only training the head
itself can make an answer likely and adapters on the language model cannot. Everything runs on
the CPU with one torch thread per process.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

import _offline  # noqa: F401  (first: offline libraries, the repository importable)
import torch

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process
from trainer_service.providers.grpo.settings import Settings
from trainer_service.tools import make_demo_dataset, make_tiny_vlm
from trainwire.v1 import episode_pb2

MODEL_DIR = "models/tiny-vlm"
WINDOW = 10
MARGIN = 0.4


@dataclass
class LastCheckpoint:
    """``Checkpoints`` that writes one checkpoint, at the last step, and keeps its sizes."""

    root: pathlib.Path
    last: int
    every: int = 0
    total_bytes: int = 0
    model_bytes: int = 0
    files: list[str] = field(default_factory=list)

    def due(self, episode: int) -> bool:
        return episode >= self.last

    def final_wanted(self) -> bool:
        return False

    def scratch(self, episode: int) -> pathlib.Path:
        directory = self.root / f"scratch-{episode}"
        directory.mkdir(parents=True)
        return directory

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        files = [p for p in directory.rglob("*") if p.is_file()]
        self.total_bytes = sum(p.stat().st_size for p in files)
        model = [p for p in files if p.parent.name == "model" and "safetensors" in p.name]
        self.model_bytes = sum(p.stat().st_size for p in model)
        self.files = sorted(str(p.relative_to(directory)) for p in files)
        shutil.rmtree(directory)

    def fail(self, episode: int, message: str, directory: pathlib.Path | None = None) -> None:
        raise RuntimeError(f"checkpoint at {episode} failed: {message}")


@dataclass(frozen=True)
class Result:
    """One run's figures."""

    mode: str
    learning_rate: float
    trainable: int
    total: int
    checkpoint: LastCheckpoint
    step_times: tuple[float, ...]
    rewards: tuple[float, ...]
    wall_s: float

    def mean(self, start: int, stop: int | None = None) -> float:
        part = self.rewards[start:stop]
        return sum(part) / len(part) if part else float("nan")

    def steps_to(self, level: float) -> str:
        for end in range(WINDOW, len(self.rewards) + 1):
            if self.mean(end - WINDOW, end) >= level:
                return str(end)
        return "never"


def parameters(root: pathlib.Path, task: episode_pb2.GrpoTask) -> tuple[int, int]:
    """(trainable, total) parameters of the model a job of ``task`` trains."""
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText

    from trainer_service.providers.grpo import lora

    model = AutoModelForImageTextToText.from_pretrained(root / MODEL_DIR, local_files_only=True)
    settings = Settings.from_task(task)
    if settings.lora is not None:
        model = get_peft_model(model, lora.lora_config(settings.lora, model))
    return lora.trainable_parameters(model)


def train(
    root: pathlib.Path, dataset: str, steps: int, seed: int, rate: float | None, lora: bool
) -> Result:
    """One run through ``process.run``; ``rate`` None: the provider's default learning rate."""
    grpo = episode_pb2.GrpoTask(
        model_path=MODEL_DIR, dataset_path=dataset, reward_functions=["exact_match"]
    )
    if lora:
        grpo.lora.SetInParent()
    if rate is not None:
        grpo.learning_rate = rate
    checkpoints = LastCheckpoint(root / f"checkpoints-{'lora' if lora else 'full'}-{rate}", steps)
    job = TrainJob(
        run_id=f"bench-{'lora' if lora else 'full'}",
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=seed),
        device="cpu",
        data_root=root,
        image_cache_dir=None,
        stop_event=threading.Event(),
        checkpoints=checkpoints,
    )
    trainable, total = parameters(root, grpo)
    started = previous = time.perf_counter()
    rewards, gaps = [], []
    for episode in process.run(job):
        now = time.perf_counter()
        gaps.append(now - previous)
        previous = now
        rewards.append(episode.reward)
    return Result(
        mode="lora" if lora else "full",
        learning_rate=Settings.from_task(grpo).learning_rate,
        trainable=trainable,
        total=total,
        checkpoint=checkpoints,
        step_times=tuple(gaps[2:]),
        rewards=tuple(rewards),
        wall_s=time.perf_counter() - started,
    )


def _size(count: int) -> str:
    return f"{count / 1e6:.2f} MB" if count >= 1e5 else f"{count / 1e3:.0f} kB"


def report(results: list[Result], chance: float) -> None:
    print(
        f"{'mode':<5} {'lr':>6} {'trainable':>10} {'of':>9} {'checkpoint':>11} "
        f"{'(weights)':>10} {'step p50':>9} {'p90':>7} {'first-10':>9} {'last-10':>8} "
        f"{'to-0.9':>7} {'wall':>7}"
    )
    for r in results:
        times = sorted(r.step_times)
        p50 = statistics.median(times)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        print(
            f"{r.mode:<5} {r.learning_rate:>6g} {r.trainable:>10,} {r.total:>9,} "
            f"{_size(r.checkpoint.total_bytes):>11} {_size(r.checkpoint.model_bytes):>10} "
            f"{p50 * 1000:>7.0f}ms {p90 * 1000:>5.0f}ms {r.mean(0, WINDOW):>9.3f} "
            f"{r.mean(-WINDOW):>8.3f} {r.steps_to(0.9):>7} {r.wall_s:>6.0f}s"
        )
    full = next((r for r in results if r.mode == "full"), None)
    for r in results:
        if r.mode == "lora" and full is not None:
            size = r.checkpoint.total_bytes / full.checkpoint.total_bytes
            step = statistics.median(r.step_times) / statistics.median(full.step_times)
            print(
                f"lora at lr {r.learning_rate:g}: {r.trainable / full.trainable:.1%} of the "
                f"trainable parameters, checkpoint {size:.1%} of full fine-tuning's; step "
                f"time x{step:.2f}"
            )
    print(f"chance {chance:.2f}; target: LoRA last-10 >= {chance + MARGIN:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=64, help="rows of the demo dataset")
    parser.add_argument(
        "--lora-rates",
        default="",
        help="comma-separated LoRA learning rates to run (default: the provider's default)",
    )
    parser.add_argument("--no-full", action="store_true", help="skip the full fine-tuning run")
    parser.add_argument(
        "--head-std",
        type=float,
        default=make_tiny_vlm.LORA_HEAD_STD,
        help="build the tiny LLaVA with this LM head std (make_tiny_vlm --head-std; 0: the "
        f"library's 0.02; {make_tiny_vlm.LORA_HEAD_STD:g} lets LoRA learn, the default)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer_service.providers.grpo.library_output import route_library_output

    route_library_output()
    rates: list[float | None] = [float(r) for r in args.lora_rates.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-grpo-lora-") as tmp:
        root = pathlib.Path(tmp)
        make_tiny_vlm.build(root / MODEL_DIR, head_std=args.head_std or None)
        dataset = make_demo_dataset.build(root / "datasets" / "colours", rows=args.rows)
        relative = str(dataset.relative_to(root))
        chance = 1 / len(make_demo_dataset.DEFAULT_ANSWERS["colour"])
        head = f"LM head std {args.head_std:g}" if args.head_std else "LM head as built"
        print(
            f"tiny VLM ({head}), {args.rows}-row colour dataset, {args.steps} steps, seed "
            f"{args.seed}; "
            f"cpu: {os.cpu_count()} cores, 1 torch thread per process"
        )
        results = []
        if not args.no_full:
            results.append(train(root, relative, args.steps, args.seed, None, lora=False))
        for rate in rates or [None]:
            results.append(train(root, relative, args.steps, args.seed, rate, lora=True))
        report(results, chance)
        lora_files = next(r for r in results if r.mode == "lora").checkpoint.files
        print("a LoRA checkpoint: " + ", ".join(lora_files))
    loras = [r for r in results if r.mode == "lora"]
    return 0 if all(r.mean(-WINDOW) >= chance + MARGIN for r in loras) else 1


if __name__ == "__main__":
    sys.exit(main())
