"""The run registry: the gateway core's facade over its runs.

``RunRegistry`` creates, finds, lists, controls, deletes and watches runs, on one asyncio event
loop (no locks: every method runs between two awaits atomically). It holds the active runs, one
``RunDriver`` each (``gateway.core.driver``: trainer stream, grants, pacing, commits), hands
PENDING runs to the ``Scheduler`` (``gateway.core.scheduler``: queue, probes, placement) and
serves watches through ``Replay`` (``gateway.core.replay``).

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
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.core.driver import DriverContext, RunDriver
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    RunNotFound,
    ShuttingDown,
    StoreUnavailable,
    TooManyPending,
)
from gateway.core.follower import Follower
from gateway.core.history import PageCache
from gateway.core.observer import Observer
from gateway.core.pacing import clamp_speed
from gateway.core.registry_lifecycle import LifecycleMixin
from gateway.core.registry_replicas import ReplicaHostMixin, _elsewhere_detail, _refuse
from gateway.core.replay import CaughtUp, EpisodeFrames, Finished, Keepalive, Replay, WatchEvent
from gateway.core.replicas import Replicas
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import STORE_MESSAGE, DuplicateRequest, NotOwner, Store, StoreWriteFailed
from gateway.core.trainers import TrainerConnector
from trainwire.contract import FieldViolation, check_run_id, display_run_id, task_kind
from trainwire.v1 import episode_pb2

__all__ = [
    "CaughtUp",
    "EpisodeFrames",
    "Finished",
    "Keepalive",
    "RunRegistry",
    "RunSpec",
    "WatchEvent",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A validated request for a new run."""

    task: episode_pb2.TrainTask
    config: episode_pb2.TrainConfig
    speed: float = 0.0
    episodes_per_second: float = 0.0
    request_id: str = ""
    display_name: str = ""
    creator: str = ""  # the authenticated caller's name ("" without authentication)
    #: The fingerprint of the request (without its request_id): the same request_id with
    #: another fingerprint is a reused key, not a retry.
    request_hash: str = ""


def _check_same_request(request_id: str, run: TrainingRun, spec: RunSpec) -> None:
    """A request_id names one request: the same key with another request is refused.

    Raises:
        InvalidRequest: the fingerprints differ (runs stored before fingerprints match any).
    """
    if run.request_hash in ("", spec.request_hash):
        return
    raise InvalidRequest(
        f"request_id {request_id!r} was used for a different request (run {run.id}); an "
        "idempotency key names one request",
        [FieldViolation("request_id", f"already used by run {run.id} for another request")],
    )


def _require_run_id(run_id: str) -> None:
    violations = check_run_id(run_id)
    if violations:
        # A bad id is never echoed whole and never goes into trailing metadata.
        raise InvalidRequest(
            f"run_id {display_run_id(run_id)}: {violations[0].description}", violations
        )


