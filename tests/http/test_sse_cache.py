"""``EventCache``: every frame's event written once and served by equal bytes, least recently used
out first within its byte budget, and that budget an upper bound on the memory it holds."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator

import pytest

from gateway.core.history import encode_frame
from gateway.http import sse
from tests.fakes.fake_trainer import valid_episodes


def frames_of(count: int, detail_every: int = 10) -> list[bytes]:
    return [encode_frame(e.SerializeToString()) for e in valid_episodes(count, detail_every)]


_episode_event = sse.episode_event  # the real one, whatever a test patches


def cost(frame: bytes) -> int:
    return len(frame) + len(_episode_event(frame)) + sse.ENTRY_OVERHEAD


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """The frames whose events the cache writes (rather than serves)."""
    calls: list[bytes] = []

    def counting(frame: bytes) -> bytes:
        calls.append(frame)
        return _episode_event(frame)

    monkeypatch.setattr(sse, "episode_event", counting)
    yield calls


def test_every_frame_is_written_once_then_served_by_equal_bytes(written: list[bytes]) -> None:
    frames = frames_of(100)  # 90 scalar episodes, 10 with a motion
    expected = b"".join(map(_episode_event, frames))
    cache = sse.EventCache()
    assert cache.events(frames) == expected and written == frames
    assert len(cache) == 100 and cache.size == sum(map(cost, frames))
    written.clear()
    copies = [bytes(bytearray(f)) for f in frames]  # equal bytes, read again from the store
    assert cache.events(copies[:40]) + cache.events(copies[40:]) == expected
    assert written == []


def test_the_least_recently_used_go_first_within_the_budget(written: list[bytes]) -> None:
    small = frames_of(30, detail_every=1000)[:12]  # scalar episodes, alike in size
    budget = 10 * max(map(cost, small))  # room for any 10, never for 11
    assert 11 * min(map(cost, small)) > budget
    cache = sse.EventCache(budget_bytes=budget)
    cache.events(small[:10])
    cache.events(small[:1])  # used again: the second is now the oldest
    written.clear()
    cache.events(small[10:11])
    assert len(cache) == 10 and cache.size <= budget
    assert written == small[10:11]
    written.clear()
    cache.events(small[:1] + small[2:11])  # all kept
    assert written == []
    cache.events(small[1:2])  # evicted: written again
    assert written == small[1:2]


def test_an_event_larger_than_the_budget_is_written_and_not_kept(written: list[bytes]) -> None:
    motion = frames_of(10)[-1]
    cache = sse.EventCache(budget_bytes=cost(motion) - 1)
    for _ in range(2):
        assert cache.events([motion]) == _episode_event(motion)
    assert len(cache) == 0 and cache.size == 0 and written == [motion, motion]


def test_its_size_bounds_the_memory_it_holds() -> None:
    """``size`` (what the budget bounds) is at least the memory the entries take, frames
    included, and not far above it."""
    payloads = [e.SerializeToString() for e in valid_episodes(3000)]
    cache = sse.EventCache()
    cache.events([encode_frame(payloads[0])])  # lazy imports and caches of the encoder
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for lo in range(0, len(payloads), 256):
            # New frame objects, held by nothing but the cache afterwards.
            cache.events([encode_frame(p) for p in payloads[lo : lo + 256]])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) == 3000
    assert held <= cache.size <= 1.3 * held, (held, cache.size)
