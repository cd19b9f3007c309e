"""Watching runs: replay of the history, then live episodes, keepalives and the end.

A watcher of an active run walks the run's in-memory ``EpisodeLog`` with its own cursor (an
int); nothing is queued per watcher. A watcher of a finished run reads its history from the
store through a page cache shared by every watcher. Both send the history that exists at attach
time in batches, then ``CaughtUp`` once, then (active runs) live episodes as they are committed,
keepalives while idle, and finally the final run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from gateway.core.errors import RunNotFound, ShuttingDown
from gateway.core.history import PAGE_EPISODES, EpisodeLog, PageCache, split_batches
from gateway.core.runs import RunState, TrainingRun


@dataclass(frozen=True, slots=True)
class EpisodeFrames:
    """Consecutive episodes for a watcher, as frames (see ``gateway.core.history``).

    ``batch`` says they go out as one ``EpisodeBatch``; otherwise there is exactly one frame and
    it goes out as a single ``episode``.
    """

    frames: Sequence[bytes]
    batch: bool


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

    async def active(
        self,
        log: EpisodeLog,
        state: Callable[[], RunState],
        final: Callable[[], TrainingRun],
        after_episode: int,
    ) -> AsyncIterator[WatchEvent]:
        """Watches an active run through its log.

        Args:
            log: The run's published history.
            state: The run's state now (for keepalives).
            final: The run as it ended (called once the log is closed).
            after_episode: Resume after this episode.
        """
        log.watchers += 1
        try:
            async for event in self._walk(log, state, final, after_episode):
                yield event
        finally:
            log.watchers -= 1

    async def _walk(
        self,
        log: EpisodeLog,
        state: Callable[[], RunState],
        final: Callable[[], TrainingRun],
        after_episode: int,
    ) -> AsyncIterator[WatchEvent]:
        run_id = log.run_id
        frames = log.frames  # the list only grows; a finished run's log stays readable
        cursor = after_episode
        attach = log.last_episode
        for lo, hi in split_batches(frames, cursor, attach):
            self._check_closing(run_id, lo)
            yield EpisodeFrames(frames[lo:hi], True)
        # The run's real last episode, even when after_episode is beyond it.
        yield CaughtUp(attach)
        cursor = max(cursor, attach)
        last_sent = self._clock()
        while True:
            self._check_closing(run_id, cursor)
            visible = log.last_episode
            if visible > cursor:
                # A watcher that fell behind (slow network, unpaced run) gets its backlog in
                # batches rather than one message per episode.
                for lo, hi in split_batches(frames, cursor, visible):
                    yield EpisodeFrames(frames[lo:hi], hi - lo > 1)
                cursor = visible
                last_sent = self._clock()
                continue
            if log.closed:
                yield Finished(final())
                return
            remaining = self._keepalive_s - (self._clock() - last_sent)
            if remaining <= 0:
                yield Keepalive(visible, state())
                last_sent = self._clock()
                continue
            await log.wait(remaining)

    async def finished(self, run: TrainingRun, after_episode: int) -> AsyncIterator[WatchEvent]:
        """Watches a finished run from the store."""
        cursor = after_episode
        last = run.episode
        while cursor < last:
            self._check_closing(run.id, cursor)
            index = cursor // PAGE_EPISODES
            page = await self._pages.page(run.id, index, last)
            first = index * PAGE_EPISODES  # episode number before the page's first
            expected = min(last, first + PAGE_EPISODES) - first
            if len(page) < expected:
                raise RunNotFound(run.id)  # deleted while being replayed
            for lo, hi in split_batches(page, cursor - first, len(page)):
                yield EpisodeFrames(page[lo:hi], True)
            cursor = first + len(page)
        yield CaughtUp(last)
        yield Finished(run)
