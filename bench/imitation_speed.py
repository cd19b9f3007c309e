"""Episodes per second of the imitation provider on one CPU thread, beside the code before.

Measures the provider end to end (``imitation.run``: the optimizer step, the metrics and the
``Episode`` messages with a 60 x 11 motion every 10th episode) and the bare learner step, for the
default group of 16 on every built-in clip and for larger groups. The goal is >= 1500
episodes/s on one CPU thread at group 16 (wave); the table's figures are CPU-time rates.

"Before" is the provider as it was at ``--before`` (a git revision; default the last one before
the batched step), loaded from git into this process and measured in the same run, alternating
with the current one, so both see the same machine. Rates are per second of this process's CPU
time (``time.process_time``), which for a one-thread job on an idle machine is its wall-clock
time; on a shared machine (where the CPU is handed around) wall-clock rates measure the
neighbours, so the headline's wall-clock figure comes with the load average. Each figure is the
median of ``--repeats`` measurements. Where CUDA is available it
also runs large groups on the GPU (wall-clock rates). Run:
`.venv/bin/python bench/imitation_speed.py`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer_service.core.provider import TrainJob
from trainer_service.providers import imitation
from trainwire import motion
from trainwire.v1 import episode_pb2

GOAL_CPU_EPS = 1500.0
#: The last revision of the provider before its step was batched without autograd.
BEFORE_REV = "9d9e36bb291ee9191a321680f909d102fd7b67e2"
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MODULE = "trainer_service/providers/imitation.py"


def load_before(rev: str) -> types.ModuleType:
    """The imitation provider module as it was at ``rev`` (it imports today's core)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{_MODULE}"], cwd=_ROOT, capture_output=True, text=True, check=True
    ).stdout
    name = "trainer_service.providers._imitation_before"
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "imitation_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return module


class Rate(NamedTuple):
    """Episodes (or steps) per second of CPU time and of wall-clock time."""

    cpu: float
    wall: float


def _timed(work: Callable[[], int]) -> Rate:
    cpu, wall = time.process_time(), time.perf_counter()
    count = work()
    return Rate(count / (time.process_time() - cpu), count / (time.perf_counter() - wall))


def provider_rate(
    provider: types.ModuleType, clip: str, group: int, device: str, episodes: int
) -> Rate:
    """Episodes/s of ``provider.run`` over ``episodes`` episodes (after a short warm-up)."""

    def job(n: int) -> TrainJob:
        return TrainJob(
            run_id="bench",
            task=episode_pb2.TrainTask(
                imitation=episode_pb2.ImitationTask(
                    rig_name="stickman", clip_name=clip, group_size=group
                )
            ),
            config=episode_pb2.TrainConfig(max_episodes=n, seed=0),
            device=device,
            data_root=pathlib.Path("."),
            image_cache_dir=None,
            stop_event=threading.Event(),
            set_phase=lambda phase: None,
        )

    for _ in provider.run(job(20)):
        pass
    return _timed(lambda: sum(1 for _ in provider.run(job(episodes))))


def step_rate(
    provider: types.ModuleType, clip: str, group: int, device: str, episodes: int
) -> Rate:
    """Steps/s of the bare learner (no messages)."""
    learner = provider.ImitationLearner(
        motion.STICKMAN, motion.builtin_clip(clip), group_size=group, device=device
    )
    for _ in range(20):
        learner.step()

    def steps() -> int:
        for _ in range(episodes):
            learner.step()
        return episodes

    return _timed(steps)


def medians(measures: dict[str, Callable[[], Rate]], repeats: int) -> dict[str, Rate]:
    """The medians of ``repeats`` rounds of every measure, the measures interleaved per round."""
    samples: dict[str, list[Rate]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {
        name: Rate(
            statistics.median(r.cpu for r in rates), statistics.median(r.wall for r in rates)
        )
        for name, rates in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=1000, help="episodes per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure")
    parser.add_argument("--before", default=BEFORE_REV, help="git revision of the 'before'")
    args = parser.parse_args()
    torch.set_num_threads(1)
    providers = {"now": imitation}
    try:
        providers["before"] = load_before(args.before)
    except (OSError, subprocess.CalledProcessError, ImportError, AttributeError) as exc:
        print(f"(before: cannot load {_MODULE} at {args.before}: {exc}; its column is empty)")
    print(f"torch {torch.__version__}; before = {args.before[:12]}; medians of {args.repeats}")

    cases = (("wave", 16), ("walk", 16), ("jump", 16), ("wave", 64), ("wave", 1024))
    rows = []
    for clip, group in cases:
        n = args.episodes if group <= 64 else max(50, args.episodes // 10)
        measures: dict[str, Callable[[], Rate]] = {}
        for label, module in providers.items():
            measures[f"{label} run"] = functools.partial(
                provider_rate, module, clip, group, "cpu", n
            )
            measures[f"{label} step"] = functools.partial(step_rate, module, clip, group, "cpu", n)
        rows.append((clip, group, medians(measures, args.repeats)))

    print(
        f"{'clip':<6} {'group':>5} {'episodes/s':>10} {'before':>7} {'ratio':>6}"
        f" {'steps/s':>8} {'before':>7} {'ratio':>6}"
    )
    for clip, group, rate in rows:
        cells = [f"{clip:<6} {group:>5}"]
        for kind, width in (("run", 10), ("step", 8)):
            current = rate[f"now {kind}"].cpu
            previous = rate.get(f"before {kind}", Rate(0, 0)).cpu
            cells.append(f"{current:>{width}.0f}")
            cells.append(
                f"{previous:>7.0f} {current / previous:>5.2f}x" if previous else f"{'-':>7} {'':>6}"
            )
        print(" ".join(cells))

    clip, group, rate = rows[0]
    now, before = rate["now run"], rate.get("before run", Rate(0, 0))
    verdict = "reached" if now.cpu >= GOAL_CPU_EPS else "NOT reached"
    was = f"; before {before.cpu:.0f} episodes/s, {now.cpu / before.cpu:.2f}x" if before.cpu else ""
    print(
        f"imitation, 1 thread, group {group}: {now.cpu:.0f} episodes/s "
        f"(goal >= {GOAL_CPU_EPS:.0f}: {verdict}{was})"
    )
    was = f", before {before.wall:.0f}" if before.wall else ""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"  wall clock: {now.wall:.0f} episodes/s{was} (load average {load})")

    if torch.cuda.is_available():
        name = f"cuda:0 {torch.cuda.get_device_name(0)}"
        for group in (1024, 16384):
            n = max(200, args.episodes // 2)
            run = provider_rate(imitation, "wave", group, "cuda:0", n).wall
            steps = step_rate(imitation, "wave", group, "cuda:0", n).wall
            print(f"wave, {name}, group {group}: {run:.0f} episodes/s, {steps:.0f} steps/s")
    else:
        print("(no CUDA device: GPU rows skipped)")


if __name__ == "__main__":
    main()
