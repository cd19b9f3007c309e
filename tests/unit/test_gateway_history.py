"""History: frame encoding, batch splitting, log cursors and wake-ups, the page cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core import live_log
from gateway.core.episode_json import episode_json
from gateway.core.framing import (
    JSON,
    MAX_BATCH_BYTES,
    SCALARS,
    EpisodeFrames,
    detail_offset,
    encode_batch,
    encode_frame,
    frame_payload,
    scalar_frame,
    split_batches,
)
from gateway.core.live_log import EpisodeLog
from gateway.core.page_cache import HEAD_EPISODES, PageCache, page_start
from gateway.core.replay import SMALLEST_BATCH_BYTES, BatchSizer, Replay
from tests.fakes.fake_trainer import valid_episodes
from tests.store.test_store_contract import make_run
from trainwire.v1 import episode_pb2, gateway_service_pb2


def test_a_frame_is_a_watch_response_with_the_episode() -> None:
    for ep in valid_episodes(12):
        data = ep.SerializeToString(deterministic=True)
        frame = encode_frame(data)
        message = gateway_service_pb2.WatchRunResponse.FromString(frame)
        assert message.WhichOneof("event") == "episode"
        assert message.episode == ep
        assert frame_payload(frame) == data


def test_a_batch_of_frames_is_a_watch_response_with_the_batch() -> None:
    episodes = list(valid_episodes(30))
    frames = [encode_frame(e.SerializeToString(deterministic=True)) for e in episodes]
    message = gateway_service_pb2.WatchRunResponse.FromString(encode_batch(frames))
    assert message.WhichOneof("event") == "batch"
    assert list(message.batch.episodes) == episodes
    # byte-identical episodes inside
    assert [e.SerializeToString(deterministic=True) for e in message.batch.episodes] == [
        e.SerializeToString(deterministic=True) for e in episodes
    ]


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=400), max_size=300),
    start=st.integers(min_value=0, max_value=300),
    max_episodes=st.integers(min_value=1, max_value=50),
    max_bytes=st.integers(min_value=64, max_value=4000),
)
def test_split_batches_covers_the_range_within_limits(
    sizes: list[int], start: int, max_episodes: int, max_bytes: int
) -> None:
    frames = [b"x" * n for n in sizes]
    start = min(start, len(frames))
    ranges = list(split_batches(frames, start, len(frames), max_episodes, max_bytes))
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(start, len(frames)))
    for lo, hi in ranges:
        assert 1 <= hi - lo <= max_episodes
        size = sum(sizes[lo:hi])
        assert hi - lo == 1 or size + 6 <= max_bytes


def test_batches_of_the_real_limits() -> None:
    big = [b"y" * 30_000] * 100  # 30 KB frames: the 128 KiB cap binds before 256 episodes
    ranges = list(split_batches(big, 0, 100))
    assert all(sum(len(f) for f in big[lo:hi]) <= MAX_BATCH_BYTES for lo, hi in ranges)
    assert ranges[0] == (0, 4)
    small = [b"z" * 10] * 600
    assert [hi - lo for lo, hi in split_batches(small, 0, 600)] == [256, 256, 88]


async def test_log_wakes_every_waiter_and_forgets_them() -> None:
    log = EpisodeLog("r1")
    waiters = [asyncio.create_task(log.wait(10)) for _ in range(50)]
    await asyncio.sleep(0)
    assert log.waiter_count == 50
    log.publish([b"a"], [b"a"])
    await asyncio.gather(*waiters)
    assert log.waiter_count == 0
    assert log.last_episode == 1


async def test_cancelled_waiter_leaves_nothing_behind() -> None:
    log = EpisodeLog("r1")
    task = asyncio.create_task(log.wait(10))
    await asyncio.sleep(0)
    assert log.waiter_count == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log.waiter_count == 0


async def test_wait_times_out_and_cleans_up() -> None:
    log = EpisodeLog("r1")
    await log.wait(0.01)
    assert log.waiter_count == 0


async def test_publications_inside_the_wake_window_are_coalesced() -> None:
    # A window of seconds, not tenths: the assertions hold on a loaded machine.
    log = EpisodeLog("r1", min_wake_interval=3.0)
    log.watchers = 100_000  # window = min(3, 100000 x 0.15 ms) = 3 s
    log.publish([b"1"], [b"1"])  # first publication: woken at once
    waiter = asyncio.create_task(log.wait(30))
    await asyncio.sleep(0)
    log.publish([b"2"], [b"2"])
    log.publish([b"3"], [b"3"])
    await asyncio.sleep(0.01)
    assert not waiter.done()  # held for the window
    await asyncio.wait_for(waiter, 20)
    assert log.last_episode == 3  # both arrive with one wake-up
    log.close()  # close is never delayed
    assert log.closed


async def test_a_single_watcher_is_not_delayed() -> None:
    log = EpisodeLog("r1", min_wake_interval=60.0)
    log.watchers = 1  # window 0.15 ms, not the 60 s bound
    log.publish([b"1"], [b"1"])
    waiter = asyncio.create_task(log.wait(120))
    await asyncio.sleep(0.01)
    log.publish([b"2"], [b"2"])
    await asyncio.wait_for(waiter, 20)


async def test_page_cache_shares_loads_and_evicts_by_bytes() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(600)]
    loads: list[tuple[str, int, int]] = []
    gate = asyncio.Event()

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append((run_id, first, last))
        await gate.wait()
        return episodes[first - 1 : last]

    page_bytes = sum(len(encode_frame(e)) for e in episodes[:256])
    cache = PageCache(loader, max_bytes=page_bytes + 10)
    concurrent = [asyncio.create_task(cache.page("r", 0, 600)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    pages = await asyncio.gather(*concurrent)
    assert loads == [("r", 1, 256)]  # twenty watchers, one load
    assert all(p == pages[0] for p in pages)
    assert frame_payload(pages[0][0]) == episodes[0]
    last_page = await cache.page("r", 2, 600)  # episodes 513..600
    assert len(last_page) == 88
    assert cache.size_bytes <= page_bytes + 10  # page 0 evicted to make room
    await cache.page("r", 0, 600)
    assert loads[-1] == ("r", 1, 256)
    cache.forget("r")
    assert cache.size_bytes == 0


async def test_page_cache_does_not_keep_a_short_page() -> None:
    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        return [b"e"] * 3  # the run was deleted half way

    cache = PageCache(loader, max_bytes=1 << 20)
    assert len(await cache.page("r", 0, 10)) == 3
    assert cache.size_bytes == 0


async def test_page_cache_keeps_a_growing_page_of_an_active_run_only_once_full() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(300)]

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        return episodes[first - 1 : last]

    cache = PageCache(loader, max_bytes=1 << 20)
    assert len(await cache.page("r", 0, 100, final=False)) == 100
    assert cache.size_bytes == 0  # episodes 101..256 are still to come
    assert len(await cache.page("r", 0, 300, final=False)) == 256
    full = cache.size_bytes
    assert full > 0
    assert len(await cache.page("r", 1, 300, view=SCALARS)) == 44  # a finished run's last page
    cache.forget("r", 1, 256)  # their details were dropped: page 0 goes, page 1 stays
    assert 0 < cache.size_bytes < full


def _recording_loader(
    episodes: list[bytes],
) -> tuple[Callable[..., Awaitable[list[bytes]]], list[tuple[int, int]]]:
    """A page cache's loader over ``episodes``, and the ``(first, last)`` of each read it made."""
    loads: list[tuple[int, int]] = []

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append((first, last))
        return episodes[first - 1 : last]

    return loader, loads


