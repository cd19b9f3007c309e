"""The run registry: the gateway core's facade over its runs.

``RunRegistry`` creates, finds, lists, controls, deletes and watches runs, on one asyncio event
loop (no locks: every method runs between two awaits atomically). It holds the active runs, one
``RunDriver`` each (``gateway.core.driver``: trainer stream, grants, pacing, commits), hands
PENDING runs to the ``Scheduler`` (``gateway.core.scheduler``: queue, probes, placement) and
serves watches through ``Replay`` (``gateway.core.replay``).

This module holds its construction, the controls and the watches; its parts are the runs
(``gateway.core.registry_runs``: create, get, list, delete, ``RunSpec``), the lifecycle
(``gateway.core.registry_lifecycle``: start and recovery, shutdown, health) and the side of
gateway replicas (``gateway.core.registry_replicas``).

On start it recovers what a previous gateway left: PENDING runs are queued again in creation
order and RUNNING/PAUSED runs re-attach to their trainer's job (a PAUSED run stays paused); a run
whose job is gone ends ERROR (``INTERRUPTED_MESSAGE``) with its history intact. Shutdown leaves
active runs as they are in the store and their jobs on the trainers, for the next start.

With gateway replicas on PostgreSQL (``gateway.core.replicas``) the registry drives only the
runs its replica owns; it queues the PENDING runs no replica owns as *candidates* (claimed when
placed), takes runs over the way it recovers them on start, answers for the runs others drive
from the store (``Follower`` for watches), and hands controls of those to their owner. On
shutdown it releases its runs, so another replica takes them over at once.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable

from gateway.core.settings import CoreSettings
from gateway.core.driver import DriverContext, RunDriver
from gateway.core.errors import InvalidRequest, ShuttingDown
from gateway.core.follower import Follower
from gateway.core.history import PageCache
from gateway.core.observer import Observer
from gateway.core.registry_lifecycle import LifecycleMixin
from gateway.core.registry_replicas import ReplicaHostMixin, _refuse
from gateway.core.registry_runs import RunsMixin, RunSpec, _require_run_id
from gateway.core.replay import CaughtUp, EpisodeFrames, Finished, Keepalive, Replay, WatchEvent
from gateway.core.replicas import Replicas
from gateway.core.runs import TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import NotOwner, Store
from gateway.core.trainers import TrainerConnector
from trainwire.contract import FieldViolation

__all__ = [
    "CaughtUp",
    "EpisodeFrames",
    "Finished",
    "Keepalive",
    "RunRegistry",
    "RunSpec",
    "WatchEvent",
]


class RunRegistry(RunsMixin, LifecycleMixin, ReplicaHostMixin):
    """Owns every run of the gateway.

    Args:
        config: Gateway settings (rates, timeouts, trainers).
        store: The store (not yet started).
        connector: How to reach trainers.
        observer: Metrics hooks.
        clock: Monotonic clock in seconds (pacing, keepalives).
        wall_clock: Wall time in Unix nanoseconds (run timestamps).
        on_health: Called with whether any trainer answers (the gateway's health).
        replicas: How this gateway shares its database with other replicas (``Replicas()``,
            the default: it does not).
    """

    def __init__(
        self,
        config: CoreSettings,
        store: Store,
        connector: TrainerConnector,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], int] = time.time_ns,
        on_health: Callable[[bool], None] = lambda healthy: None,
        replicas: Replicas | None = None,
    ) -> None:
        self._config = config
        self._replicas = replicas or Replicas()
        self._shared = self._replicas.shared
        self._store = store
        self._connector = connector
        self._observer = observer or Observer()
        self._clock = clock
        self._now = wall_clock
        self._active: dict[str, RunDriver] = {}
        self._creating: dict[str, asyncio.Future[TrainingRun]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._started = False
        self._on_health = on_health
        self._healthy: bool | None = None
        self._trainers_ok = False
        # Final states the store could not take (disk full): written once it can again.
        self._unsaved: dict[str, TrainingRun] = {}
        # Watched runs another replica drives: the followers new watchers join, and those that
        # took over the log of a driver that lost its run.
        self._followers: dict[str, Follower] = {}
        self._adopted: set[Follower] = set()
        self._applying: dict[str, bool] = {}  # run id -> controls arrived while applying
        self._claiming: set[str] = set()  # candidates a control claims now
        self._successors: weakref.WeakKeyDictionary[RunDriver, Follower] = (
            weakref.WeakKeyDictionary()
        )
        self.scheduler = Scheduler(config, connector, self._observer, self._trainers_changed, clock)
        self._pages = PageCache(self._load_page, int(config.history_cache_mb * (1 << 20)))
        self._replay = Replay(self._pages, config.keepalive_s, clock, lambda: self._closing)
        self._ctx = DriverContext(
            config=config,
            store=store,
            connector=connector,
            observer=self._observer,
            scheduler=self.scheduler,
            clock=clock,
            now=wall_clock,
            on_end=self._ended,
            spawn=self._spawn,
            unsaved=self._remember_unsaved,
            claim=self._claim if self._shared else None,
            on_lost=self._lost,
        )

    # -- controls ----------------------------------------------------------------------------

    async def _driver(self, run_id: str, action: str, speed: float = 0.0) -> RunDriver | None:
        """The driver a control acts on; None when another replica drives the run.

        Raises:
            RunNotFound, IllegalTransition, InvalidRequest (a speed for a finished run).
        """
        _require_run_id(run_id)
        driver = self._active.get(run_id)
        if driver is not None and driver.owned and not driver.finalizing:
            return driver
        if self._shared and (driver is None or not driver.owned):
            return await self._claim_candidate(run_id, driver)
        run = driver.run if driver is not None else await self.get(run_id)
        _refuse(run, action, speed)

    async def _control(self, run_id: str, action: str, speed: float = 0.0) -> TrainingRun:
        driver = await self._driver(run_id, action, speed)
        if driver is not None:
            try:
                if action == "pause":
                    await driver.pause()
                elif action == "resume":
                    await driver.resume()
                elif action == "stop":
                    await driver.stop()
                else:
                    await driver.set_speed(speed)
                return driver.snapshot()
            except NotOwner:  # taken over meanwhile: its new owner applies it
                await driver.abandon()
        return await self._control_elsewhere(run_id, action, speed)

    async def pause(self, run_id: str) -> TrainingRun:
        """Pauses a run: publication stops, the trainer gets no new grant (no-op when paused).

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, "pause")

    async def resume(self, run_id: str) -> TrainingRun:
        """Resumes publication and training at the paced rate (no-op when running).

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, "resume")

    async def set_speed(self, run_id: str, speed: float) -> TrainingRun:
        """Changes the speed (clamped to 0.1..20), effective at once.

        Raises:
            InvalidRequest: non-finite speed.
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, "speed", speed)

    async def stop(self, run_id: str) -> TrainingRun:
        """Stops a run: cancels its training at once and ends it STOPPED.

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, "stop")

    # -- watching ----------------------------------------------------------------------------

    async def _load_page(self, run_id: str, first: int, last: int) -> list[bytes]:
        return await self._store.read_episodes(run_id, first, last)

    async def watch(self, run_id: str, after_episode: int) -> AsyncIterator[WatchEvent]:
        """Streams a run's history after ``after_episode``, then its live episodes.

        Raises:
            InvalidRequest: empty run id or negative after_episode.
            RunNotFound: no such run (or deleted while replayed).
            ShuttingDown: the gateway is stopping.
        """
        _require_run_id(run_id)
        if after_episode < 0:
            raise InvalidRequest(
                f"after_episode of run {run_id!r} must be >= 0, got {after_episode}",
                [FieldViolation("after_episode", f"{after_episode}; need >= 0")],
                run_id,
            )
        if self._closing:
            raise ShuttingDown(f"the gateway is shutting down; resume watching run {run_id!r}")
        observer = self._observer
        observer.watcher_attached(run_id)
        follower: Follower | None = None
        try:
            driver = self._active.get(run_id)
            if driver is not None and driver.owned:
                view = self._view(driver)
                events = self._replay.active(driver.log, lambda: view().state, view, after_episode)
            else:
                run = await self.get(run_id)
                if not (self._shared and run.state.active):
                    events = self._replay.finished(run, after_episode)
                else:  # another replica drives it: follow it in the store
                    follower = self._follow(run)
                    follower.users += 1
                    await follower.ready()
                    f = follower
                    events = self._replay.active(
                        f.log, lambda: f.run.state, f.snapshot, after_episode
                    )
            async for event in events:
                if type(event) is EpisodeFrames:  # one call per message, not per episode
                    observer.episodes_sent(run_id, len(event.frames))
                yield event
        finally:
            if follower is not None:
                follower.users -= 1
                if follower.users == 0:
                    follower.wake()  # the last watcher gone: it ends
            observer.watcher_detached(run_id)
