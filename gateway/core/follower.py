"""Following a run that another gateway replica drives (PostgreSQL).

A ``Follower`` keeps a run's committed history in an ``EpisodeLog``, read from the shared
store: the whole history when the first watcher attaches, then what was committed since,
whenever the store announces a change of the run (``wake``: ``NOTIFY`` from the owner's commit
transaction) and every ``RECHECK_S`` anyway (a lost notification delays a watcher, never loses
an episode). Watchers walk its log exactly as they walk a driver's (``gateway.core.replay``),
so the guarantees are the same: every committed episode once, in order, ``caught_up`` after
the history that existed at attach time, keepalives, and the final run once the store has the
run finished with all its episodes.

A replica has one follower per run that its watchers follow, made for the first and ended
once the last one left. A driver that loses its run to another replica hands its log to a
follower, so the watchers of that log go on without a break.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.core.framing import encode_frame
from gateway.core.live_log import EpisodeLog
from gateway.core.runs import TrainingRun
from gateway.core.store import Store

_LOGGER = logging.getLogger(__name__)

#: Seconds between two reads of the run without a notification (the safety net).
RECHECK_S = 2.0
#: Episodes read from the store in one query.
READ_CHUNK = 1024


class Follower:
    """Follows one run from the store (see the module docstring).

    Args:
        run: The run as last read.
        store: The shared store.
        on_end: Called once the follower stopped (its run finished or nobody watches).
        log: The log to extend (a driver's that lost the run), or None for a new one.
        min_wake_interval: The log's live wake window (``live_coalesce_s``).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        run: TrainingRun,
        store: Store,
        on_end: Callable[[Follower], None],
        log: EpisodeLog | None = None,
        min_wake_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run = run
        self._store = store
        self._on_end = on_end
        self.log = (
            log
            if log is not None
            else EpisodeLog(run.id, min_wake_interval, clock, origin=run.fork_episode)
        )
        #: Watchers that hold it (counted before their first await, unlike ``log.watchers``).
        self.users = 0
        self.detail = ""
        self._wake = asyncio.Event()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._loop(), name=f"gateway-follow-{run.id}")

    @property
    def run_id(self) -> str:
        """The run followed."""
        return self.run.id

    def wake(self) -> None:
        """The store announced a change of the run: read it again."""
        self._wake.set()

    async def ready(self) -> None:
        """Returns once the history committed before the call is in the log.

        Raises:
            StoreUnavailable: the store could not be read.
        """
        await asyncio.shield(self._ready)

    def snapshot(self) -> TrainingRun:
        """The run as last read."""
        run = self.run.snapshot()
        run.state_detail = self.detail if run.state.active else ""
        return run

    async def stop(self) -> None:
        """Stops following (gateway shutdown)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _loop(self) -> None:
        try:
            while True:
                self._wake.clear()
                try:
                    await self._refresh()
                except Exception as exc:
                    if not self._ready.done():
                        self._ready.set_exception(exc)
                        self._ready.exception()  # read here; ready() raises it
                        return
                    _LOGGER.warning("run %s: reading it failed: %s", self.run.id, exc)
                if not self._ready.done():
                    self._ready.set_result(None)
                if self.log.closed or (self.users == 0 and self.log.watchers == 0):
                    return
                try:
                    async with asyncio.timeout(RECHECK_S):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            self._on_end(self)

    async def _refresh(self) -> None:
        """Reads the run, then the episodes committed up to its counter (both committed
        together, so they are all there), and closes the log once it finished."""
        run = await self._store.get_run(self.run.id)
        if run is None:  # deleted (only a finished run can be): nothing more comes
            self.log.close()
            return
        changed = run.state is not self.run.state
        self.run = run
        log = self.log
        if log.last_episode == log.origin and run.episode - log.origin > log.keep:
            # Only the live tail is held; what is older is read through the page cache.
            log.base = run.episode - log.keep
        first = last = self.log.last_episode
        while run.episode > last:
            upto = min(run.episode, last + READ_CHUNK)
            data = await self._store.read_episodes(run.id, last + 1, upto)
            if not data:
                break
            self.log.publish([encode_frame(d) for d in data])
            last = self.log.last_episode
        if run.state.finished and last >= run.episode:
            self.log.close()
        elif changed and last == first:
            self.log.wake()  # a state change (pause, resume) shows in the next keepalive