async def test_page_cache_reads_a_forks_first_page_from_after_its_fork_episode() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(600)]
    loader, loads = _recording_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 20)
    # A fork at episode 100 that has published through 250: its first page grows to 256.
    assert page_start(0, 100) == 100 and page_start(1, 100) == 256
    page = await cache.page("f", 0, 250, final=False, origin=100)
    assert frame_payload(page[0]) == episodes[100] and len(page) == 150
    assert cache.size_bytes == 0
    assert len(await cache.page("f", 0, 600, final=False, origin=100)) == 156
    assert cache.size_bytes > 0  # complete: through episode 256
    assert len(await cache.page("f", 0, 600, final=False, origin=100)) == 156
    assert loads == [(101, 250), (101, 256)]
    # Page 0 is cached: the fork's second page is read alone, as a watcher's second page.
    assert len(await cache.page("f", 1, 600, final=False, origin=100)) == 256
    assert loads[-1] == (257, 512)
    assert len(await cache.page("f", 1, 600, final=False, origin=100)) == 256
    assert len(loads) == 3  # page 1 (257..512) was complete: cached


async def test_a_replay_reads_the_pages_after_its_page_in_one_read_and_the_next_ones_ahead() -> (
    None
):
    episodes = [e.SerializeToString() for e in valid_episodes(4000)]
    loader, loads = _recording_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 30)
    got = [await cache.page("r", 0, 4000), await cache.page("r", 1, 4000)]
    assert loads == [(1, 256), (257, 512)]  # the first two pages one at a time
    got.append(await cache.page("r", 2, 4000))
    # Reading on: pages 2-5 in one read, and pages 6-9 started at once, before they are asked
    # for (the store reads them while the watcher is sent these).
    assert loads[2:] == [(513, 1536), (1537, 2560)]
    got += [await cache.page("r", i, 4000) for i in range(3, 11)]
    assert loads[4:] == [(2561, 3584), (3585, 4000)]  # page 10 on: the same again, to the end
    got += [await cache.page("r", i, 4000) for i in range(11, 16)]
    assert len(loads) == 6
    assert [frame_payload(f) for page in got for f in page] == episodes
    assert len(got[15]) == 4000 - 15 * 256
    await cache.page("r", 5, 4000)
    assert len(loads) == 6


