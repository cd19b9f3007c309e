"""Benchmark: GRPO visibly learns to read images, through the real provider, on a CPU.

``python bench/grpo_learning.py`` builds the offline tiny VLM (random weights) and a four-colour
demo dataset into a temp dir, then for each seed runs the ``grpo`` provider's generator exactly
as the trainer does (``process.run(job)``: the job in a process of its own) with a task that
sets only the model, the dataset, the reward (``exact_match``) and the number of steps, so
every other setting is the provider's default. It prints, per seed:

- the mean ``exact_match`` reward of the first and of the last 10 optimizer steps, and the
  first step at which the trailing 10-step mean reaches 0.9 (``steps-to-0.9``);
- the same run on an **ablation** copy of the dataset whose every image is uniform gray: its
  last-10 mean must stay at or below chance + 0.1 (chance: 1 / number of answers), which proves
  the policy reads pixels rather than a text shortcut;
- the wall time of each run.

Targets (exit status 1 when one is missed): last-10 mean >= 0.9 within ``--steps`` (200)
optimizer steps on every seed; ablation last-10 mean <= chance + 0.1 on every seed.

``--generalise`` adds runs (one seed each, same defaults) on datasets the model was never built
for: other wording (mostly unknown words), other image sizes and colours, and a shape question.
Everything runs on the CPU with one torch thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import _offline  # noqa: F401  (first: offline libraries, the repository importable)
import torch

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process
from trainer_service.providers.grpo.settings import Settings
from trainer_service.tools import make_demo_dataset, make_tiny_vlm
from trainwire.v1 import episode_pb2

MODEL_DIR = "models/tiny-vlm"
TARGET = 0.9
WINDOW = 10
ABLATION_MARGIN = 0.1


@dataclass(frozen=True)
class Curve:
    """The per-step rewards of one run and its wall time."""

    rewards: tuple[float, ...]
    wall_s: float

    def mean(self, start: int, stop: int | None = None) -> float:
        """Mean reward over steps ``start..stop`` (0-based slice)."""
        part = self.rewards[start:stop]
        return sum(part) / len(part) if part else float("nan")

    @property
    def first(self) -> float:
        """Mean of the first WINDOW steps."""
        return self.mean(0, WINDOW)

    @property
    def last(self) -> float:
        """Mean of the last WINDOW steps."""
        return self.mean(-WINDOW)

    def steps_to(self, level: float) -> int | None:
        """First step whose trailing WINDOW-step mean reaches ``level`` (None: never)."""
        for end in range(WINDOW, len(self.rewards) + 1):
            if self.mean(end - WINDOW, end) >= level:
                return end
        return None


def run_curve(root: pathlib.Path, dataset: str, steps: int, seed: int) -> Curve:
    """Trains through ``process.run`` with only model, dataset, reward and steps set."""
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path=MODEL_DIR, dataset_path=dataset, reward_functions=["exact_match"]
        )
    )
    job = TrainJob(
        run_id=f"bench-{seed}",
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=seed),
        device="cpu",
        data_root=root,
        image_cache_dir=None,
        stop_event=threading.Event(),
    )
    start = time.perf_counter()
    rewards = tuple(episode.reward for episode in process.run(job))
    return Curve(rewards, time.perf_counter() - start)


def _fmt_steps(steps: int | None) -> str:
    return "never" if steps is None else str(steps)


def learning(root: pathlib.Path, seeds: Sequence[int], steps: int, rows: int) -> bool:
    """The demo dataset and its gray ablation, per seed; returns whether every target is met."""
    dataset = make_demo_dataset.build(root / "datasets" / "colours", rows=rows)
    gray = make_demo_dataset.write_gray_ablation(dataset)
    answers = make_demo_dataset.DEFAULT_ANSWERS["colour"]
    chance = 1 / len(answers)
    print(
        f"dataset: {rows} rows, answers {', '.join(answers)} (chance {chance:.2f}); "
        f"{steps} steps per run; defaults: {_defaults()}"
    )
    print(
        f"{'seed':>4}  {'first-10':>8}  {'steps-to-0.9':>12}  {'last-10':>7}  "
        f"{'ablation last-10':>16}  {'wall':>7}  {'ablation wall':>13}"
    )
    ok = True
    for seed in seeds:
        curve = run_curve(root, str(dataset.relative_to(root)), steps, seed)
        ablation = run_curve(root, str(gray.relative_to(root)), steps, seed)
        reached = curve.steps_to(TARGET)
        passed = curve.last >= TARGET and ablation.last <= chance + ABLATION_MARGIN
        ok = ok and passed
        print(
            f"{seed:>4}  {curve.first:>8.3f}  {_fmt_steps(reached):>12}  {curve.last:>7.3f}  "
            f"{ablation.last:>16.3f}  {curve.wall_s:>6.1f}s  {ablation.wall_s:>12.1f}s"
            f"  {'ok' if passed else 'MISSED'}"
        )
    print(
        f"targets: last-10 >= {TARGET} within {steps} steps; ablation last-10 <= "
        f"{chance + ABLATION_MARGIN:.2f} (chance + {ABLATION_MARGIN}): "
        f"{'all met' if ok else 'MISSED'}"
    )
    return ok


def generalise(root: pathlib.Path, steps: int, seed: int) -> None:
    """Runs on datasets of the same kind the model was never built for (one seed each)."""
    cases = [
        (
            "other words, 5 other colours, 64x64",
            {
                "kind": "colour",
                "answers": ("orange", "purple", "pink", "white", "black"),
                "question": "Which hue does this thing have? Reply in a single word!",
                "size": (64, 64),
                "rows": 80,
                "seed": 5,
            },
        ),
        (
            "shapes, other words, 40x48",
            {
                "kind": "shape",
                "answers": ("circle", "square", "triangle", "cross"),
                "question": "Tell me the form of the figure.",
                "size": (40, 48),
                "rows": 64,
                "seed": 7,
            },
        ),
    ]
    print(f"\ngeneralisation (seed {seed}, same defaults, {steps} steps)")
    print(f"  {'dataset':<38}{'chance':>7}{'first-10':>10}{'last-10':>9}{'steps-to-0.9':>14}")
    for index, (name, spec) in enumerate(cases):
        path = make_demo_dataset.build(root / "datasets" / f"general-{index}", **spec)  # type: ignore[arg-type]
        curve = run_curve(root, str(path.relative_to(root)), steps, seed)
        chance = 1 / len(spec["answers"])  # type: ignore[arg-type]
        print(
            f"  {name:<38}{chance:>7.2f}{curve.first:>10.3f}{curve.last:>9.3f}"
            f"{_fmt_steps(curve.steps_to(TARGET)):>14}   ({curve.wall_s:.0f} s)"
        )


def _defaults() -> str:
    settings = Settings.from_task(episode_pb2.GrpoTask())
    return (
        f"lr {settings.learning_rate:g}, {settings.num_generations} generations, "
        f"batch {settings.batch_size}, max completion {settings.max_completion_length} tokens, "
        f"temperature {settings.temperature:g}, {settings.num_workers} workers"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--rows", type=int, default=64, help="rows of the demo dataset")
    parser.add_argument(
        "--generalise", action="store_true", help="also train on other kinds of datasets"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer_service.providers.grpo.library_output import route_library_output

    route_library_output()  # no progress bars in the figures
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        root = pathlib.Path(tmp)
        build_s = time.perf_counter()
        make_tiny_vlm.build(root / MODEL_DIR)
        build_s = time.perf_counter() - build_s
        print(f"tiny VLM built in {build_s:.1f} s; cpu: {os.cpu_count()} cores, 1 torch thread")
        ok = learning(root, seeds, args.steps, args.rows)
        if args.generalise:
            generalise(root, args.steps, seeds[0])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
