"""Watching runs: replay of the history, then live episodes, keepalives and the end.

A watcher of an active run walks the run's in-memory ``EpisodeLog`` (its live tail) with its own
cursor (an int), and reads what is older than the tail from the store through the page cache;
nothing is queued per watcher. Batches adapt to the watcher (``BatchSizer``): small while
its writes are slow, larger while they are quick, never over ``MAX_BATCH_BYTES``, so a watcher
that stopped reading holds at most one small message (and gRPC's copy of it).

A watcher of a finished run reads its history from the store through a page cache shared by
every watcher. Both send the history that exists at attach time in batches, then ``CaughtUp``
once, then (active runs) live episodes as they are committed, keepalives while idle, and
finally the final run.

A fork's history starts after its fork episode (``TrainingRun.fork_episode``,
``EpisodeLog.origin``): a watch from before it starts there; ``CaughtUp`` and
``after_episode`` mean what they mean for any run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

from gateway.core.errors import RunNotFound, ShuttingDown
from gateway.core.framing import MAX_BATCH_BYTES, EpisodeFrames, batch_end
from gateway.core.live_log import EpisodeLog
from gateway.core.page_cache import PAGE_EPISODES, PageCache, page_start
from gateway.core.runs import RunState, TrainingRun


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The history that existed at attach time has been sent."""

    last_episode: int


@dataclass(frozen=True, slots=True)
class Keepalive:
    """Nothing was sent for the keepalive interval."""

    last_episode: int
    state: RunState


@dataclass(frozen=True, slots=True)
class Finished:
    """The run finished; the final run. The last event of a watch."""

    run: TrainingRun


WatchEvent = EpisodeFrames | CaughtUp | Keepalive | Finished

#: A write slower than this halves the watcher's batch size; a quicker one doubles it. Seconds,
#: not milliseconds: a busy event loop delays every writer a little, and shrinking batches then
#: would only add messages (CPU) where CPU is short; a reader that stopped blocks for good.
SLOW_WRITE_S = 1.0
FIRST_BATCH_BYTES = 32 << 10
SMALLEST_BATCH_BYTES = 16 << 10