async def test_no_page_of_an_active_run_is_read_ahead_before_it_is_whole() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(1600)]
    loader, loads = _recording_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 30)
    for index in range(3):
        await cache.page("r", index, 1550, final=False)
    # Reading on: pages 2-5 (through 1536); page 6 holds 1537..1550 and will grow: not ahead.
    assert loads == [(1, 256), (257, 512), (513, 1536)]


def test_the_detail_offset_splits_an_episode_into_its_numbers_and_its_detail() -> None:
    for episode in valid_episodes(30, detail_every=3):
        data = episode.SerializeToString(deterministic=True)
        at = detail_offset(data)
        numbers = episode_pb2.Episode.FromString(data[:at])
        assert not numbers.HasField("imitation") and numbers.reward == episode.reward
        assert (at < len(data)) == episode.HasField("imitation")
        assert episode_pb2.Episode.FromString(data[:at] + data[at:]) == episode
    assert detail_offset(b"not an episode \xff\xff") == len(b"not an episode \xff\xff")


async def test_the_live_tail_stays_bounded_and_numbers_stay_right() -> None:
    log = EpisodeLog("r1", keep=100)
    frames = [encode_frame(e.SerializeToString()) for e in valid_episodes(1000, detail_every=5)]
    for frame in frames:
        log.publish([frame])
    assert log.last_episode == 1000
    assert 100 <= len(log.frames) <= 200 and log.base == 1000 - len(log.frames)
    assert log.frames == frames[log.base :]
    with_detail = [f for f in log.frames if len(scalar_frame(f)) < len(f)]
    assert with_detail and all(
        not episode_pb2.Episode.FromString(frame_payload(f)).HasField("imitation")
        for f in log.scalar_frames
    )
    restored = EpisodeLog("r1", keep=100)
    restored.restore(1000, frames[-150:])
    assert restored.base == 850 and restored.last_episode == 1000


def test_episode_roundtrip_of_valid_stream_is_byte_stable() -> None:
    ep = next(iter(valid_episodes(1)))
    again = episode_pb2.Episode.FromString(ep.SerializeToString())
    # Map entries make plain serialization order-dependent; the gateway stores deterministic
    # bytes, which any receiver reproduces.
    assert again.SerializeToString(deterministic=True) == ep.SerializeToString(deterministic=True)


def test_the_batch_sizer_shrinks_for_slow_writes_and_grows_back() -> None:
    sizer = BatchSizer(lambda: 0.0)
    frames = [b"f" * 1000] * 1000
    sizes = []
    for _, (lo, hi) in zip(range(8), sizer.batches(frames, 0, 1000), strict=False):
        sizes.append(hi - lo)
        sizer.wrote(5.0)  # each write blocked for seconds: the reader stalls
    assert sizes[0] == 32 and sizes[-1] == 16  # 32 KiB first, then down to the 16 KiB floor
    assert sizer.budget == SMALLEST_BATCH_BYTES
    for _ in range(10):
        sizer.wrote(0.001)
    assert sizer.budget == MAX_BATCH_BYTES
    huge = [b"h" * 200_000] * 3  # one frame over the budget still goes out, alone
    assert list(sizer.batches(huge, 0, 3)) == [(0, 1), (1, 2), (2, 3)]


