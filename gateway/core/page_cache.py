"""The page cache: pages of committed history read from the store, shared by every watcher.

A watcher of a finished run, or of an active run's history older than its live tail
(``gateway.core.live_log``), reads it page by page through one ``PageCache``: a byte-bounded
LRU of pages, each in one view (``gateway.core.framing.view_of``).

Invariants:

* Page ``k`` of a run holds episodes ``k * PAGE_EPISODES + 1`` onwards, at most
  ``PAGE_EPISODES``; the page of a fork's first episode holds those after its fork episode only
  (``page_start``).
* Only committed episodes are read. A page that may still grow (an active run's page that is
  not full) is never cached, nor is a short read (a run deleted meanwhile).
* Concurrent misses on one page share a single read. A read runs for the readers that hold it;
  a read of several pages that no reader holds any more is cancelled (``release``), one of a
  single page is left to finish, and one started with no reader named is never cancelled.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gateway.core.framing import JSON, SCALARS, encode_frame

PAGE_EPISODES = 256
#: Pages a page cache reads from the store at once (``PageCache.page``).
READ_PAGES = 4
#: Pages a replay reads one at a time, in a row, before the page cache reads on for it in
#: ``READ_PAGES`` (``PageCache.page``).
READ_ON_AFTER = 2
#: Episodes a watcher's first read from the store reads alone, beside its page
#: (``PageCache.head``).
HEAD_EPISODES = 16


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
    behind, which the next watcher's first page would wait behind. A read with no reader named
    (``reader=None``) is never cancelled.

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
        # read costs a round trip to the store's thread or server, comparable to reading a
        # page; and it starts reading the READ_PAGES after those, so the store
        # works on them while the watcher is sent these. A watcher's first pages are read one
        # at a time: it waits for the first, and a watcher that looks at a run's history and
        # goes (a page opened and closed, a client that wanted one episode) leaves no reads of
        # thousands of episodes behind, which the next watcher's first page would queue
        # behind.
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

        A page with its details is large and slow to read; the first episodes a late watcher
        sees need a few of its rows."""
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