class BatchSizer:
    """One watcher's batch size, adapted to how fast its writes complete.

    A write completes when gRPC took the message (flow control holds it while the watcher does
    not read), so a slow write means a slow or stalled reader: its batches shrink, down to one
    episode; quick writes let them grow back to ``MAX_BATCH_BYTES``.
    """

    __slots__ = ("_clock", "budget")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.budget = FIRST_BATCH_BYTES

    def batches(self, frames: Sequence[bytes], start: int, end: int) -> Iterator[tuple[int, int]]:
        """``(lo, hi)`` ranges covering ``frames[start:end]``, each sized when it is taken."""
        lo = start
        while lo < end:
            hi = batch_end(frames, lo, end, max_bytes=self.budget)
            yield lo, hi
            lo = hi

    def wrote(self, seconds: float) -> None:
        """Adapts to how long the last write took."""
        if seconds > SLOW_WRITE_S:
            self.budget = max(SMALLEST_BATCH_BYTES, self.budget // 2)
        else:
            self.budget = min(MAX_BATCH_BYTES, self.budget * 2)


class Replay:
    """The watch paths of a registry.

    Args:
        pages: The page cache of finished runs' histories.
        keepalive_s: A watch idle this long gets a keepalive.
        clock: Monotonic seconds.
        closing: Whether the gateway is shutting down (watches then end with ``ShuttingDown``).
    """

    def __init__(
        self,
        pages: PageCache,
        keepalive_s: float,
        clock: Callable[[], float],
        closing: Callable[[], bool],
    ) -> None:
        self._pages = pages
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._closing = closing

    def _check_closing(self, run_id: str, cursor: int) -> None:
        if self._closing():
            raise ShuttingDown(
                f"the gateway is shutting down; resume watching run {run_id!r} "
                f"with after_episode={cursor}",
                run_id,
            )

    async def _chunk(
        self, log: EpisodeLog, cursor: int, upto: int, view: int, reader: object, opening: bool
    ) -> tuple[Sequence[bytes], bool]:
        """Frames of episodes ``cursor + 1`` onwards, at most through ``upto``: from the live
        tail, else a page from the store (read for ``reader``; a watcher's ``opening`` read
        starts with the page's head); and whether they came from the store."""
        if cursor >= log.base:
            return log.episodes(view, cursor, upto), False
        index = cursor // PAGE_EPISODES
        origin = log.origin
        if opening:
            head = await self._pages.head(log.run_id, cursor, upto, view, False, origin, reader)
            if head:
                return head, True
        page = await self._pages.page(log.run_id, index, upto, view, False, origin, reader)
        first = page_start(index, origin)
        chunk = page[cursor - first : upto - first]
        if not chunk:
            raise RunNotFound(log.run_id)  # its history is gone from the store
        return chunk, True

    async def _send(
        self,
        log: EpisodeLog,
        cursor: int,
        upto: int,
        view: int,
        sizer: BatchSizer,
        reader: object,
        history: bool = False,
    ) -> AsyncIterator[EpisodeFrames]:
        """Episodes ``cursor + 1 .. upto`` in batches sized for the watcher (always as batches
        for the ``history`` sent before ``CaughtUp``, or read from the store)."""
        run_id = log.run_id
        opening = history
        while cursor < upto:
            self._check_closing(run_id, cursor)
            chunk, stored = await self._chunk(log, cursor, upto, view, reader, opening)
            opening = False
            for frames in self._batches(chunk, 0, cursor, sizer, history or stored):
                yield frames
            cursor += len(chunk)

    def _batches(
        self, frames: Sequence[bytes], start: int, base: int, sizer: BatchSizer, batched: bool
    ) -> Iterator[EpisodeFrames]:
        """``frames[start:]`` (the first of ``frames`` is episode ``base + 1``) in batches sized
        for the watcher, each timed from its yield until the watcher took it; sent as a batch
        even when alone if ``batched``."""
        for lo, hi in sizer.batches(frames, start, len(frames)):
            began = self._clock()
            yield EpisodeFrames(frames[lo:hi], batched or hi - lo > 1, base + lo + 1)
            sizer.wrote(self._clock() - began)

    async def active(
        self,
        log: EpisodeLog,
        state: Callable[[], RunState],
        final: Callable[[], TrainingRun],
        after_episode: int,
        view: int = 0,
    ) -> AsyncIterator[WatchEvent]:
        """Watches an active run through its log (and the store, for what is older than the
        log's live tail).

        Args:
            log: The run's published history.
            state: The run's state now (for keepalives).
            final: The run as it ended (called once the log is closed).
            after_episode: Resume after this episode.
            view: What each episode is sent as (``gateway.core.framing.view_of``).
        """
        run_id = log.run_id
        clock = self._clock
        closing = self._closing
        log.watchers += 1
        waiter = log.waiter()
        reader = object()  # what it reads from the store (released when it goes)
        try:
            # A fork's history starts after its fork episode: a watch from before starts there.
            cursor = max(after_episode, log.origin)
            attach = log.last_episode
            sizer = BatchSizer(clock)
            async for event in self._send(log, cursor, attach, view, sizer, reader, True):
                yield event
            # The run's real last episode, even when after_episode is beyond it.
            yield CaughtUp(attach)
            cursor = max(cursor, attach)
            last_sent = clock()
            woken = False  # whether the watcher comes from a wait (else from a message)
            while True:
                if closing():
                    self._check_closing(run_id, cursor)
                visible = log.last_episode
                if visible > cursor:
                    base = log.base
                    if cursor < base or (
                        visible - cursor > 1
                        and batch_end(
                            (backlog := log.episodes(view, cursor, visible)),
                            0,
                            len(backlog),
                            max_bytes=sizer.budget,
                        )
                        < len(backlog)
                    ):
                        # A watcher that fell behind (slow network, unpaced run) gets its
                        # backlog in batches rather than one message per episode, one after
                        # the other.
                        async for event in self._send(log, cursor, visible, view, sizer, reader):
                            yield event
                        last_sent = clock()
                        cursor = visible
                        woken = False
                        continue
                    if woken or not log.wake_pending:
                        # The usual live step: what was published since the last wake-up, one
                        # message, the event shared with the watchers at the same place.
                        began = clock()
                        yield log.frames_event(cursor, visible, view)
                        last_sent = clock()
                        sizer.wrote(last_sent - began)
                        cursor = visible
                        woken = False
                        continue
                    # Published while this watcher wrote, and a wake-up is scheduled for them:
                    # they go out with it (one message per wake window, not two).
                if log.closed:
                    yield Finished(final())
                    return
                remaining = self._keepalive_s - (clock() - last_sent)
                if remaining <= 0:
                    yield Keepalive(visible, state())
                    last_sent = clock()
                    woken = False
                    continue
                await waiter.wait(remaining)
                woken = True
        finally:
            self._pages.release(reader)
            waiter.close()
            log.watchers -= 1

    async def finished(
        self, run: TrainingRun, after_episode: int, view: int = 0
    ) -> AsyncIterator[WatchEvent]:
        """Watches a finished run from the store (a fork's from after its fork episode)."""
        origin = run.fork_episode
        cursor = max(after_episode, origin)
        last = run.episode
        sizer = BatchSizer(self._clock)
        reader = object()  # what it reads from the store (released when it goes)
        try:
            if cursor < last:  # its first message: the head of its page, read alone
                head = await self._pages.head(run.id, cursor, last, view, True, origin, reader)
                for frames in self._batches(head, 0, cursor, sizer, True):
                    yield frames
                cursor += len(head)
            while cursor < last:
                self._check_closing(run.id, cursor)
                index = cursor // PAGE_EPISODES
                page = await self._pages.page(run.id, index, last, view, True, origin, reader)
                first = page_start(index, origin)  # episode number before the page's first
                expected = min(last, (index + 1) * PAGE_EPISODES) - first
                if len(page) < expected:
                    raise RunNotFound(run.id)  # deleted while being replayed
                for frames in self._batches(page, cursor - first, first, sizer, True):
                    yield frames
                cursor = first + len(page)
            yield CaughtUp(last)
            yield Finished(run)
        finally:
            self._pages.release(reader)
