"""Episode histories: the in-memory log of an active run and a page cache for finished runs.

Episodes are kept as *frames*: the protobuf encoding of field 1 (length-delimited) holding the
serialized ``Episode``. That one byte string is at once a complete ``WatchRunResponse`` with
``episode`` set and one element of ``EpisodeBatch.episodes``, so publishing to any number of
watchers never re-serializes an episode, and a batch is a single ``bytes.join``.

Every watcher walks a history with its own cursor (an int); nothing is queued per watcher.

A history is held in four *views*, each a list of byte strings, one per episode: frames with the
episode's detail or without (``SCALARS``), and the episode's JSON (``JSON``: the protobuf JSON
mapping, ``gateway.core.episode_json``) with or without its detail, for the HTTP side's event
stream. An active run's log writes the JSON of an episode once, the first time a JSON watcher
needs it (a run nobody watches over HTTP costs nothing); the store keeps it written at
publication (``gateway.core.publisher``), so a replay over HTTP costs what a ``WatchRun`` replay
costs: reading bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from gateway.core.episode_json import join_json, json_parts
from trainwire.v1 import episode_pb2

MAX_BATCH_EPISODES = 256
#: The largest batch message. A watcher holds at most one message in flight, and gRPC a copy of
#: it, so this bounds what a watcher that stopped reading costs the gateway (~256 KiB).
MAX_BATCH_BYTES = 128 << 10
PAGE_EPISODES = 256
#: Pages a page cache reads from the store at once (``PageCache.page``).
READ_PAGES = 4
#: Pages a replay reads one at a time, in a row, before the page cache reads on for it in
#: ``READ_PAGES`` (``PageCache.page``).
READ_ON_AFTER = 2
#: Episodes a watcher's first read from the store reads alone, beside its page
#: (``PageCache.head``).
HEAD_EPISODES = 16
#: Seconds of live wake window per attached watcher (see ``EpisodeLog``): a run's watchers
#: cost at most ~6,700 messages/s. With 100 watchers of a 200 episodes/s run, a 15 ms window,
#: 33 messages per episode: ~1.7 ms of the gateway's ~3 ms of CPU per episode
#: (bench/gateway_fanout.py).
WAKE_WINDOW_PER_WATCHER = 0.00015
_EPISODE_TAG = b"\x0a"  # field 1, wire type 2: WatchRunResponse.episode / EpisodeBatch.episodes
_BATCH_TAG = b"\x2a"  # field 5, wire type 2: WatchRunResponse.batch

#: A view of a history is the sum of these flags (0: frames with their detail). ``SCALARS``
#: is 1, so a ``scalars`` bool is a view too.
SCALARS = 1  # without the episode's detail
JSON = 2  # each episode's JSON instead of its frame
VIEWS = 4


def view_of(scalars: bool, json: bool = False) -> int:
    """The view of a history with or without detail (``scalars``), as frames or ``json``."""
    return (SCALARS if scalars else 0) | (JSON if json else 0)


def varint(value: int) -> bytes:
    """The protobuf varint of ``value``."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: ``Episode.detail``'s fields (10: imitation, 11: grpo); they serialize after every other field.
_DETAIL_FIELDS = frozenset({10, 11})


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def detail_offset(data: bytes) -> int:
    """Where the ``detail`` field of a serialized ``Episode`` begins (``len(data)`` when it has
    none, or when ``data`` is not an episode): the episode's numbers are ``data[:offset]``."""
    i = 0
    end = len(data)
    try:
        while i < end:
            start = i
            key, i = _read_varint(data, i)
            if key >> 3 in _DETAIL_FIELDS:
                return start
            wire = key & 7
            if wire == 0:
                _, i = _read_varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                length, i = _read_varint(data, i)
                i += length
            elif wire == 5:
                i += 4
            else:
                return end
    except IndexError:
        return end
    return end


#: The tag and length of every frame of fewer than 2^14 bytes (all but the largest motions),
#: looked up instead of written: a replay from the store frames every episode it reads (0.1 us
#: against 0.35 us to write them). The length is a one- or two-byte varint; ~3 ms at import.
_HEADS = [bytes((0x0A, n)) for n in range(1 << 7)] + [
    bytes((0x0A, n & 0x7F | 0x80, n >> 7)) for n in range(1 << 7, 1 << 14)
]


def encode_frame(episode_bytes: bytes) -> bytes:
    """The frame of a serialized ``Episode`` (see the module docstring)."""
    size = len(episode_bytes)
    if size < len(_HEADS):
        return _HEADS[size] + episode_bytes
    return _EPISODE_TAG + varint(size) + episode_bytes


