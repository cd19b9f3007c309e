"""Cost of trainwire.contract.StreamChecker per episode, beside the cost of serializing it.

Prints microseconds per episode for typical imitation and grpo streams (5 metrics; a 60 x 11
motion every 10th episode; 4 completions on grpo) and the ratio to Episode.SerializeToString,
which every episode pays anyway on the wire. Run: `.venv/bin/python bench/contract_check.py`.
"""

from __future__ import annotations

import time

from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

N = 5000
REPEATS = 5


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


def best_of(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) / N * 1e6


def main() -> None:
    print(f"{'stream':<10} {'check µs/ep':>12} {'serialize µs/ep':>16} {'check/serialize':>16}")
    for kind in ("imitation", "grpo"):
        stream = build_stream(kind)

        def check(stream=stream, kind=kind) -> None:
            checker = StreamChecker(kind, N)
            for ep in stream:
                checker.check(ep)
            checker.finish()

        def serialize(stream=stream) -> None:
            for ep in stream:
                ep.SerializeToString()

        c, s = best_of(check), best_of(serialize)
        print(f"{kind:<10} {c:>12.2f} {s:>16.2f} {c / s:>16.2f}")


if __name__ == "__main__":
    main()
