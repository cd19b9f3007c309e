"""The live log: the live tail of one active run's committed history, which its watchers follow.

An ``EpisodeLog`` holds the run's most recent committed episodes in every view
(``gateway.core.framing``) and wakes the watchers waiting for more. Every watcher walks it with
its own cursor (an int); nothing is queued per watcher. What is older than the tail is read from
the store through the page cache (``gateway.core.page_cache``).

Invariants:

* Only committed episodes are appended, in order, without gaps: the log holds episodes
  ``base + 1 .. last_episode``, at least ``keep`` of them once it has them and at most
  ``2 x keep``; the ones before ``base`` (after ``origin``) are in the store.
* Episodes published by the run's publisher arrive encoded (``EncodedEpisode``): the log takes
  their frames and JSON as they are. The JSON of a detail the publisher did not write (the
  store drops that detail) is written from the frame the first time a JSON watcher asks for the
  episode with its detail (a run nobody watches over HTTP costs nothing). Episodes it is given
  as frames only (a restart's restore, a replica following the run) have their JSON written
  once, the first time a JSON watcher asks for it.
* The lists a watcher was handed are never changed afterwards: trimming the tail makes new
  lists.
* A waiting watcher parks one future; a wake-up resolves every parked future and empties the
  set, and a watcher that goes away removes its own, so nothing outlives a watcher.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence

from gateway.core.episode_json import join_json, json_parts
from gateway.core.framing import (
    JSON,
    SCALARS,
    VIEWS,
    EncodedEpisode,
    EpisodeFrames,
    detail_json_of,
    frame_payload,
    scalar_frame,
)
from trainwire.v1 import episode_pb2

#: Episodes an active run keeps in memory (its live tail); between one and two times this many
#: are held. Older episodes are read from the store through the page cache.
LIVE_EPISODES = 2048
#: Seconds of live wake window per attached watcher (see ``EpisodeLog``): a run's watchers
#: cost at most ``1 / WAKE_WINDOW_PER_WATCHER`` messages/s.
WAKE_WINDOW_PER_WATCHER = 0.00015
#: A JSON view's entry for an episode whose JSON is not written yet (no episode's JSON is
#: empty).
_UNWRITTEN = b""


class EpisodeLog:
    """The live tail of one active run's published history, and the wake-up of watchers
    waiting on it.

    It holds episodes ``base + 1 .. last_episode`` (at most ``2 x keep``; the older ones, after
    ``origin``, are in the store), in each view (``view``; ``frames`` with their detail and
    ``scalar_frames`` without are the same objects where an episode has no detail). Only
    committed episodes are appended: encoded by the publisher (``publish_encoded``), their
    frames and JSON as they are (a detail's JSON the publisher did not write written when a JSON
    watcher first asks for it); as frames only (``publish``, ``restore``), their JSON written
    when a JSON watcher first asks for it. Waiting watchers each park one future in ``_waiters``
    (through their ``Waiter``); a wake-up resolves them all and empties the set, and a watcher
    that goes away removes its own future, so nothing outlives a watcher.

    Publications wake watchers at most once per *wake window*: when episodes arrive faster than
    that, the ones in between go out together (one batch per watcher instead of one message
    each), which bounds the messages per second a fast unpaced run costs (every message costs
    the server CPU, times the number of watchers). The window
    grows with the number of attached watchers, ``WAKE_WINDOW_PER_WATCHER`` each, up to
    ``min_wake_interval``: a run with one watcher is not delayed, one with 100 watchers costs at
    most ``1 / WAKE_WINDOW_PER_WATCHER`` messages/s. A run slower than its window is woken at
    once, without added latency. While a wake-up is scheduled (``wake_pending``), a watcher that
    finishes a message and finds newer episodes leaves them to that wake-up (``Replay``) rather
    than sending them at once: each watcher sends one message per window, not two.

    The watchers woken together are at the same place (the episode they had when the last
    wake-up came), so ``frames_event`` builds their event once and hands the same object to
    each of them.

    Args:
        run_id: The run.
        min_wake_interval: Minimum seconds between two publication wake-ups (0: every one).
        clock: Monotonic clock in seconds.
        keep: Episodes kept in memory at least (``LIVE_EPISODES``).
        origin: The episode the run's history starts after: 0, or a fork's fork episode (its
            first episode is ``origin + 1``).
    """

    __slots__ = (
        "_clock",
        "_keep",
        "_last_wake",
        "_min_wake_interval",
        "_shared",
        "_timer",
        "_views",
        "_waiters",
        "base",
        "closed",
        "origin",
        "run_id",
        "watchers",
    )

    def __init__(
        self,
        run_id: str,
        min_wake_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        keep: int = LIVE_EPISODES,
        origin: int = 0,
    ) -> None:
        self.run_id = run_id
        self.origin = origin
        self.base = origin
        # Per view, one entry per episode held; a JSON view's entry is _UNWRITTEN until the
        # episode's JSON is written (``episodes``). An encoded episode's JSON without its
        # detail is always written; with it, only where the publisher wrote its detail's.
        self._views: list[list[bytes]] = [[] for _ in range(VIEWS)]
        self.closed = False
        self._keep = keep
        self._waiters: set[asyncio.Future[None]] = set()
        self._min_wake_interval = min_wake_interval
        self._clock = clock
        self._last_wake = -math.inf
        self._timer: asyncio.TimerHandle | None = None
        # The last event built by frames_event, per view: (first, end, event).
        self._shared: list[tuple[int, int, EpisodeFrames] | None] = [None] * VIEWS
        self.watchers = 0  # attached watch streams (maintained by the watchers themselves)

    @property
    def last_episode(self) -> int:
        """The last published episode (``origin`` before the first)."""
        return self.base + len(self._views[0])

    @property
    def waiter_count(self) -> int:
        """How many watchers are parked (for tests and metrics)."""
        return len(self._waiters)

    @property
    def keep(self) -> int:
        """Episodes it holds at least (once it has them)."""
        return self._keep

    @property
    def wake_pending(self) -> bool:
        """Whether a wake-up is scheduled (for episodes published inside the window): it
        will wake every parked watcher."""
        return self._timer is not None

    @property
    def frames(self) -> list[bytes]:
        """The frames held (episode ``base + 1`` first), with their detail."""
        return self._views[0]

    @property
    def scalar_frames(self) -> list[bytes]:
        """The frames held, without their detail."""
        return self._views[SCALARS]

    def episodes(self, view: int, after: int, end: int) -> list[bytes]:
        """Episodes ``after + 1 .. end`` (all held: ``base <= after <= end <= last_episode``) in
        a view (``view_of``); a JSON view writes the JSON of those it does not hold yet."""
        lo, hi = after - self.base, end - self.base
        part = self._views[view][lo:hi]
        if view & JSON and _UNWRITTEN in part:
            self._write_json(lo, hi)
            part = self._views[view][lo:hi]
        return part

    def _write_json(self, lo: int, hi: int) -> None:
        """Writes the JSON views' entries ``lo:hi`` that are not written yet: an encoded
        episode's detail (its numbers' JSON is held), or the whole JSON of an episode given as
        a frame only."""
        views = self._views
        frames, full, numbers = views[0], views[JSON], views[JSON | SCALARS]
        for i in range(lo, hi):
            if full[i] == _UNWRITTEN:
                plain = numbers[i]
                if plain == _UNWRITTEN:
                    episode = episode_pb2.Episode.FromString(frame_payload(frames[i]))
                    plain, detail = json_parts(episode)
                    numbers[i] = plain
                else:
                    detail = detail_json_of(frames[i])
                full[i] = join_json(plain, detail)

    def frames_event(self, after: int, end: int, view: int) -> EpisodeFrames:
        """Episodes ``after + 1 .. end`` (all held: ``base <= after < end <= last_episode``) in
        a view as one event, a batch unless it is one episode; the same object for every caller
        that asks for the same range (one slice and one event per wake-up, not per watcher)."""
        shared = self._shared[view]
        if shared is not None and shared[0] == after and shared[1] == end:
            return shared[2]
        frames = self.episodes(view, after, end)
        event = EpisodeFrames(frames, end - after > 1, after + 1)
        self._shared[view] = (after, end, event)
        return event

    def restore(self, last_episode: int, frames: Sequence[bytes]) -> None:
        """Fills an empty log with the committed tail ``frames`` ending at ``last_episode``
        (after a gateway restart, or for a replica that follows the run)."""
        assert not self.frames, "restore() fills an empty log"
        self.base = last_episode - len(frames)
        self._append(frames, [scalar_frame(f) for f in frames], None)

    def publish(
        self, frames: Sequence[bytes], scalar_frames: Sequence[bytes] | None = None
    ) -> None:
        """Appends committed frames (and their scalar views, computed when not given; their
        JSON is written when first asked for) and wakes the waiting watchers (see the class
        docstring)."""
        if scalar_frames is None:
            scalar_frames = [scalar_frame(f) for f in frames]
        self._append(frames, scalar_frames, None)
        self._published()

    def publish_encoded(self, episodes: Sequence[EncodedEpisode]) -> None:
        """Appends committed episodes as the publisher encoded them, every view as it is (the
        JSON of a detail it did not write is written when first asked for), and wakes the
        waiting watchers (see the class docstring)."""
        self._append(
            [e.frame for e in episodes],
            [e.scalar_frame for e in episodes],
            (
                [_UNWRITTEN if e.json is None else e.json for e in episodes],
                [e.scalar_json for e in episodes],
            ),
        )
        self._published()

    def _published(self) -> None:
        if self._timer is not None:
            return  # a wake-up is already scheduled; it will carry these frames too
        window = min(self._min_wake_interval, self.watchers * WAKE_WINDOW_PER_WATCHER)
        delay = self._last_wake + window - self._clock()
        if delay <= 0:
            self.wake()
        else:
            self._timer = asyncio.get_running_loop().call_later(delay, self.wake)

    def _append(
        self,
        frames: Sequence[bytes],
        scalar_frames: Sequence[bytes],
        json: tuple[Sequence[bytes], Sequence[bytes]] | None,
    ) -> None:
        """Appends episodes in every view (``json``: their JSON with and without the detail;
        None: not written yet) and trims the tail to ``keep`` once it holds twice that."""
        held = self._views
        held[0].extend(frames)
        held[SCALARS].extend(scalar_frames)
        if json is None:
            unwritten = [_UNWRITTEN] * len(frames)
            held[JSON].extend(unwritten)
            held[JSON | SCALARS].extend(unwritten)
        else:
            held[JSON].extend(json[0])
            held[JSON | SCALARS].extend(json[1])
        excess = len(held[0]) - self._keep
        if excess > self._keep:
            # New lists: a watcher slicing the old ones keeps what it holds.
            self._views = [v[excess:] for v in held]
            self.base += excess

    def close(self) -> None:
        """Marks the history complete (the run finished) and wakes every watcher."""
        self.closed = True
        self.wake()

    def wake(self) -> None:
        """Wakes every waiting watcher now (publication, close, shutdown, state change)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last_wake = self._clock()
        waiters = self._waiters
        if not waiters:
            return
        self._waiters = set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def waiter(self) -> Waiter:
        """A place for one watcher to wait on this log (``Waiter.close`` it when done)."""
        return Waiter(self)

    async def wait(self, timeout: float) -> None:
        """Waits until the next wake-up or ``timeout`` seconds, whichever comes first."""
        waiter = Waiter(self)
        try:
            await waiter.wait(timeout)
        finally:
            waiter.close()


