"""Benchmark: GRPO visibly learns to read images, through the real provider, on a CPU, for each
tiny VLM architecture and for LoRA against full fine-tuning.

``python bench/grpo_learning.py`` builds the offline tiny VLM of each architecture (``--arch``,
default ``llava,qwen2_vl,smolvlm``: LLaVA, Qwen2.5-VL and SmolVLM/Idefics3, random weights) and
a four-colour demo dataset into a temp dir, then for each model and seed runs the ``grpo``
provider's generator exactly as the trainer does (``process.run(job)``: the job in a process of
its own) with a task that sets only the model, the dataset, the reward (``exact_match``) and the
number of steps, so every other setting is the provider's default. Besides full fine-tuning of
each architecture it trains LoRA adapters (``--lora-rank``, default 16; 0 leaves the rows out;
the provider's LoRA defaults apply: learning rate 1e-2, beta 0.04) on the tiny LLaVA built with
a LeCun-normal LM head (``make_tiny_vlm --head-std``: the library's 0.02 caps every logit near
+-1.3, which only training the head can overcome), beside full fine-tuning of that same model.
It prints, per model and seed:

- the mean ``exact_match`` reward of the first and of the last 10 optimizer steps, and the
  first step at which the trailing 10-step mean reaches 0.8 and 0.9 (``steps-to-0.8``,
  ``steps-to-0.9``);
- the same run on an **ablation** copy of the dataset whose every image is uniform gray: its
  last-10 mean must stay at or below chance + 0.1 (chance: 1 / number of answers), which proves
  the policy reads pixels rather than a text shortcut (``--no-ablation`` skips these runs);
- the wall time of each run;

then one summary line per model: its steps-to-0.8 on every seed and their median.

Targets (exit status 1 when one is missed): last-10 mean >= 0.9 within ``--steps`` (200)
optimizer steps on every model and seed (LoRA on the LeCun-head model: chance + 0.4; full
fine-tuning of that model is there to compare, with no target); ablation
last-10 mean <= chance + 0.1 on every one.

``--generalise`` adds runs (the first architecture, one seed each, same defaults) on datasets
the model was never built for: other wording (mostly unknown words), other image sizes and
colours, and a shape question. Everything runs on the CPU with one torch thread.
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

TARGET = 0.9
#: The level whose steps-to the summary compares across models.
COMPARED = 0.8
WINDOW = 10
ABLATION_MARGIN = 0.1
DEFAULT_LORA_RANK = 16
LORA_MARGIN = 0.4


@dataclass(frozen=True)
class Model:
    """One model the bench trains: an architecture, fully or through LoRA adapters."""

    arch: str
    lora_rank: int = 0
    #: The LM head's std the tiny model is built with (None: the library's 0.02).
    head_std: float | None = None

    @property
    def name(self) -> str:
        name = f"{self.arch} lecun-head" if self.head_std else self.arch
        return f"{name} + LoRA r{self.lora_rank}" if self.lora_rank else name

    @property
    def path(self) -> str:
        """The model directory, relative to the data root."""
        suffix = f"-head-{self.head_std}" if self.head_std else ""
        return f"models/{self.arch}{suffix}"

    def target(self, chance: float) -> float | None:
        """The last-10 mean this model must reach: :data:`TARGET` for the library-head models,
        chance + :data:`LORA_MARGIN` (the issue's bar) for LoRA; None for full fine-tuning of
        the LeCun-head model, which is there to compare (it collapses on some seeds)."""
        if not self.head_std:
            return TARGET
        return chance + LORA_MARGIN if self.lora_rank else None


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


def task_for(model: Model, dataset: str) -> episode_pb2.TrainTask:
    """Only model, dataset and reward set (and the LoRA rank for a LoRA model).

    Raises:
        SystemExit: A LoRA model, and the provider does not train LoRA adapters.
    """
    grpo = episode_pb2.GrpoTask(
        model_path=model.path, dataset_path=dataset, reward_functions=["exact_match"]
    )
    if model.lora_rank:
        grpo.lora.rank = model.lora_rank
        if getattr(Settings.from_task(grpo), "lora", None) is None:
            raise SystemExit(f"{model.name}: this provider does not train LoRA adapters")
    return episode_pb2.TrainTask(grpo=grpo)


def run_curve(root: pathlib.Path, model: Model, dataset: str, steps: int, seed: int) -> Curve:
    """Trains through ``process.run`` with only model, dataset, reward and steps set."""
    job = TrainJob(
        run_id=f"bench-{model.arch}-{seed}",
        task=task_for(model, dataset),
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


def learning(
    root: pathlib.Path,
    models: Sequence[Model],
    seeds: Sequence[int],
    steps: int,
    rows: int,
    ablation: bool,
) -> bool:
    """The demo dataset and its gray ablation, per model and seed; returns whether every target
    is met."""
    dataset = make_demo_dataset.build(root / "datasets" / "colours", rows=rows)
    gray = make_demo_dataset.write_gray_ablation(dataset)
    answers = make_demo_dataset.DEFAULT_ANSWERS["colour"]
    chance = 1 / len(answers)
    print(
        f"dataset: {rows} rows, answers {', '.join(answers)} (chance {chance:.2f}); "
        f"{steps} steps per run; defaults: {_defaults()}"
    )
    print(
        f"{'model':<28}{'seed':>4}  {'first-10':>8}  {'steps-to-0.8':>12}  {'steps-to-0.9':>12}"
        f"  {'last-10':>7}  {'ablation last-10':>16}  {'wall':>7}  {'ablation wall':>13}"
    )
    ok = True
    reached: dict[str, list[int | None]] = {}
    lasts: dict[str, list[float]] = {}
    for model in models:
        for seed in seeds:
            curve = run_curve(root, model, str(dataset.relative_to(root)), steps, seed)
            target = model.target(chance)
            passed = target is None or curve.last >= target
            gray_last, gray_wall = "-", "-"
            if ablation:
                gray_curve = run_curve(root, model, str(gray.relative_to(root)), steps, seed)
                passed = passed and gray_curve.last <= chance + ABLATION_MARGIN
                gray_last, gray_wall = f"{gray_curve.last:.3f}", f"{gray_curve.wall_s:.1f}s"
            ok = ok and passed
            reached.setdefault(model.name, []).append(curve.steps_to(COMPARED))
            lasts.setdefault(model.name, []).append(curve.last)
            print(
                f"{model.name:<28}{seed:>4}  {curve.first:>8.3f}  "
                f"{_fmt_steps(curve.steps_to(COMPARED)):>12}  "
                f"{_fmt_steps(curve.steps_to(TARGET)):>12}  {curve.last:>7.3f}  "
                f"{gray_last:>16}  {curve.wall_s:>6.1f}s  {gray_wall:>13}"
                f"  {'-' if target is None else 'ok' if passed else 'MISSED'}",
                flush=True,
            )
    print(f"\nsteps-to-{COMPARED} (seeds {', '.join(map(str, seeds))})")
    print(f"  {'model':<28}{'each seed':>18}{'median':>8}{'mean last-10':>14}")
    for name, steps_to in reached.items():
        each = " ".join(_fmt_steps(s) for s in steps_to)
        # "never" counts as more than any step count.
        ordered = sorted(steps_to, key=lambda s: steps + 1 if s is None else s)
        median = ordered[len(ordered) // 2]
        mean_last = sum(lasts[name]) / len(lasts[name])
        print(f"  {name:<28}{each:>18}{_fmt_steps(median):>8}{mean_last:>14.3f}")
    print(
        f"targets: last-10 >= {TARGET} within {steps} steps (lecun-head LoRA: >= "
        f"{chance + LORA_MARGIN:.2f}; lecun-head full fine-tuning: compared, no target)"
        + (
            f"; ablation last-10 <= {chance + ABLATION_MARGIN:.2f} (chance + {ABLATION_MARGIN})"
            if ablation
            else ""
        )
        + f": {'all met' if ok else 'MISSED'}"
    )
    return ok


def generalise(root: pathlib.Path, model: Model, steps: int, seed: int) -> None:
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
    print(f"\ngeneralisation ({model.name}, seed {seed}, same defaults, {steps} steps)")
    print(f"  {'dataset':<38}{'chance':>7}{'first-10':>10}{'last-10':>9}{'steps-to-0.9':>14}")
    for index, (name, spec) in enumerate(cases):
        path = make_demo_dataset.build(root / "datasets" / f"general-{index}", **spec)  # type: ignore[arg-type]
        curve = run_curve(root, model, str(path.relative_to(root)), steps, seed)
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


def _lora_learning_rate(rank: int) -> str:
    lora = episode_pb2.GrpoTask()
    lora.lora.rank = rank
    return f"{Settings.from_task(lora).learning_rate:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        default=",".join(make_tiny_vlm.ARCHS),
        help=f"comma-separated architectures (default {','.join(make_tiny_vlm.ARCHS)})",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=DEFAULT_LORA_RANK,
        help=f"LoRA rank of the LoRA row on the tiny LLaVA (default {DEFAULT_LORA_RANK}; 0: none)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--rows", type=int, default=64, help="rows of the demo dataset")
    parser.add_argument(
        "--no-ablation", action="store_true", help="skip the runs on uniform gray images"
    )
    parser.add_argument(
        "--generalise", action="store_true", help="also train on other kinds of datasets"
    )
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = sorted(set(archs) - set(make_tiny_vlm.ARCHS))
    if unknown or not archs:
        parser.error(f"--arch: choose among {', '.join(make_tiny_vlm.ARCHS)} (got {args.arch!r})")
    models = [Model(arch) for arch in archs]
    if args.lora_rank:
        # LoRA on the LLaVA built with a LeCun head (the library's head caps every logit, so
        # adapters cannot learn), and full fine-tuning of that same model beside it.
        head = make_tiny_vlm.LORA_HEAD_STD
        models.append(Model("llava", head_std=head))
        models.append(Model("llava", lora_rank=args.lora_rank, head_std=head))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from trainer_service.providers.grpo.library_output import route_library_output

    route_library_output()  # no progress bars in the figures
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        root = pathlib.Path(tmp)
        build_s = time.perf_counter()
        for model in {Model(m.arch, head_std=m.head_std) for m in models}:
            make_tiny_vlm.build(root / model.path, arch=model.arch, head_std=model.head_std)
        build_s = time.perf_counter() - build_s
        lora_note = (
            f"; LoRA rank {args.lora_rank} at lr {_lora_learning_rate(args.lora_rank)}"
            if args.lora_rank
            else ""
        )
        print(
            f"tiny VLMs built in {build_s:.1f} s; cpu: {os.cpu_count()} cores, 1 torch thread"
            f"{lora_note}"
        )
        ok = learning(root, models, seeds, args.steps, args.rows, not args.no_ablation)
        if args.generalise:
            generalise(root, models[0], args.steps, seeds[0])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
