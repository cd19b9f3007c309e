"""The curve's aggregates (``gateway.core.curve``) against brute force: every bucket of every
range is what a full scan of the episodes gives, and a builder restored from the store at any
episode goes on exactly like one that never stopped."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Sequence

import pytest

from gateway.core.curve import (
    BASE,
    CurveBlock,
    CurveBuilder,
    choose_level,
    plan,
    read_curve,
    restore_builder,
)
from trainwire.v1 import episode_pb2


class Stored:
    """Episodes and their blocks as a store keeps them."""

    def __init__(self, count: int, seed: int = 3) -> None:
        rng = random.Random(seed)
        self.episodes: list[episode_pb2.Episode] = []
        self.blocks: dict[tuple[int, int], CurveBlock] = {}
        self.builder = CurveBuilder()
        best = -math.inf
        for n in range(1, count + 1):
            reward = rng.random() + n / count
            best = max(best, reward)
            metrics = {"loss": rng.random()} if n % 3 else {"loss": 1.0, "kl": n * 0.5}
            self.add(
                episode_pb2.Episode(episode=n, reward=reward, best_reward=best, metrics=metrics)
            )
        self.reads: list[tuple[int, int, int]] = []

    def add(self, episode: episode_pb2.Episode) -> None:
        self.episodes.append(episode)
        for block in self.builder.add(
            episode.episode, episode.reward, episode.best_reward, episode.metrics
        ):
            self.blocks[(block.level, block.index)] = block

    async def read_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        self.reads.extend(spans)
        return [
            self.blocks[(level, i)]
            for level, lo, hi in spans
            for i in range(lo, hi + 1)
            if (level, i) in self.blocks
        ]

    async def read_episodes(self, run_id: str, first: int, last: int) -> list[bytes]:
        self.reads.append((0, first - 1, last - 1))
        return [e.SerializeToString() for e in self.episodes[first - 1 : last]]

    def curve(self, first: int, last: int, buckets: int, metrics: Sequence[str] = ()):
        return asyncio.run(
            read_curve("r", first, last, buckets, metrics, self.read_blocks, self.read_episodes)
        )


def brute(episodes: Sequence[episode_pb2.Episode], name: str) -> dict[str, float]:
    values = [e.metrics[name] for e in episodes if name in e.metrics]
    return {name: sum(values) / len(values)} if values else {}


@pytest.fixture(scope="module")
def stored() -> Stored:
    return Stored(5000)


@pytest.mark.parametrize(
    ("first", "last", "buckets"),
    [
        (1, 5000, 500),
        (1, 5000, 7),
        (1, 5000, 10_000),
        (17, 4093, 100),
        (2, 3, 5),
        (1, 1, 1),
        (1000, 1063, 1),
        (333, 4999, 333),
    ],
)
def test_buckets_are_exact_and_cover_the_range_once(
    stored: Stored, first: int, last: int, buckets: int
) -> None:
    got = stored.curve(first, last, buckets, ["loss", "kl", "nope"])
    assert 1 <= len(got) <= min(buckets, last - first + 1)
    assert got[0].first == first and got[-1].last == last
    for a, b in itertools.pairwise(got):
        assert b.first == a.last + 1
    for bucket in got:
        eps = stored.episodes[bucket.first - 1 : bucket.last]
        rewards = [e.reward for e in eps]
        assert bucket.reward_min == min(rewards)
        assert bucket.reward_max == max(rewards)
        assert bucket.reward_mean == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)
        assert bucket.best_reward == eps[-1].best_reward
        want = {**brute(eps, "loss"), **brute(eps, "kl")}
        assert bucket.metrics_mean == pytest.approx(want, rel=1e-12)


def test_widths_are_even_enough(stored: Stored) -> None:
    got = stored.curve(1, 5000, 100)
    widths = [b.last - b.first + 1 for b in got]
    assert len(got) == 100
    assert max(widths) <= 2 * 5000 / 100 and min(widths) >= 5000 / 100 / 2


def test_reads_do_not_grow_with_the_range() -> None:
    big = Stored(BASE**8 + 123, seed=5)  # 65,659 episodes
    for last in (5000, BASE**8 + 123):
        big.reads.clear()
        big.curve(1, last, 50)
        read = sum(hi - lo + 1 for _, lo, hi in big.reads)
        # at most 4 x buckets units of the chosen level, plus 3 per level at each edge
        assert read <= 4 * 50 + 2 * 3 * 9, (last, read)


def test_levels_and_plans() -> None:
    assert choose_level(5000, 5000) == 0
    assert choose_level(5000, 500) == 1  # 10 wide: blocks of 4
    assert choose_level(10_000_000, 500) == 7  # 20,000 wide: blocks of 16,384
    assert plan(1, 16, 2) == [(2, 0)]
    assert plan(2, 17, 2) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (0, 16)]


@pytest.mark.parametrize("stop_at", [1, 3, 4, 5, 63, 64, 65, 1023, 1024, 4097])
def test_a_restored_builder_goes_on_like_one_that_never_stopped(stop_at: int) -> None:
    whole = Stored(4200, seed=9)
    part = Stored(0)
    part.episodes = whole.episodes[:stop_at]
    part.blocks = {
        k: b for k, b in whole.blocks.items() if (b.index + 1) * BASE**b.level <= stop_at
    }
    part.builder = asyncio.run(restore_builder("r", stop_at, part.read_blocks, part.read_episodes))
    for episode in whole.episodes[stop_at:]:
        part.add(episode)
    assert part.blocks == whole.blocks


def test_a_builder_refuses_a_gap() -> None:
    builder = CurveBuilder()
    builder.add(1, 0.5, 0.5, {})
    with pytest.raises(ValueError, match="episode 3 after 1"):
        builder.add(3, 0.5, 0.5, {})
