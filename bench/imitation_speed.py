"""Episodes per second of the imitation provider: one CPU thread, and a large group on CUDA.

Measures the provider end to end (``imitation.run``: the optimizer step, the metrics and the
``Episode`` messages with a 60 x 11 motion every 10th episode) and the bare learner step, for
stickman/wave with the default group of 16 (target: >= 300 episodes/s on one CPU thread) and
larger groups. Where CUDA is available it runs large groups on the GPU too and prints the ratio
to the same group on one CPU thread. Run: `.venv/bin/python bench/imitation_speed.py`.
"""

from __future__ import annotations

import argparse
import pathlib
import threading
import time

import torch

from trainer_service.core.provider import TrainJob
from trainer_service.providers import imitation
from trainwire import motion
from trainwire.v1 import episode_pb2

TARGET_CPU_EPS = 300.0


def provider_rate(clip: str, group: int, device: str, episodes: int) -> float:
    """Episodes/s of ``imitation.run`` for ``episodes`` episodes (after a short warm-up)."""

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

    for _ in imitation.run(job(20)):
        pass
    start = time.perf_counter()
    count = sum(1 for _ in imitation.run(job(episodes)))
    return count / (time.perf_counter() - start)


def step_rate(clip: str, group: int, device: str, episodes: int) -> float:
    """Steps/s of the bare learner (no messages)."""
    learner = imitation.ImitationLearner(
        motion.STICKMAN, motion.builtin_clip(clip), group_size=group, device=device
    )
    for _ in range(20):
        learner.step()
    start = time.perf_counter()
    for _ in range(episodes):
        learner.step()
    return episodes / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=1000, help="episodes per measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[tuple[str, str, int, float, float, str]] = []
    cpu_rates: dict[tuple[str, int], float] = {}
    for clip, group in (("wave", 16), ("walk", 16), ("jump", 16), ("wave", 64), ("wave", 1024)):
        n = args.episodes if group <= 64 else max(50, args.episodes // 10)
        rate = provider_rate(clip, group, "cpu", n)
        cpu_rates[(clip, group)] = rate
        note = f"{rate / TARGET_CPU_EPS:.2f}x target" if group == 16 else ""
        rows.append((clip, "cpu (1 thread)", group, rate, step_rate(clip, group, "cpu", n), note))
    if torch.cuda.is_available():
        name = f"cuda:0 {torch.cuda.get_device_name(0)}"
        for group in (1024, 16384):
            n = max(200, args.episodes // 2)
            rate = provider_rate("wave", group, "cuda:0", n)
            cpu = cpu_rates.get(("wave", group))
            note = f"{rate / cpu:.1f}x cpu" if cpu else ""
            rows.append(("wave", name, group, rate, step_rate("wave", group, "cuda:0", n), note))
    else:
        print("(no CUDA device: GPU rows skipped)")
    print(f"torch {torch.__version__}, target >= {TARGET_CPU_EPS:.0f} episodes/s (wave, group 16)")
    print(f"{'clip':<6} {'device':<26} {'group':>6} {'episodes/s':>11} {'steps/s':>9}  note")
    for clip, device, group, rate, steps, note in rows:
        print(f"{clip:<6} {device:<26} {group:>6} {rate:>11.0f} {steps:>9.0f}  {note}")


if __name__ == "__main__":
    main()
