"""The live path of a watch in virtual time: one message per wake window for a watcher that
writes slowly, a backlog sent without waiting for wake-ups, one event shared by the watchers a
wake-up finds at the same place, and waits whose timer is re-armed only when it must be."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from gateway.core.framing import MAX_BATCH_BYTES, EpisodeFrames, encode_frame, frame_payload
from gateway.core.live_log import WAKE_WINDOW_PER_WATCHER, EpisodeLog
from gateway.core.page_cache import PageCache
from gateway.core.replay import CaughtUp, Finished, Replay, WatchEvent
from gateway.core.runs import RunState, TrainingRun
from tests.fakes.virtual_time import VIRTUAL_TIME

pytestmark = VIRTUAL_TIME

KEEPALIVE_S = 600.0  # out of the way: these tests are about episodes


def _frame(n: int, size: int = 1) -> bytes:
    """A frame whose payload starts with its number (these tests never parse it further)."""
    return encode_frame(n.to_bytes(4, "big") + b"x" * size)


def _number(frame: bytes) -> int:
    return int.from_bytes(frame_payload(frame)[:4], "big")


def _replay() -> Replay:
    loop = asyncio.get_running_loop()
    return Replay(PageCache(_no_store, 0), KEEPALIVE_S, loop.time, lambda: False)


async def _no_store(run_id: str, first: int, last: int, scalars: bool, json: bool) -> list[bytes]:
    raise AssertionError("the live tail holds everything these tests watch")


def _final() -> TrainingRun:
    raise AssertionError("these logs are not closed")


def _watch(replay: Replay, log: EpisodeLog) -> AsyncIterator[WatchEvent]:
    return replay.active(log, lambda: RunState.RUNNING, _final, 0)


async def _publish(log: EpisodeLog, count: int, every: float, size: int = 1) -> None:
    for n in range(log.last_episode + 1, log.last_episode + count + 1):
        frame = _frame(n, size)
        log.publish([frame], [frame])
        await asyncio.sleep(every)


async def test_a_slow_writer_sends_one_message_per_wake_window() -> None:
    # 2,500 attached watchers (this one, the others pretended): a window of 0.5 s.
    loop = asyncio.get_running_loop()
    log = EpisodeLog("r1", min_wake_interval=0.5, clock=loop.time)
    log.watchers = 2_499
    window = min(0.5, 2_500 * WAKE_WINDOW_PER_WATCHER)
    messages: list[tuple[float, list[int]]] = []

    async def watcher() -> None:
        async for event in _watch(_replay(), log):
            if isinstance(event, EpisodeFrames):
                messages.append((loop.time(), [_number(f) for f in event.frames]))
                await asyncio.sleep(0.1)  # a write that takes a while: episodes come meanwhile
                if log.last_episode == 100 and messages[-1][1][-1] == 100:
                    return

    task = asyncio.create_task(watcher())
    await asyncio.sleep(0)
    start = loop.time()
    await _publish(log, 100, 0.02)  # 2 s, 50 episodes/s
    await asyncio.wait_for(task, 10)

    assert [n for _, numbers in messages for n in numbers] == list(range(1, 101))
    # Without waiting for its wake-up, it would also send what came during each write at
    # once: two messages per window.
    assert len(messages) <= (loop.time() - start) / window + 2
    # Each after the first went out with a wake-up, a window after the one before.
    for (before, _), (after, _) in itertools.pairwise(messages[1:]):
        assert after - before >= window - 1e-6


async def test_a_watcher_behind_by_more_than_a_batch_catches_up_without_waiting() -> None:
    loop = asyncio.get_running_loop()
    log = EpisodeLog("r1", min_wake_interval=0.5, clock=loop.time)
    log.watchers = 2_499
    frame_bytes = MAX_BATCH_BYTES // 4  # the first batches hold one frame each (32 KiB)
    times: list[tuple[float, list[int]]] = []
    release = asyncio.Event()

    async def watcher() -> None:
        async for event in _watch(_replay(), log):
            if isinstance(event, EpisodeFrames):
                times.append((loop.time(), [_number(f) for f in event.frames]))
                if len(times) == 1:
                    await release.wait()  # stalled while ten large episodes come
                if times[-1][1][-1] == 11:
                    return

    task = asyncio.create_task(watcher())
    await asyncio.sleep(0)
    await _publish(log, 1, 0.01, frame_bytes)
    await _publish(log, 10, 0.001, frame_bytes)  # inside the window: a wake-up is scheduled
    assert log.wake_pending
    release.set()
    await asyncio.wait_for(task, 10)

    assert [n for _, numbers in times for n in numbers] == list(range(1, 12))
    backlog = [at for at, _ in times[1:]]
    assert len(backlog) > 1
    # Batch after batch, without a wake window between them.
    assert backlog[-1] - backlog[0] < 0.5 / 2


async def test_watchers_at_the_same_place_get_one_shared_event() -> None:
    loop = asyncio.get_running_loop()
    log = EpisodeLog("r1", min_wake_interval=0.0, clock=loop.time)
    got: list[list[WatchEvent]] = [[], [], []]

    async def watcher(i: int) -> None:
        async for event in _watch(_replay(), log):
            got[i].append(event)
            if isinstance(event, EpisodeFrames) and _number(event.frames[-1]) == 3:
                return

    tasks = [asyncio.create_task(watcher(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert all(type(events[-1]) is CaughtUp for events in got)
    frames = [_frame(n) for n in (1, 2, 3)]
    log.publish(frames, frames)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)

    live = [events[-1] for events in got]
    assert live[0] is live[1] is live[2]
    assert isinstance(live[0], EpisodeFrames)
    assert live[0].batch
    assert [_number(f) for f in live[0].frames] == [1, 2, 3]
    single = log.frames_event(2, 3, False)
    assert not single.batch
    assert log.frames_event(2, 3, False) is single


async def test_a_waiter_keeps_an_earlier_timer_and_then_waits_exactly() -> None:
    loop = asyncio.get_running_loop()
    log = EpisodeLog("r1", clock=loop.time)
    waiter = log.waiter()
    start = loop.time()
    wait = asyncio.create_task(waiter.wait(5.0))
    await asyncio.sleep(1.0)
    log.wake()  # woken after 1 s: its timer (at 5 s) stays armed
    await wait
    assert loop.time() - start == 1.0
    # Waiting 5 s more keeps the timer at 5 s: an early return, the caller waits again.
    await waiter.wait(5.0)
    assert loop.time() - start == 5.0
    await waiter.wait(1.0)  # the rest, on a timer armed for exactly it
    assert loop.time() - start == 6.0
    assert log.waiter_count == 0
    waiter.close()


async def test_a_closed_log_ends_a_parked_watcher_with_the_run() -> None:
    loop = asyncio.get_running_loop()
    log = EpisodeLog("r1", min_wake_interval=0.5, clock=loop.time)
    run = TrainingRun.__new__(TrainingRun)
    events: list[WatchEvent] = []

    async def watcher() -> None:
        replay = _replay()
        async for event in replay.active(log, lambda: RunState.RUNNING, lambda: run, 0):
            events.append(event)

    task = asyncio.create_task(watcher())
    await _publish(log, 3, 0.01)
    log.close()
    await asyncio.wait_for(task, 10)
    numbers = [_number(f) for e in events if isinstance(e, EpisodeFrames) for f in e.frames]
    assert numbers == [1, 2, 3]
    assert isinstance(events[-1], Finished)
    assert events[-1].run is run