async def test_a_page_load_that_stops_short_of_a_later_callers_episodes_is_done_again() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(300)]
    gate = asyncio.Event()
    loads: list[int] = []

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append(last)
        await gate.wait()
        return episodes[first - 1 : last]

    cache = PageCache(loader, max_bytes=1 << 20)
    early = asyncio.create_task(cache.page("r", 0, 100, final=False))  # an active run at 100
    await asyncio.sleep(0)
    later = asyncio.create_task(cache.page("r", 0, 200, final=False))  # a watcher at 200
    await asyncio.sleep(0)
    gate.set()
    assert len(await early) == 100
    assert len(await later) == 200  # not the 100 the shared load read
    assert loads == [100, 200]


def test_the_json_views_are_written_once_each_when_first_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    episodes = list(valid_episodes(700, detail_every=5))
    frames = [encode_frame(e.SerializeToString(deterministic=True)) for e in episodes]
    full = [episode_json(e).encode() for e in episodes]
    plain = []
    for e in episodes:
        e.ClearField("detail")
        plain.append(episode_json(e).encode())
    written = 0
    parts = live_log.json_parts

    def counting(episode: episode_pb2.Episode) -> tuple[bytes, bytes | None]:
        nonlocal written
        written += 1
        return parts(episode)

    monkeypatch.setattr(live_log, "json_parts", counting)
    log = EpisodeLog("r", keep=200)
    log.publish(frames[:300])
    assert written == 0  # nobody asked: nothing written
    assert log.base == 0
    assert log.episodes(JSON, 250, 260) == full[250:260]
    assert log.episodes(JSON | SCALARS, 255, 270) == plain[255:270]  # 260..270 added
    assert written == 20
    assert log.episodes(JSON, 250, 270) == full[250:270] and written == 20  # held
    log.publish(frames[300:450])  # trims the first 250 (base 250): the stretch stays
    assert log.base == 250
    assert log.episodes(JSON, 260, 450) == full[260:450] and written == 200
    assert log.episodes(JSON, 251, 255) == full[251:255]  # before the stretch: a new one
    assert log.episodes(JSON, 255, 260) == full[255:260]
    log.publish(frames[450:700])  # trims past the whole stretch
    assert log.episodes(JSON | SCALARS, 690, 700) == plain[690:700]
    assert log.episodes(SCALARS, 690, 700) == [scalar_frame(f) for f in frames[690:700]]
    assert log.frames_event(699, 700, JSON) == EpisodeFrames([full[699]], False, 700)


async def test_a_read_goes_on_when_the_watcher_that_started_it_goes_away() -> None:
    """A watcher cancelled while its page is read (a client that hangs up) does not cancel the
    read by being cancelled: others may wait for it. Only a released reader's reads stop."""
    episodes = [e.SerializeToString() for e in valid_episodes(300)]
    gate = asyncio.Event()
    loads: list[tuple[int, int]] = []
    finished: list[int] = []

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append((first, last))
        await gate.wait()
        finished.append(first)
        return episodes[first - 1 : last]

    cache = PageCache(loader, max_bytes=1 << 20)
    watcher = asyncio.create_task(cache.page("r", 0, 300))
    await asyncio.sleep(0.01)
    watcher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watcher
    gate.set()
    page = await asyncio.wait_for(cache.page("r", 0, 300), 10)  # the same read's result
    assert finished == [1] and loads == [(1, 256)]
    assert [frame_payload(f) for f in page] == episodes[:256]


def _gated_loader(
    episodes: list[bytes],
) -> tuple[Callable[..., Awaitable[list[bytes]]], list[tuple[int, int]], list[int], asyncio.Event]:
    """A loader that reads nothing until its gate opens; the ``(first, last)`` of each read it
    started, the ``first`` of each one cancelled, and the gate."""
    loads: list[tuple[int, int]] = []
    cancelled: list[int] = []
    gate = asyncio.Event()

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append((first, last))
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.append(first)
            raise
        return episodes[first - 1 : last]

    return loader, loads, cancelled, gate


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_reader_that_goes_cancels_the_reads_of_pages_only_it_holds() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(4000)]
    loader, loads, cancelled, gate = _gated_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 30)
    a, b = object(), object()
    gate.set()
    for index in range(2):
        await cache.page("r", index, 4000, reader=a)
    gate.clear()
    waiting = asyncio.create_task(cache.page("r", 2, 4000, reader=a))
    await _settle()
    assert loads[2:] == [(513, 1536), (1537, 2560)]  # reading on, and ahead
    joined = asyncio.create_task(cache.page("r", 6, 4000, reader=b))  # in the read ahead
    await _settle()
    waiting.cancel()  # a's watcher goes while its page is read
    with pytest.raises(asyncio.CancelledError):
        await waiting
    cache.release(a)
    await _settle()
    assert cancelled == [513]  # b holds the read ahead: it goes on
    gate.set()
    page = await asyncio.wait_for(joined, 10)
    assert [frame_payload(f) for f in page] == episodes[1536:1792]
    # The cancelled pages are read again for whoever asks for them next.
    page = await asyncio.wait_for(cache.page("r", 3, 4000, reader=b), 10)
    assert [frame_payload(f) for f in page] == episodes[768:1024]
    assert loads[4] == (769, 1024)
    cache.release(b)
    cache.release(b)  # releasing twice, or a reader that holds nothing, is harmless
    cache.release(object())
    # A read of one page is left to finish when its reader goes: it is cached for the next.
    gate.clear()
    c = object()
    alone = asyncio.create_task(cache.page("r", 15, 4000, reader=c))
    await _settle()
    alone.cancel()
    cache.release(c)
    gate.set()
    await _settle()
    assert loads[-1] == (3841, 4000) and cancelled == [513]
    assert len(await cache.page("r", 15, 4000)) == 160
    assert loads[-1] == (3841, 4000)