class RunRegistry(LifecycleMixin, ReplicaHostMixin):
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
        config: GatewayConfig,
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

    # -- runs --------------------------------------------------------------------------------

    async def create(self, spec: RunSpec) -> TrainingRun:
        """Creates a run (or returns the one created with the same request id).

        Raises:
            ShuttingDown: the gateway is stopping.
        """
        if self._closing:
            raise ShuttingDown("the gateway is shutting down; cannot create a run")
        rid = spec.request_id
        if not rid:
            return await self._insert(spec)
        in_flight = self._creating.get(rid)
        if in_flight is not None:
            run = await asyncio.shield(in_flight)
            _check_same_request(rid, run, spec)
            return self._current(run)
        future: asyncio.Future[TrainingRun] = asyncio.get_running_loop().create_future()
        self._creating[rid] = future
        existing: TrainingRun | None = None
        try:
            existing = await self._store.find_request(rid)
            if existing is None:
                try:
                    run = await self._insert(spec)
                except DuplicateRequest:  # the same request, just created by another replica
                    existing = await self._store.find_request(rid)
                    if existing is None:
                        raise
            if existing is not None:
                _check_same_request(rid, existing, spec)
                run = existing
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            del self._creating[rid]
        future.set_result(run)
        if existing is not None:
            _LOGGER.info(
                "run %s: request_id %r seen before; returning it",
                run.id,
                rid,
                extra={"run_id": run.id},
            )
        return self._current(run)

    def _current(self, run: TrainingRun) -> TrainingRun:
        """The freshest copy of a run: its driver's, an end the store could not take yet, or
        what the store has (with replicas: a run another replica drives, or none yet)."""
        driver = self._active.get(run.id)
        if driver is not None and driver.owned:
            return driver.snapshot()
        current = self._unsaved.get(run.id, run).snapshot()
        if self._shared and current.state.active:
            current.state_detail = _elsewhere_detail(current, driver)
        return current

    async def _insert(self, spec: RunSpec) -> TrainingRun:
        self._require_writable("create a run")
        limit = self._config.max_pending
        if self.scheduler.waiting >= limit:
            raise TooManyPending(
                f"the gateway already has {self.scheduler.waiting} runs waiting for a trainer "
                f"(--max-pending {limit}); try again when some have started"
            )
        rate = spec.episodes_per_second or self._config.episode_rate
        run = TrainingRun(
            id=uuid.uuid4().hex[:16],
            task=spec.task,
            config=spec.config,
            speed=clamp_speed(spec.speed, zero_is_default=True),
            episodes_per_second=rate,
            create_time=self._now(),
            display_name=spec.display_name,
            request_id=spec.request_id,
            creator=spec.creator,
            request_hash=spec.request_hash,
        )
        try:
            run.seq = await self._store.insert_run(run)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot create a run: {STORE_MESSAGE}") from None
        if self._closing:
            raise ShuttingDown(f"the gateway is shutting down; run {run.id!r} was not started")
        driver = RunDriver(run, self._ctx)
        driver.owned = not self._shared  # a replica claims it when it places it
        self._active[run.id] = driver
        self._observer.run_created(run.id)
        self._observer.run_state_changed(run.id, run.state.name)
        _LOGGER.info(
            "run %s created (%s, %d episodes, %s)",
            run.id,
            task_kind(run.task),
            run.config.max_episodes,
            "unpaced" if rate < 0 else f"{rate:g} episodes/s x {run.speed:g}",
            extra={"run_id": run.id, "event": "created"},
        )
        self.scheduler.enqueue(driver)
        return driver.snapshot()

    async def get(self, run_id: str) -> TrainingRun:
        """The run (a snapshot).

        Raises:
            InvalidRequest: empty run id.
            RunNotFound: no such run.
        """
        _require_run_id(run_id)
        driver = self._active.get(run_id)
        if driver is not None and driver.owned:
            return driver.snapshot()
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return self._current(run)

    async def list_runs(
        self, page_size: int, before_seq: int | None, state: RunState | None
    ) -> tuple[list[TrainingRun], int | None]:
        """A page of runs, newest first, and the cursor of the next page (None on the last).

        Raises:
            InvalidRequest: page_size out of 0..1000.
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidRequest(
                f"page_size {page_size} is not in 0..{MAX_PAGE_SIZE}",
                [FieldViolation("page_size", f"{page_size}; need 0..{MAX_PAGE_SIZE}")],
            )
        limit = page_size or DEFAULT_PAGE_SIZE
        rows = await self._store.list_runs(state, before_seq, limit + 1)
        more = len(rows) > limit
        runs = [self._current(r) for r in rows[:limit]]
        return runs, (runs[-1].seq if more else None)

    async def delete(self, run_id: str) -> TrainingRun:
        """Deletes a finished run and its history; returns the run as it was.

        Raises:
            RunNotFound: no such run.
            IllegalTransition: the run is active.
        """
        _require_run_id(run_id)
        driver = self._active.get(run_id)
        if driver is not None:
            raise IllegalTransition(
                f"cannot delete run {run_id!r}: it is {driver.run.state.name}; stop it first",
                run_id,
            )
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        if run.state.active:  # driven by another replica
            raise IllegalTransition(
                f"cannot delete run {run_id!r}: it is {run.state.name}; stop it first", run_id
            )
        try:
            await self._store.delete_run(run_id)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot delete run {run_id!r}: {STORE_MESSAGE}") from None
        self._pages.forget(run_id)
        self._observer.run_deleted(run_id, run.state.name)
        _LOGGER.info("run %s deleted", run_id, extra={"run_id": run_id, "event": "deleted"})
        return run

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