def frame_payload(frame: bytes) -> bytes:
    """The serialized ``Episode`` inside a frame."""
    i = 1
    while frame[i] & 0x80:
        i += 1
    return frame[i + 1 :]


def encode_batch(frames: Sequence[bytes]) -> bytes:
    """A serialized ``WatchRunResponse`` whose ``batch`` holds these frames' episodes."""
    body = b"".join(frames)
    return _BATCH_TAG + varint(len(body)) + body


def batch_end(
    frames: Sequence[bytes],
    lo: int,
    end: int,
    max_episodes: int = MAX_BATCH_EPISODES,
    max_bytes: int = MAX_BATCH_BYTES,
) -> int:
    """The end of the batch that starts at ``frames[lo]``: at most ``max_episodes`` frames up to
    ``end`` and, unless a single frame is larger, at most ``max_bytes`` bytes (message overhead
    included)."""
    # 6 bytes: the batch tag and its length varint (a 1 MiB body needs 3-4 bytes).
    limit = min(end, lo + max_episodes)
    if limit <= lo:
        return lo
    # The running sizes, and how many of them fit (in C: a replay sizes every episode).
    sizes = list(itertools.accumulate(map(len, frames[lo:limit])))
    return lo + max(1, bisect.bisect_right(sizes, max_bytes - 6))


def split_batches(
    frames: Sequence[bytes],
    start: int,
    end: int,
    max_episodes: int = MAX_BATCH_EPISODES,
    max_bytes: int = MAX_BATCH_BYTES,
) -> Iterator[tuple[int, int]]:
    """Splits ``frames[start:end]`` into ``(lo, hi)`` ranges (see ``batch_end``)."""
    lo = start
    while lo < end:
        hi = batch_end(frames, lo, end, max_episodes, max_bytes)
        yield lo, hi
        lo = hi


#: Episodes an active run keeps in memory (its live tail); between one and two times this many
#: are held. Older episodes are read from the store through the page cache.
LIVE_EPISODES = 2048


def scalar_frame(frame: bytes) -> bytes:
    """The frame of the same episode without its detail (the same object when it has none)."""
    payload = frame_payload(frame)
    at = detail_offset(payload)
    return frame if at == len(payload) else encode_frame(payload[:at])