async def test_a_read_that_no_named_reader_holds_is_never_cancelled() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(300)]
    loader, loads, cancelled, gate = _gated_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 20)
    a = object()
    anonymous = asyncio.create_task(cache.page("r", 0, 300))
    await _settle()
    joined = asyncio.create_task(cache.page("r", 0, 300, reader=a))
    await _settle()
    joined.cancel()
    cache.release(a)
    await _settle()
    gate.set()
    assert len(await asyncio.wait_for(anonymous, 10)) == 256
    assert (loads, cancelled) == ([(1, 256)], [])


async def test_a_watchers_first_read_is_the_head_of_its_page_alone() -> None:
    episodes = [e.SerializeToString() for e in valid_episodes(4000)]
    loader, loads = _recording_loader(episodes)
    cache = PageCache(loader, max_bytes=1 << 30)
    head = await cache.head("r", 300, 4000)
    assert [frame_payload(f) for f in head] == episodes[300 : 300 + HEAD_EPISODES]
    assert loads == [(301, 300 + HEAD_EPISODES), (257, 512)]  # the head, then its page
    assert len(await cache.page("r", 1, 4000)) == 256
    assert len(loads) == 2  # the page was read beside the head
    # No head where the page is cached (or loading), nor where the head would be the page.
    assert await cache.head("r", 300, 4000) == ()
    assert await cache.head("r", 4000 - HEAD_EPISODES, 4000) == ()
    assert await cache.head("r", 3840 - HEAD_EPISODES, 3840, final=False) == ()
    assert len(loads) == 2
    json_head = await cache.head("r", 1000, 4000, view=JSON)
    assert json_head == tuple(episodes[1000 : 1000 + HEAD_EPISODES])  # as read


async def test_a_watcher_that_goes_leaves_no_reads_of_the_store_behind() -> None:
    """A late watcher of a finished run gets its first message from the head of its page, and
    the reads started for it stop when it goes."""
    episodes = [e.SerializeToString() for e in valid_episodes(4000)]
    loads: list[tuple[int, int]] = []
    cancelled: list[int] = []
    never = asyncio.Event()

    async def loader(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
        loads.append((first, last))
        if first > 1280:  # what it reads on: still in flight when it goes
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(first)
                raise
        return episodes[first - 1 : last]

    replay = Replay(PageCache(loader, max_bytes=1 << 30), 10.0, time.monotonic, lambda: False)
    run = make_run("r", episodes=4000)
    run.episode = 4000
    watch = replay.finished(run, 1000)
    first = await asyncio.wait_for(anext(watch), 10)
    assert isinstance(first, EpisodeFrames) and first.first == 1001
    assert [frame_payload(f) for f in first.frames] == episodes[1000 : 1000 + HEAD_EPISODES]
    assert loads == [(1001, 1000 + HEAD_EPISODES), (769, 1024)]

    async def until_it_reads_on() -> asyncio.Future[object]:
        step = asyncio.ensure_future(anext(watch))
        while len(loads) < 5:
            await asyncio.sleep(0)
            if step.done():
                step.result()
                step = asyncio.ensure_future(anext(watch))
        return step

    waiting = await asyncio.wait_for(until_it_reads_on(), 10)
    # Its next page alone; then, reading on, four pages and four ahead.
    assert loads[2:] == [(1025, 1280), (1281, 2304), (2305, 3328)]
    waiting.cancel()  # the watcher goes while it waits for its page
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _settle()
    assert sorted(cancelled) == [1281, 2305]
