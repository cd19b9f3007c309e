"""Virtual time for tests of the gateway core: ``looptime`` fast-forwards the event loop's clock
to its next timer whenever the loop has nothing else to do, so a test of minutes of pacing,
heartbeats and keepalives takes milliseconds.

looptime knows only two kinds of outside work that the clock must wait for: socket I/O and the
futures of ``loop.run_in_executor``, and for both it moves the clock in step with real time while
it waits (a thread's work then takes virtual time, as much as it took real time: more on a busy
machine). The SQLite store commits on a thread of its own (``gateway.core.store.sqlite_thread``)
and hands results back with ``call_soon_threadsafe``, which looptime cannot see coming: while a
commit is in flight, it would jump the clock to the next timer (a heartbeat timeout, a pacing
deadline) as if the commit took that long. ``InFlightStore`` wraps the real store and, while any
of its operations is in flight, keeps a callback ready on the loop, so looptime never finds the
loop idle and the clock stands still: a commit takes no virtual time, however long the machine
takes over it, as a commit of a fast disk would. When nothing else is ready, the callback blocks
(the GIL released) until the store thread hands the loop something, so holding the clock costs
no CPU.

A clock that moves only when the loop is idle turns float rounding into endless loops: a core
wait of ``deadline - now`` that rounds to a hair above zero fires at once without the clock
moving, and the waiter computes the same hair again. Two settings keep virtual time moving, in
``VIRTUAL_TIME`` (the marker of core tests) and ``virtual_loop`` (a coroutine on a fresh looptime
loop, for tests that start many loops: hypothesis examples):

- ``resolution=2**-20``: the clock reads whole multiples of 2**-20 s, which float64 adds and
  subtracts exactly, so ``keepalive_s - (now - last_sent)`` (the replay's keepalive wait) is 0
  or a whole tick, never 1e-15 (with looptime's default 1e-6 it was, and ``asyncio.timeout``
  then fires at once, at the same instant, for ever);
- ``noop_cycles=0``: looptime advances only after that many idle passes in a row, and a pass
  with ready callbacks starts the count again; a wait shorter than asyncio's clock resolution
  (the pacer's ``last + interval - now``, whose ``last`` sums inexact intervals) fires without
  the clock moving and resets the count before it reaches the default 42. With 0 the clock
  moves a tick at the second such pass. Nothing here needs the idle passes: they give outside
  work a chance to arrive, and the one outside worker, the store's thread, is made visible by
  ``InFlightStore``.

In production these waits come out at most a few nanoseconds early and the real clock moves on;
only a clock that stands still makes them spin.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import looptime
import pytest

from gateway.core.curve import CurveBlock
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from gateway.core.store import CheckpointRecord, EpisodeRecord, Store

T = TypeVar("T")

#: The latest virtual second a core test may reach (looptime's end of time): a test that waits
#: for something that never comes fails there instead of spinning its clock forever.
END_OF_TIME_S = 3600.0

#: The tick of virtual time: a power of two, so float arithmetic on clock readings is exact.
RESOLUTION_S = 2.0**-20

#: How far a virtual time may be off what the core schedules: the clock stands still while the
#: store works (see the module docstring), so only the core's own arithmetic (waits computed from
#: clock readings, whole ticks of ``RESOLUTION_S``) moves it off; a margin of many ticks.
TICK = 0.01

#: The longest the held loop blocks at a time waiting for the store thread's delivery (a safety
#: net: a delivery wakes it at once).
HOLD_SLICE_S = 0.05

#: The marker of tests in virtual time (see the module docstring).
VIRTUAL_TIME = pytest.mark.looptime(end=END_OF_TIME_S, noop_cycles=0, resolution=RESOLUTION_S)


class InFlightStore:
    """A ``Store`` that shows looptime when the wrapped store's thread is working (see the
    module docstring). Everything else is the wrapped store's own behaviour.

    Args:
        inner: The real store (not yet started).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self._in_flight = 0
        self._holding = False  # a ``_hold`` is queued on the loop
        # What the store thread handed the loop (``call_soon_threadsafe`` calls), counted after
        # each is queued on the loop, and how many of them the hold has seen.
        self._handed = threading.Condition()
        self._handed_count = 0
        self._handed_seen = 0
        self._watched: asyncio.AbstractEventLoop | None = None
        #: The last episode of each run whose commit came back (for tests of "after commits").
        self.committed: dict[str, int] = {}
        #: Seconds (virtual) each ``update_run`` waits before it is written, and each episode
        #: commit before it is reported (in order): a slow disk, to hold open what happens
        #: while a run's state or its episodes are on their way to the store.
        self.update_delay_s = 0.0
        self.commit_delay_s = 0.0
        #: Seconds (virtual) each ``settle_details`` waits before it is written: a slow thinning
        #: of old details, still at work when its run ends.
        self.settle_delay_s = 0.0
        #: What each ``update_run`` raises while set (a store that cannot be written): the
        #: run's state is not written.
        self.update_error: BaseException | None = None
        self._reported: asyncio.Future[None] | None = None  # the last late commit report

    def _begin(self) -> None:
        self._in_flight += 1
        if not self._holding:
            # One hold at a time: a second one (started when the count went 0 -> 1 again before
            # the first saw it at 0) would find the first ready on the loop, and the two would
            # pass the loop back and forth for as long as anything is in flight, never blocking.
            self._holding = True
            loop = asyncio.get_running_loop()
            self._watch_handoffs(loop)
            loop.call_soon(self._hold, loop)

    def _end(self) -> None:
        self._in_flight -= 1

    def _watch_handoffs(self, loop: asyncio.AbstractEventLoop) -> None:
        """Counts what other threads hand this loop, once the handoff is queued (its wake-up
        byte written), so that ``_hold`` knows when the loop has something to pick up."""
        if self._watched is loop:
            return
        self._watched = loop
        handoff = loop.call_soon_threadsafe

        def counted(callback: Callable[..., object], *args: Any, context: Any = None) -> Any:
            handle = handoff(callback, *args, context=context)
            with self._handed:
                self._handed_count += 1
                self._handed.notify_all()
            return handle

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]

    def _hold(self, loop: asyncio.AbstractEventLoop) -> None:
        """While an operation is in flight, stays ready for the loop's next pass; when nothing
        else is ready (the loop would go idle and looptime would move the clock), first waits
        (blocking, GIL released) until the store thread hands the loop something it has not
        picked up yet. Anything counted is queued on the loop, so the next pass runs it."""
        if self._in_flight == 0:
            self._holding = False
            return
        # Other callbacks are ready: the loop is not idle, the clock stands still without a wait.
        # (asyncio's queue of ready handles; the loop has no public way to ask.)
        if loop._ready:  # type: ignore[attr-defined]
            loop.call_soon(self._hold, loop)
            return
        with self._handed:
            self._handed.wait_for(lambda: self._handed_count > self._handed_seen, HOLD_SLICE_S)
            self._handed_seen = self._handed_count
        loop.call_soon(self._hold, loop)

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        self._begin()
        try:
            return await call()
        finally:
            self._end()

    @property
    def writable(self) -> bool:
        return self.inner.writable

    def on_writable(self, callback: Callable[[bool], None]) -> None:
        self.inner.on_writable(callback)

    async def start(self) -> None:
        await self._call(self.inner.start)

    async def close(self) -> None:
        await self._call(self.inner.close)

    async def insert_run(self, run: TrainingRun) -> int:
        return await self._call(lambda: self.inner.insert_run(run))

    async def update_run(self, run: TrainingRun) -> None:
        if self.update_delay_s:
            await asyncio.sleep(self.update_delay_s)
        if self.update_error is not None:
            raise self.update_error
        await self._call(lambda: self.inner.update_run(run))

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        self._begin()

        def committed(error: BaseException | None) -> None:
            if self.commit_delay_s:
                self._end()  # the thread is done: the delay is virtual time
                self._report_late(record, callback, error)
                return
            try:
                report(error)
            finally:
                self._end()

        def report(error: BaseException | None) -> None:
            if error is None:
                self.committed[record.run_id] = record.episode
            callback(error)

        try:
            self.inner.append_episode(record, committed)
        except BaseException:
            self._end()
            raise

    def _report_late(
        self,
        record: EpisodeRecord,
        callback: Callable[[BaseException | None], None],
        error: BaseException | None,
    ) -> None:
        """Reports a commit ``commit_delay_s`` later, after the ones before it."""
        previous = self._reported
        delay = self.commit_delay_s

        async def report() -> None:
            await asyncio.sleep(delay)
            if previous is not None:
                await previous
            if error is None:
                self.committed[record.run_id] = record.episode
            callback(error)

        self._reported = asyncio.ensure_future(report())

    async def get_run(self, run_id: str) -> TrainingRun | None:
        return await self._call(lambda: self.inner.get_run(run_id))

    async def find_request(self, request_id: str) -> TrainingRun | None:
        return await self._call(lambda: self.inner.find_request(request_id))

    async def list_runs(self, query: RunQuery) -> RunPage:
        return await self._call(lambda: self.inner.list_runs(query))

    async def read_episodes(
        self, run_id: str, first: int, last: int, scalars: bool = False, json: bool = False
    ) -> list[bytes]:
        return await self._call(
            lambda: self.inner.read_episodes(run_id, first, last, scalars, json)
        )

    async def read_curve_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        return await self._call(lambda: self.inner.read_curve_blocks(run_id, spans))

    async def settle_details(self, run_id: str, first: int, last: int, keep: Sequence[int]) -> int:
        if self.settle_delay_s:
            await asyncio.sleep(self.settle_delay_s)
        return await self._call(lambda: self.inner.settle_details(run_id, first, last, keep))

    async def update_metadata(
        self, run_id: str, display_name: str, labels: Mapping[str, str]
    ) -> bool:
        return await self._call(lambda: self.inner.update_metadata(run_id, display_name, labels))

    async def delete_run(self, run_id: str) -> None:
        await self._call(lambda: self.inner.delete_run(run_id))

    async def count_by_state(self) -> dict[RunState, int]:
        return await self._call(self.inner.count_by_state)

    async def active_runs(self) -> list[TrainingRun]:
        return await self._call(self.inner.active_runs)

    async def add_checkpoint(self, record: CheckpointRecord, keep: int) -> list[int]:
        return await self._call(lambda: self.inner.add_checkpoint(record, keep))

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        return await self._call(lambda: self.inner.list_checkpoints(run_id))

    async def delete_checkpoints(self, run_id: str, episodes: Sequence[int]) -> None:
        await self._call(lambda: self.inner.delete_checkpoints(run_id, episodes))


def virtual_loop(main: Callable[[], Coroutine[Any, Any, T]], end: float = END_OF_TIME_S) -> T:
    """Runs ``main()`` on a new event loop in virtual time (from 0) and closes the loop."""
    loop = looptime.new_event_loop(start=0.0, end=end, noop_cycles=0, resolution=RESOLUTION_S)
    try:
        return loop.run_until_complete(main())
    finally:
        # What outlives the test (a trainer's job the core left for a re-attach) ends here, as
        # asyncio.run ends it.
        loop.run_until_complete(_cancel_the_rest())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _cancel_the_rest() -> None:
    rest = asyncio.all_tasks() - {asyncio.current_task()}
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
