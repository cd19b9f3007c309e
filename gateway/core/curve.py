"""A run's reward curve at any scale, from aggregates kept as episodes are committed.

The gateway keeps, for every run, the aggregates of aligned blocks of episodes at several
*levels*: a block of level ``k`` (``k >= 1``) holds ``4**k`` consecutive episodes, block ``j``
covering episodes ``j * 4**k + 1 .. (j + 1) * 4**k``. Level 0 is the episodes themselves. Each
block stores the count, the reward's min, max and sum, the run's best reward at its last
episode, and per metric the sum and the number of episodes that have it. Only *complete*
blocks are stored, and a stored block never changes: ``CurveBuilder`` folds each committed
episode into the open block of every level and hands over the blocks it completes, which the
store writes in the same transaction as the episode. Together the blocks take about a third of
a row per episode.

``read_curve`` answers a curve request in time that does not depend on the run's length: it
picks the level whose blocks are at most as wide as the requested buckets, covers the range
with aligned blocks of that level (the edges with smaller ones, down to single episodes), reads
at most ``4 x buckets`` blocks plus a few dozen at the edges, and merges consecutive ones into
buckets. Every number is exact (min, max, best) or a sum of exact parts (means).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainwire.v1 import episode_pb2

#: Blocks of one level hold this many blocks of the level below.
BASE = 4
#: The highest level: 4**12 = 16.8M episodes, more than a run may have.
MAX_LEVEL = 12
#: Buckets of a curve when a request says none, and the most it may ask for.
DEFAULT_BUCKETS = 500
MAX_BUCKETS = 10_000


def block_span(level: int, index: int) -> tuple[int, int]:
    """The first and last episode of block ``index`` of ``level``."""
    size = BASE**level
    return index * size + 1, (index + 1) * size


@dataclass(slots=True)
class Aggregate:
    """The summary of consecutive episodes (empty: ``count == 0``)."""

    count: int = 0
    reward_min: float = math.inf
    reward_max: float = -math.inf
    reward_sum: float = 0.0
    best_end: float = 0.0
    #: metric -> [sum, episodes that have it]
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, reward: float, best: float, metrics: Mapping[str, float]) -> None:
        """Folds in the next episode."""
        self.count += 1
        if reward < self.reward_min:
            self.reward_min = reward
        if reward > self.reward_max:
            self.reward_max = reward
        self.reward_sum += reward
        self.best_end = best
        mine = self.metrics
        for name in metrics:  # by key: a protobuf map's items() is slower
            entry = mine.get(name)
            if entry is None:
                mine[name] = [metrics[name], 1]
            else:
                entry[0] += metrics[name]
                entry[1] += 1

    def merge(self, later: Aggregate) -> None:
        """Folds in the summary of the episodes that follow these."""
        if not later.count:
            return
        self.count += later.count
        self.reward_min = min(self.reward_min, later.reward_min)
        self.reward_max = max(self.reward_max, later.reward_max)
        self.reward_sum += later.reward_sum
        self.best_end = later.best_end
        mine = self.metrics
        for name, (total, n) in later.metrics.items():
            entry = mine.get(name)
            if entry is None:
                mine[name] = [total, n]
            else:
                entry[0] += total
                entry[1] += n

    def metrics_json(self) -> str:
        """The metric sums as stored ("" when there are none)."""
        return json.dumps(self.metrics, separators=(",", ":")) if self.metrics else ""


@dataclass(frozen=True, slots=True)
class CurveBlock:
    """A stored block: ``index`` of ``level`` (see the module docstring)."""

    level: int
    index: int
    count: int
    reward_min: float
    reward_max: float
    reward_sum: float
    best_end: float
    #: ``Aggregate.metrics_json`` of the block.
    metrics: str

    @staticmethod
    def of(level: int, index: int, agg: Aggregate) -> CurveBlock:
        """The stored form of a complete block."""
        return CurveBlock(
            level,
            index,
            agg.count,
            agg.reward_min,
            agg.reward_max,
            agg.reward_sum,
            agg.best_end,
            agg.metrics_json(),
        )

    def aggregate(self, with_metrics: bool) -> Aggregate:
        """The block as an ``Aggregate`` (its metrics parsed only when asked for)."""
        metrics = json.loads(self.metrics) if with_metrics and self.metrics else {}
        return Aggregate(
            self.count,
            self.reward_min,
            self.reward_max,
            self.reward_sum,
            self.best_end,
            metrics,
        )


def episode_aggregate(data: bytes) -> Aggregate:
    """The aggregate of one stored episode (its bytes, with or without detail)."""
    episode = episode_pb2.Episode.FromString(data)
    agg = Aggregate()
    agg.add(episode.reward, episode.best_reward, episode.metrics)
    return agg


class CurveBuilder:
    """A run's open blocks; turns committed episodes into complete blocks (see the module
    docstring).

    Args:
        last_episode: The last episode already folded in (0 for a new run).
        open_blocks: What each level ``1..MAX_LEVEL`` holds of its open block after
            ``last_episode``: its complete blocks of the level below (level 1: its episodes);
            ``restore_builder`` reads them back from the store.
    """

    __slots__ = ("_open", "last_episode")

    def __init__(self, last_episode: int = 0, open_blocks: Sequence[Aggregate] = ()) -> None:
        self.last_episode = last_episode
        self._open = list(open_blocks) or [Aggregate() for _ in range(MAX_LEVEL)]

    def add(
        self, episode: int, reward: float, best: float, metrics: Mapping[str, float]
    ) -> tuple[CurveBlock, ...]:
        """Folds in the next episode; returns the blocks it completed (lowest level first).

        Raises:
            ValueError: ``episode`` is not the one after the last folded in.
        """
        if episode != self.last_episode + 1:
            raise ValueError(f"episode {episode} after {self.last_episode}")
        self.last_episode = episode
        level1 = self._open[0]
        level1.add(reward, best, metrics)
        if episode % BASE:
            return ()
        done: list[CurveBlock] = []
        size = 1
        for level in range(1, MAX_LEVEL + 1):
            size *= BASE
            if episode % size:
                break
            agg = self._open[level - 1]
            done.append(CurveBlock.of(level, episode // size - 1, agg))
            if level < MAX_LEVEL:
                self._open[level].merge(agg)
            self._open[level - 1] = Aggregate()
        return tuple(done)


#: Reads the stored blocks of ``(level, first_index, last_index)`` spans of a run.
BlockReader = Callable[[str, Sequence[tuple[int, int, int]]], Awaitable[list[CurveBlock]]]
#: Reads the stored bytes of episodes ``first..last`` of a run without their detail.
EpisodeReader = Callable[[str, int, int], Awaitable[list[bytes]]]


async def restore_builder(
    run_id: str,
    last_episode: int,
    blocks: BlockReader,
    episodes: EpisodeReader,
    origin: int = 0,
) -> CurveBuilder:
    """The builder of a run whose episodes ``origin + 1..last_episode`` are stored (``origin``:
    a fork's fork episode, else 0): its open blocks, read back from at most three stored blocks
    per level and three episodes. A fork has no block that ends at or before its fork episode
    (the block around it holds the fork's episodes only)."""
    if last_episode <= origin:
        return CurveBuilder(last_episode)
    first_open = last_episode // BASE * BASE + 1
    below = Aggregate()
    for data in await episodes(run_id, first_open, last_episode):
        below.merge(episode_aggregate(data))
    opened = [below]
    spans = []
    for level in range(2, MAX_LEVEL + 1):
        lo = last_episode // BASE**level * BASE  # first level-1 block of the open level block
        hi = last_episode // BASE ** (level - 1) - 1
        if hi >= lo:
            spans.append((level - 1, lo, hi))
    stored: dict[tuple[int, int], CurveBlock] = {
        (b.level, b.index): b for b in (await blocks(run_id, spans) if spans else [])
    }
    for level in range(2, MAX_LEVEL + 1):
        agg = Aggregate()
        lo = last_episode // BASE**level * BASE
        hi = last_episode // BASE ** (level - 1) - 1
        for index in range(lo, hi + 1):
            block = stored.get((level - 1, index))
            if block is None:
                if block_span(level - 1, index)[1] <= origin:
                    continue  # before the fork: never stored
                raise LookupError(f"run {run_id}: curve block {level - 1}/{index} is missing")
            agg.merge(block.aggregate(True))
        opened.append(agg)
    return CurveBuilder(last_episode, opened)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Episodes ``first..last`` of a run, summarised."""

    first: int
    last: int
    reward_min: float
    reward_max: float
    reward_mean: float
    best_reward: float
    metrics_mean: dict[str, float]


def choose_level(episodes: int, buckets: int) -> int:
    """The highest level whose blocks are no wider than a bucket of ``episodes / buckets``."""
    width = episodes / buckets
    level = 0
    while level < MAX_LEVEL and BASE ** (level + 1) <= width:
        level += 1
    return level


def plan(first: int, last: int, level: int) -> list[tuple[int, int]]:
    """Aligned stored units covering ``first..last`` in order: ``(level, index)``, the widest
    that fit up to ``level`` (level 0: the episode ``index + 1``)."""
    units: list[tuple[int, int]] = []
    p = first
    while p <= last:
        k = level
        while k > 0 and ((p - 1) % BASE**k or p + BASE**k - 1 > last):
            k -= 1
        units.append((k, (p - 1) // BASE**k))
        p += BASE**k
    return units


def _spans(units: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Consecutive units of one level as ``(level, first_index, last_index)`` spans."""
    spans: list[list[int]] = []
    for level, index in units:
        if spans and spans[-1][0] == level and spans[-1][2] == index - 1:
            spans[-1][2] = index
        else:
            spans.append([level, index, index])
    return [(a, b, c) for a, b, c in spans]


async def read_curve(
    run_id: str,
    first: int,
    last: int,
    buckets: int,
    metrics: Sequence[str],
    blocks: BlockReader,
    episodes: EpisodeReader,
) -> list[Bucket]:
    """At most ``buckets`` contiguous buckets covering episodes ``first..last`` exactly once
    (all of them committed), each about ``(last - first + 1) / buckets`` episodes wide."""
    if last < first:
        return []
    n = last - first + 1
    buckets = min(buckets, n)
    level = choose_level(n, buckets)
    units = plan(first, last, level)
    spans = _spans(units)
    with_metrics = bool(metrics)
    found: dict[tuple[int, int], Aggregate] = {}
    block_spans = [s for s in spans if s[0] > 0]
    if block_spans:
        for block in await blocks(run_id, block_spans):
            found[(block.level, block.index)] = block.aggregate(with_metrics)
    for _, lo, hi in (s for s in spans if s[0] == 0):
        datas = await episodes(run_id, lo + 1, hi + 1)
        for i, data in enumerate(datas):
            found[(0, lo + i)] = episode_aggregate(data)
    out: list[Bucket] = []
    current: Aggregate | None = None
    current_first = 0
    current_bucket = -1
    p = first
    for level, index in units:
        agg = found.get((level, index))
        if agg is None:
            raise LookupError(f"run {run_id}: curve unit {level}/{index} is missing")
        bucket = (p - first) * buckets // n
        if bucket != current_bucket:
            if current is not None:
                out.append(_bucket(current_first, p - 1, current, metrics))
            current, current_first, current_bucket = Aggregate(), p, bucket
        assert current is not None
        current.merge(agg)
        p += BASE**level
    if current is not None:
        out.append(_bucket(current_first, last, current, metrics))
    return out


def _bucket(first: int, last: int, agg: Aggregate, metrics: Sequence[str]) -> Bucket:
    means = {}
    for name in metrics:
        entry = agg.metrics.get(name)
        if entry is not None and entry[1]:
            means[name] = entry[0] / entry[1]
    return Bucket(
        first,
        last,
        agg.reward_min,
        agg.reward_max,
        agg.reward_sum / agg.count,
        agg.best_end,
        means,
    )
