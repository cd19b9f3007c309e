"""Cost of trainwire.contract.StreamChecker per episode, beside the cost of serializing it.

Prints microseconds per episode for typical imitation and grpo streams (5 metrics; a 60 x 11
motion every 10th episode; 4 completions on grpo) and the ratio to Episode.SerializeToString,
which every episode pays anyway on the wire, then the imitation figures beside their goals.
Check and serialization alternate chunk by chunk, so a busy machine slows both alike.

Run: `.venv/bin/python bench/contract_check.py`; `--profile` prints where the imitation check
loop spends its time (cProfile, the top functions by own time) instead.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

N = 5000
REPEATS = 16
#: Episodes per timed chunk: 50 of them carry a motion on imitation.
CHUNK = 500
#: Issue 26's goals for an imitation episode: absolute, and relative to serializing it.
GOAL_US = 2.0
GOAL_RATIO = 3.5


def build_stream(kind: str) -> list[episode_pb2.Episode]:
    stream = []
    best = float("-inf")
    for i in range(1, N + 1):
        reward = (i % 97) / 97.0
        best = max(best, reward)
        ep = episode_pb2.Episode(
            episode=i,
            reward=reward,
            best_reward=best,
            done=i == N,
            metrics={
                "loss": 0.1,
                "reward_std": 0.2,
                "greedy_reward": reward,
                "pose_error": 0.3,
                "policy_std": 0.4,
            },
        )
        if kind == "imitation" and (i % 10 == 0 or i == N):
            ep.imitation.CopyFrom(
                episode_pb2.ImitationDetail(frame_count=60, joint_count=11, angles=[0.5] * 660)
            )
        elif kind == "grpo":
            ep.grpo.sample_completions.extend(["<answer>42</answer>" * 10] * 4)
        stream.append(ep)
    return stream


def check_all(stream: list[episode_pb2.Episode], kind: str) -> None:
    checker = StreamChecker(kind, N)
    for ep in stream:
        checker.check(ep)
    checker.finish()


def time_check(stream: list[episode_pb2.Episode], kind: str, start: int) -> float:
    """Seconds to check stream[start : start + CHUNK], resumed after the episodes before it."""
    checker = StreamChecker(kind, N)
    if start:
        checker.resume(start, stream[start - 1].best_reward)
    began = time.perf_counter()
    for ep in stream[start : start + CHUNK]:
        checker.check(ep)
    if start + CHUNK >= len(stream):
        checker.finish()
    return time.perf_counter() - began


def time_serialize(stream: list[episode_pb2.Episode], start: int) -> float:
    """Seconds to serialize stream[start : start + CHUNK]."""
    began = time.perf_counter()
    for ep in stream[start : start + CHUNK]:
        ep.SerializeToString()
    return time.perf_counter() - began


def measure(stream: list[episode_pb2.Episode], kind: str) -> tuple[float, float]:
    """µs per episode for checking and for serializing the stream, best of REPEATS.

    The stream goes in chunks of CHUNK episodes, each checked and serialized a moment apart,
    so a busy machine slows both alike; the order alternates, so each also runs second, on
    episodes the other just brought into the cache. Each chunk's best time counts.
    """
    starts = range(0, len(stream), CHUNK)
    best_check = dict.fromkeys(starts, math.inf)
    best_serialize = dict.fromkeys(starts, math.inf)
    for repeat in range(REPEATS):
        for start in starts:
            if repeat % 2:
                serialized = time_serialize(stream, start)
                checked = time_check(stream, kind, start)
            else:
                checked = time_check(stream, kind, start)
                serialized = time_serialize(stream, start)
            best_check[start] = min(best_check[start], checked)
            best_serialize[start] = min(best_serialize[start], serialized)
    per_episode = 1e6 / len(stream)
    return sum(best_check.values()) * per_episode, sum(best_serialize.values()) * per_episode


def profile() -> None:
    stream = build_stream("imitation")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(REPEATS):
        check_all(stream, "imitation")
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="profile the imitation check")
    if parser.parse_args().profile:
        profile()
        return
    print(f"{'stream':<10} {'check µs/ep':>12} {'serialize µs/ep':>16} {'check/serialize':>16}")
    figures = {}
    for kind in ("imitation", "grpo"):
        figures[kind] = c, s = measure(build_stream(kind), kind)
        print(f"{kind:<10} {c:>12.2f} {s:>16.2f} {c / s:>16.2f}")
    c, s = figures["imitation"]
    print(
        f"check per imitation episode: {c:.2f} us (goal <= {GOAL_US:g} us), "
        f"{c / s:.1f}x serialization (goal <= {GOAL_RATIO:g}x)"
    )


if __name__ == "__main__":
    main()