def json_views(frames: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """The JSON of frames' episodes: with their detail, and without."""
    full: list[bytes] = []
    numbers: list[bytes] = []
    for frame in frames:
        plain, detail = json_parts(episode_pb2.Episode.FromString(frame_payload(frame)))
        full.append(join_json(plain, detail))
        numbers.append(plain)
    return full, numbers


@dataclass(frozen=True, slots=True)
class EpisodeFrames:
    """Consecutive episodes for a watcher, as frames (or, in a ``JSON`` view, their JSON).

    ``batch`` says they go out as one ``EpisodeBatch``; otherwise there is exactly one frame and
    it goes out as a single ``episode``. ``first`` is the number of the first episode. Immutable,
    so one object can go to every watcher that is at the same place
    (``EpisodeLog.frames_event``).
    """

    frames: Sequence[bytes]
    batch: bool
    first: int


class EpisodeLog:
    """The live tail of one active run's published history, and the wake-up of watchers
    waiting on it.

    It holds episodes ``base + 1 .. last_episode`` (at most ``2 x keep``; the older ones, after
    ``origin``, are in the store), in each view (``view``; ``frames`` with their detail and
    ``scalar_frames`` without are the same objects where an episode has no detail). Only
    committed episodes are appended. Waiting watchers each park one future in ``_waiters``
    (through their ``Waiter``); a wake-up resolves them all and empties the set, and a watcher
    that goes away removes its own future, so nothing outlives a watcher.

    Publications wake watchers at most once per *wake window*: when episodes arrive faster than
    that, the ones in between go out together (one batch per watcher instead of one message
    each), which bounds the messages per second a fast unpaced run costs (a gRPC message costs a
    Python server ~50 us, so 100 watchers x 200 episodes/s would saturate a core). The window
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
        "_json_start",
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
        # Per view; the JSON views hold episodes from frame index _json_start on (a contiguous
        # stretch, written when first asked for: ``episodes``).
        self._views: list[list[bytes]] = [[] for _ in range(VIEWS)]
        self._json_start = 0
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
        if not view & JSON:
            return self._views[view][lo:hi]
        start = self._json_start
        held = self._views[view]
        if lo < start or lo > start + len(held):
            # Not next to the stretch written so far: a new stretch begins at lo (what a
            # watcher asks for next follows on from it).
            start = self._json_start = lo
            self._views[JSON] = []
            self._views[JSON | SCALARS] = []
            held = self._views[view]
        if start + len(held) < hi:
            full, numbers = json_views(self._views[0][start + len(held) : hi])
            self._views[JSON].extend(full)
            self._views[JSON | SCALARS].extend(numbers)
        return held[lo - start : hi - start]

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
        self._append(frames, [scalar_frame(f) for f in frames])

    def publish(
        self, frames: Sequence[bytes], scalar_frames: Sequence[bytes] | None = None
    ) -> None:
        """Appends committed frames (and their scalar views, computed when not given) and
        wakes the waiting watchers (see the class docstring)."""
        if scalar_frames is None:
            scalar_frames = [scalar_frame(f) for f in frames]
        self._append(frames, scalar_frames)
        if self._timer is not None:
            return  # a wake-up is already scheduled; it will carry these frames too
        window = min(self._min_wake_interval, self.watchers * WAKE_WINDOW_PER_WATCHER)
        delay = self._last_wake + window - self._clock()
        if delay <= 0:
            self.wake()
        else:
            self._timer = asyncio.get_running_loop().call_later(delay, self.wake)

    def _append(self, frames: Sequence[bytes], scalar_frames: Sequence[bytes]) -> None:
        held = self._views
        held[0].extend(frames)
        held[SCALARS].extend(scalar_frames)
        excess = len(held[0]) - self._keep
        if excess > self._keep:
            # New lists: a watcher slicing the old ones keeps what it holds.
            self._views = [v[excess:] for v in held[:JSON]]
            start = self._json_start - excess
            if start >= 0:
                self._views += held[JSON:]
            else:
                self._views += [v[-start:] for v in held[JSON:]]
                start = 0
            self._json_start = start
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


def page_start(index: int, origin: int = 0) -> int:
    """The episode before the first of page ``index`` of a run whose history starts after
    ``origin``."""
    return max(index * PAGE_EPISODES, origin)


#: The reader of reads started with no reader named: never released.
_NO_READER = object()


class PageCache:
    """A byte-bounded LRU of history pages read from the store (finished runs, and the history
    of active runs older than their live tail), shared by all watchers.

    Page ``k`` of a run holds episodes ``k*PAGE_EPISODES + 1`` onwards (at most
    ``PAGE_EPISODES``), in one view (``view_of``: frames or JSON, with detail or without); the
    page of a fork's
    first episode holds those after its fork episode only (``page_start``). Concurrent misses
    on one page share a single load.

    A read runs for its *readers*: the watchers that asked for one of its pages, and the one
    that started it ahead of asking. A watcher that goes away releases its reads
    (``release``), and a read of several pages that no reader holds any more is cancelled: a
    watcher that looks at a run's history and goes leaves no reads of thousands of episodes
    behind, which the next watcher's first page would wait behind (20-50 ms on PostgreSQL on
    two cores). A read with no reader named (``reader=None``) is never cancelled.

    Args:
        loader: Loads ``(run_id, first, last, scalars, json)`` -> serialized episodes (or their
            JSON) from the store.
        max_bytes: Capacity; 0 disables caching.
    """

    def __init__(
        self,
        loader: Callable[[str, int, int, bool, bool], Awaitable[list[bytes]]],
        max_bytes: int,
    ) -> None:
        self._loader = loader
        self._max_bytes = max_bytes
        self._bytes = 0
        # Each page with its size in bytes.
        self._pages: OrderedDict[tuple[str, int, int], tuple[tuple[bytes, ...], int]] = (
            OrderedDict()
        )
        # Each page loading: its future and the read that loads it.
        self._loading: dict[
            tuple[str, int, int], tuple[asyncio.Future[tuple[bytes, ...]], asyncio.Task[None]]
        ] = {}
        # Each read in flight with its readers, and each reader's reads.
        self._reads: dict[asyncio.Task[None], set[object]] = {}
        self._held: dict[object, set[asyncio.Task[None]]] = {}

    @property
    def size_bytes(self) -> int:
        """Bytes of frames cached now."""
        return self._bytes

    async def page(
        self,
        run_id: str,
        index: int,
        last_episode: int,
        view: int = 0,
        final: bool = True,
        origin: int = 0,
        reader: object | None = None,
    ) -> tuple[bytes, ...]:
        """Episodes (in ``view``) of page ``index`` of a run whose episodes through
        ``last_episode`` are committed (``final``: and no more will be; otherwise a page that
        is not full is not cached, it may grow), and whose history starts after ``origin`` (a
        fork's episode): the first is episode ``page_start(index, origin) + 1``. ``reader``:
        who asks (it holds the reads started for it until it calls ``release``)."""
        holder = _NO_READER if reader is None else reader
        key = (run_id, index, view)
        cached = self._pages.get(key)
        if cached is not None:
            self._pages.move_to_end(key)
            return cached[0]
        first = page_start(index, origin) + 1
        last = min(last_episode, (index + 1) * PAGE_EPISODES)
        loading = self._loading.get(key)
        if loading is not None:
            future, read = loading
            self._hold(read, holder)
            shared = await asyncio.shield(future)
            if len(shared) >= last - first + 1:
                return shared
            # A load of an active run's page that stopped short of what this caller knows is
            # committed (it started earlier): load again, once that one is out of the way.
            return await self.page(run_id, index, last_episode, view, final, origin, reader)
        # A replay that reads on (the READ_ON_AFTER pages before are cached) reads this page and
        # the next ones that are neither cached nor loading, up to READ_PAGES, at once: a store
        # read costs a round trip to the store's thread or server (~0.35 ms) beside ~0.25 ms
        # for 256 episodes; and it starts reading the READ_PAGES after those, so the store
        # works on them while the watcher is sent these. A watcher's first pages are read one
        # at a time: it waits for the first, and a watcher that looks at a run's history and
        # goes (a page opened and closed, a client that wanted one episode) leaves no reads of
        # thousands of episodes behind, which the next watcher's first page would queue behind
        # (on two cores, 20-50 ms on PostgreSQL).
        reads_on = all(
            (run_id, index - back, view) in self._pages for back in range(1, READ_ON_AFTER + 1)
        )
        pages = self._unread(run_id, index, last_episode, view, READ_PAGES if reads_on else 1)
        futures = self._start_load(run_id, pages, last_episode, view, final, origin, holder)
        after = pages[-1] + 1  # ahead: from the page after these, if it exists and is whole
        if (
            reads_on
            and page_start(after, origin) < last_episode
            and (final or (after + 1) * PAGE_EPISODES <= last_episode)
        ):
            ahead = self._unread(run_id, after, last_episode, view, READ_PAGES)
            if ahead:
                self._start_load(run_id, ahead, last_episode, view, final, origin, holder)
        return await asyncio.shield(futures[index])

    async def head(
        self,
        run_id: str,
        after: int,
        last_episode: int,
        view: int = 0,
        final: bool = True,
        origin: int = 0,
        reader: object | None = None,
    ) -> tuple[bytes, ...]:
        """A watcher's first message from the store: episodes ``after + 1`` onwards, at most
        ``HEAD_EPISODES``, read alone while their page is read (for ``reader``, as ``page``
        would); empty when that page is cached or loading, or holds no more than these.

        A page with its details is 1-4 MiB on PostgreSQL (3-4 ms of the server's time, more
        while it reads for others); the first episodes a late watcher sees need a few of its
        rows."""
        index = after // PAGE_EPISODES
        key = (run_id, index, view)
        page_last = min(last_episode, (index + 1) * PAGE_EPISODES)
        last = min(page_last, after + HEAD_EPISODES)
        if key in self._pages or key in self._loading or last >= page_last:
            return ()
        holder = _NO_READER if reader is None else reader
        scalars, json = bool(view & SCALARS), bool(view & JSON)
        read = asyncio.ensure_future(self._loader(run_id, after + 1, last, scalars, json))
        self._start_load(run_id, [index], last_episode, view, final, origin, holder)
        data = await read
        if len(data) != last - after:
            return ()  # the run was deleted meanwhile: its page says so
        return tuple(data) if view & JSON else tuple(encode_frame(d) for d in data)

    def release(self, reader: object) -> None:
        """``reader`` wants no more pages: the reads of several pages that only it holds are
        cancelled."""
        for read in self._held.pop(reader, ()):
            readers = self._reads.get(read)
            if readers is None:
                continue
            readers.discard(reader)
            if readers:
                continue
            keys = [k for k, (_, r) in self._loading.items() if r is read]
            # A read of one page is left to finish, for the next watcher there: cancelling it
            # costs about as much as reading it (on PostgreSQL, a cancel request on a
            # connection of its own).
            if len(keys) > 1:
                for key in keys:  # nobody may join it now: a page asked for later is read again
                    del self._loading[key]
                read.cancel()

    def _hold(self, read: asyncio.Task[None], reader: object) -> None:
        self._reads[read].add(reader)
        if reader is not _NO_READER:
            self._held.setdefault(reader, set()).add(read)

    def _read_done(self, read: asyncio.Task[None]) -> None:
        for reader in self._reads.pop(read, ()):
            held = self._held.get(reader)
            if held is not None:
                held.discard(read)

    def _unread(
        self, run_id: str, index: int, last_episode: int, view: int, most: int
    ) -> list[int]:
        """Page ``index`` and the pages after it that are whole, neither cached nor loading, up
        to ``most`` pages in all (``[]`` when page ``index`` is cached or loading)."""
        pages: list[int] = []
        while (
            len(pages) < most
            and (not pages or (pages[-1] + 1) * PAGE_EPISODES < last_episode)
            and (run_id, index + len(pages), view) not in self._pages
            and (run_id, index + len(pages), view) not in self._loading
        ):
            pages.append(index + len(pages))
        return pages

    def _start_load(
        self,
        run_id: str,
        pages: list[int],
        last_episode: int,
        view: int,
        final: bool,
        origin: int,
        reader: object,
    ) -> dict[int, asyncio.Future[tuple[bytes, ...]]]:
        """Starts reading ``pages`` (consecutive) in one store read for ``reader``; their
        futures."""
        first = page_start(pages[0], origin) + 1
        read_last = min(last_episode, (pages[-1] + 1) * PAGE_EPISODES)
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in pages}
        # The read runs in a task of its own: a watcher cancelled while it waits for its page
        # does not cancel a read that others hold (``release`` cancels what nobody holds).
        load = loop.create_task(self._load(run_id, view, first, read_last, final, origin, futures))
        self._reads[load] = set()
        self._hold(load, reader)
        load.add_done_callback(self._read_done)
        for i, future in futures.items():
            self._loading[(run_id, i, view)] = (future, load)
        return futures

    async def _load(
        self,
        run_id: str,
        view: int,
        first: int,
        last: int,
        final: bool,
        origin: int,
        futures: dict[int, asyncio.Future[tuple[bytes, ...]]],
    ) -> None:
        """Reads episodes ``first..last`` and resolves the futures of the pages they hold."""
        try:
            data = await self._loader(run_id, first, last, bool(view & SCALARS), bool(view & JSON))
            frames = tuple(data) if view & JSON else tuple(encode_frame(d) for d in data)
        except asyncio.CancelledError:
            for future in futures.values():  # released: nobody waits for these
                future.cancel()
            raise
        except BaseException as exc:
            for future in futures.values():
                future.set_exception(exc)
                future.exception()  # consumed here; the waiters get it from their shield
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            for i, future in futures.items():
                key = (run_id, i, view)
                entry = self._loading.get(key)
                if entry is not None and entry[0] is future:  # (a released read's keys are gone)
                    del self._loading[key]
        if len(frames) != last - first + 1:
            # A short read (the run was deleted meanwhile): nothing is cached, and the pages
            # cannot be told apart; the first page gets what there is, the others load again.
            for n, future in enumerate(futures.values()):
                future.set_result(frames if n == 0 else ())
            return
        for i, future in futures.items():
            lo = page_start(i, origin) + 1 - first
            hi = min(last, (i + 1) * PAGE_EPISODES) - first + 1
            page = frames[lo:hi] if len(futures) > 1 else frames
            future.set_result(page)
            # A page of an active run that is not full may grow: not cached.
            if final or hi + first - 1 == (i + 1) * PAGE_EPISODES:
                self._put((run_id, i, view), page)

    def _put(self, key: tuple[str, int, int], frames: tuple[bytes, ...]) -> None:
        size = sum(map(len, frames))
        if size > self._max_bytes:
            return
        self._pages[key] = (frames, size)
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, (_, old) = self._pages.popitem(last=False)
            self._bytes -= old

    def forget(self, run_id: str, first: int = 1, last: int | None = None) -> None:
        """Drops the pages of a run (it was deleted), or those holding episodes
        ``first..last`` (their details were dropped)."""
        lo = (first - 1) // PAGE_EPISODES
        hi = None if last is None else (last - 1) // PAGE_EPISODES
        stale = [
            k for k in self._pages if k[0] == run_id and lo <= k[1] and (hi is None or k[1] <= hi)
        ]
        for key in stale:
            self._bytes -= self._pages.pop(key)[1]