class Waiter:
    """One watcher's waits on an ``EpisodeLog``: until its next wake-up or a timeout.

    A watch waits once per message it sends, each time with the timeout of its next keepalive,
    which moves on with every message. Its timer is therefore re-armed lazily: one that would
    fire earlier than the new timeout is kept, wakes the watcher early (it finds nothing to
    send and waits again, with a timer now exact), and is replaced only then; a busy watch
    costs one timer per keepalive interval instead of one timer (and ``asyncio.timeout``'s
    task cancellation machinery) per message.
    """

    __slots__ = ("_future", "_log", "_loop", "_timer", "_when")

    def __init__(self, log: EpisodeLog) -> None:
        self._log = log
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._when = math.inf

    async def wait(self, timeout: float) -> None:
        """Waits until the log's next wake-up or ``timeout`` seconds (loop time), whichever
        comes first; it may return earlier (see the class docstring)."""
        loop = self._loop
        when = loop.time() + timeout
        if self._when > when:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(when, self._expire)
            self._when = when
        future: asyncio.Future[None] = loop.create_future()
        self._future = future
        self._log._waiters.add(future)
        try:
            await future
        finally:
            self._future = None
            self._log._waiters.discard(future)  # gone already unless it timed out or left

    def _expire(self) -> None:
        self._timer = None
        self._when = math.inf
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def close(self) -> None:
        """Cancels its timer (the watch ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._when = math.inf
