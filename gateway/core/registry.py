"""The run registry: the gateway core's facade over its runs.

``RunRegistry`` assembles the core and answers for it, on one asyncio event loop (no locks:
every method runs between two awaits atomically):

- ``RunCatalog`` creates, finds, lists and deletes runs (``gateway.core.catalog``);
- ``RunTable`` holds the active runs' ``RunDriver``s (``gateway.core.driver``: trainer feed,
  publisher, credit);
- the ``Scheduler`` places PENDING runs on trainers (``gateway.core.scheduler``);
- ``Watches`` serves watch streams (``gateway.core.watches``);
- ``Recovery`` brings back what a previous gateway left active, and ``UnsavedEnds`` keeps the
  final states a full disk could not take (``gateway.core.recovery``);
- ``CheckpointReads`` lists a run's checkpoints and streams one (``gateway.core.checkpoints``);
  drivers record them as trainers report them;
- with gateway replicas on PostgreSQL, the ``ReplicaRouter`` (``gateway.core.router``) reaches
  the runs driven elsewhere and promotes the runs this replica takes; one gateway on its own
  database drives every run and has none.

The registry itself applies controls, and owns start, shutdown and health. Shutdown leaves
active runs as they are in the store and their jobs on the trainers, for the next start (with
replicas: for another replica, at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from gateway.core.catalog import RunCatalog, RunSpec, require_run_id
from gateway.core.checkpoints import CheckpointFiles, CheckpointReads
from gateway.core.controls import Action, apply, refuse
from gateway.core.curve import Bucket
from gateway.core.curves import RunCurves
from gateway.core.driver import RunDriver
from gateway.core.driving import DriverContext
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    RunNotFound,
    TrainerUnavailable,
)
from gateway.core.hyperparameters import check_change
from gateway.core.observer import Observer
from gateway.core.page_cache import PageCache
from gateway.core.recovery import Recovery, UnsavedEnds
from gateway.core.replay import CaughtUp, EpisodeFrames, Finished, Keepalive, Replay, WatchEvent
from gateway.core.replicas import SharedReplicas
from gateway.core.router import ReplicaRouter
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler, TrainerReport
from gateway.core.settings import CoreSettings
from gateway.core.store import CheckpointRecord, NotOwner, Store
from gateway.core.table import RunTable
from gateway.core.trainers import CheckpointMerger, TrainerConnector
from gateway.core.watches import Watches
from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters

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


class RunRegistry:
    """Owns every run of the gateway (see the module docstring).

    Args:
        settings: Rates, timeouts, trainers.
        store: The store (not yet started).
        connector: How to reach trainers.
        observer: Metrics hooks.
        clock: Monotonic clock in seconds (pacing, keepalives, timeouts).
        wall_clock: Wall time in Unix nanoseconds (run timestamps).
        on_health: Called with whether the gateway can take runs (a trainer answers and the
            store can be written) whenever that changes.
        replicas: The coordinator of this gateway among replicas sharing its PostgreSQL
            database; None for a gateway on its own database.
        checkpoint_files: The checkpoint store the trainers write to (None: checkpoints are
            recorded but cannot be downloaded, and their files are never deleted).
    """

    def __init__(
        self,
        settings: CoreSettings,
        store: Store,
        connector: TrainerConnector,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], int] = time.time_ns,
        on_health: Callable[[bool], None] = lambda healthy: None,
        replicas: SharedReplicas | None = None,
        checkpoint_files: CheckpointFiles | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._connector = connector
        self._observer = observer or Observer()
        self._on_health = on_health
        self._healthy: bool | None = None
        self._started = False
        self._background: set[asyncio.Task[None]] = set()
        self.table = RunTable()
        self.scheduler = Scheduler(
            settings, connector, self._observer, lambda _: self._health_changed(), clock
        )
        self.unsaved = UnsavedEnds(store)
        #: With replicas, what reaches the runs driven elsewhere (None: all are driven here).
        self.router = (
            None
            if replicas is None
            else ReplicaRouter(
                replicas,
                store,
                self.table,
                self.scheduler,
                self._make_driver,
                self._spawn,
                settings.live_coalesce_s,
                clock,
                wall_clock,
            )
        )
        self._pages = PageCache(store.read_episodes, int(settings.history_cache_mb * (1 << 20)))
        self._ctx = DriverContext(
            settings=settings,
            store=store,
            connector=connector,
            observer=self._observer,
            scheduler=self.scheduler,
            demoted=self._demoted,
            provider_defaults=self.scheduler.provider_defaults,
            clock=clock,
            now=wall_clock,
            on_end=self._ended,
            spawn=self._spawn,
            unsaved=self.unsaved.remember,
            checkpoint_files=checkpoint_files,
            forget_pages=self._pages.forget,
        )
        self._checkpoint_files = checkpoint_files
        self._curves = RunCurves(store, self.get)
        self.catalog = RunCatalog(
            settings,
            store,
            self.table,
            self.scheduler,
            self.router,
            self.unsaved,
            self._pages,
            self._observer,
            self._make_driver,
            wall_clock,
        )
        self._recovery = Recovery(
            store, self.table, self.scheduler, self._observer, self._make_driver, wall_clock
        )
        self.checkpoints = CheckpointReads(
            store,
            self.catalog.get,
            checkpoint_files,
            merger=connector if isinstance(connector, CheckpointMerger) else None,
            merge_trainers=self._merge_trainers,
        )
        replay = Replay(self._pages, settings.keepalive_s, clock, lambda: self.table.closing)
        self._watches = Watches(self.table, replay, self.router, self.catalog.get, self._observer)

    def _merge_trainers(self) -> list[str]:
        """The trainers that may merge a LoRA checkpoint: those that offer grpo, and those that
        have not answered (yet), in configured order."""
        return [
            address
            for address, state in self.scheduler.trainers.items()
            if state.caps is None or state.offers("grpo")
        ]

    def _make_driver(self, run: TrainingRun) -> RunDriver:
        return RunDriver(run, self._ctx)

    def _demoted(self, driver: RunDriver) -> None:
        """A driver let its run go to another replica (or a store that fences writes refused
        it): it leaves the runs driven here."""
        self.table.remove(driver)
        self.scheduler.dequeue(driver)
        if self.router is not None:
            self.router.demoted(driver)

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _ended(self, driver: RunDriver) -> None:
        self.table.remove(driver)
        self.scheduler.dequeue(driver)

    # -- runs --------------------------------------------------------------------------------

    async def create(self, spec: RunSpec) -> TrainingRun:
        """Creates a run (or returns the one created with the same request id); see
        ``RunCatalog.create``."""
        return await self.catalog.create(spec)

    async def get(self, run_id: str) -> TrainingRun:
        """The run (a snapshot); see ``RunCatalog.get``."""
        return await self.catalog.get(run_id)

    async def list_runs(
        self,
        page_size: int,
        page_token: str,
        state: RunState | None,
        filter_text: str = "",
        order_by: str = "",
    ) -> tuple[list[TrainingRun], str]:
        """A page of the runs a search finds and the next page's token; see
        ``RunCatalog.list_runs``."""
        return await self.catalog.list_runs(page_size, page_token, state, filter_text, order_by)

    async def update(
        self, run_id: str, display_name: str | None, labels: Mapping[str, str] | None
    ) -> TrainingRun:
        """Sets a run's display name and/or labels; see ``RunCatalog.update``."""
        return await self.catalog.update(run_id, display_name, labels)

    async def delete(self, run_id: str) -> TrainingRun:
        """Deletes a finished run and its checkpoints; see ``RunCatalog.delete``."""
        run = await self.catalog.delete(run_id)
        if self._checkpoint_files is not None:
            self._spawn(self._delete_checkpoint_files(run_id), f"gateway-delete-{run_id}")
        return run

    async def _delete_checkpoint_files(self, run_id: str) -> None:
        files = self._checkpoint_files
        assert files is not None
        try:
            await asyncio.to_thread(files.delete_run, run_id)
        except Exception as exc:
            _LOGGER.warning(
                "run %s: could not delete its checkpoints from %s: %s",
                run_id,
                files.location,
                exc,
                extra={"run_id": run_id},
            )

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """A run's checkpoints, oldest first; see ``CheckpointReads.list``."""
        require_run_id(run_id)
        return await self.checkpoints.list(run_id)

    async def open_checkpoint(
        self, run_id: str, episode: int, merged: bool = False
    ) -> tuple[CheckpointRecord, AsyncIterator[bytes]]:
        """One checkpoint and its tar (``merged``: a LoRA checkpoint merged into its base
        model); see ``CheckpointReads.open``."""
        require_run_id(run_id)
        if episode < 0:
            raise InvalidRequest(
                f"run {run_id!r}: episode must be 0 (the latest) or a checkpoint's episode",
                [FieldViolation("episode", f"must be >= 0, got {episode}")],
                run_id,
            )
        return await self.checkpoints.open(run_id, episode, merged)

    async def curve(
        self,
        run_id: str,
        buckets: int,
        metrics: Sequence[str],
        first_episode: int = 0,
        last_episode: int = 0,
    ) -> tuple[list[Bucket], int]:
        """A run's curve as buckets, and its last committed episode; see ``RunCurves.curve``."""
        return await self._curves.curve(run_id, buckets, metrics, first_episode, last_episode)

    def watch(
        self, run_id: str, after_episode: int, scalars: bool = False, json: bool = False
    ) -> AsyncIterator[WatchEvent]:
        """Streams a run's history after ``after_episode``, then its live episodes, with their
        detail or without (``scalars``), as frames or JSON; see ``Watches.watch``."""
        return self._watches.watch(run_id, after_episode, scalars, json)

    # -- controls ----------------------------------------------------------------------------

    async def _control(self, run_id: str, action: Action, speed: float = 0.0) -> TrainingRun:
        require_run_id(run_id)
        driver = self.table.get(run_id)
        if driver is not None and driver.finalizing:
            # Its end is on the way to the store: answered as for the run it is about to be.
            await driver.ended()
            if not driver.abandoned:
                refuse(driver.run, action, speed)
            driver = self.table.get(run_id)
        if driver is None and self.router is not None:
            driver = await self.router.control_target(run_id)
        if driver is None:
            if self.router is not None:
                return await self.router.forward(run_id, action, speed)
            run = await self._store.get_run(run_id)  # finished, or never there
            if run is None:
                raise RunNotFound(run_id)
            refuse(run, action, speed)
        try:
            await apply(driver, action, speed)
            return driver.snapshot()
        except NotOwner:  # taken over meanwhile: its new owner applies it
            await driver.abandon()
            if self.router is None:
                refuse(driver.run, action, speed)
            return await self.router.forward(run_id, action, speed)

    async def pause(self, run_id: str) -> TrainingRun:
        """Pauses a run: publication stops, the trainer gets no new grant (no-op when paused).

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, Action.PAUSE)

    async def resume(self, run_id: str) -> TrainingRun:
        """Resumes publication and training at the paced rate (no-op when running).

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, Action.RESUME)

    async def set_speed(self, run_id: str, speed: float) -> TrainingRun:
        """Changes the speed (clamped to 0.1..20), effective at once.

        Raises:
            InvalidRequest: non-finite speed.
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, Action.SPEED, speed)

    async def stop(self, run_id: str) -> TrainingRun:
        """Stops a run: cancels its training at once and ends it STOPPED.

        Raises:
            RunNotFound, IllegalTransition.
        """
        return await self._control(run_id, Action.STOP)

    async def set_hyperparameters(self, run_id: str, change: Hyperparameters) -> TrainingRun:
        """Changes a RUNNING or PAUSED run's hyperparameters from its next optimizer step; see
        ``RunDriver.set_hyperparameters``. Only the replica that drives a run changes it.

        Raises:
            InvalidRequest, RunNotFound, IllegalTransition, TrainerUnavailable.
        """
        require_run_id(run_id)
        driver = self.table.get(run_id)
        if driver is not None and driver.finalizing:
            await driver.ended()  # answered as for the run it is about to be
            driver = self.table.get(run_id)
        if driver is not None and not driver.finalizing:
            await driver.set_hyperparameters(change)
            return driver.snapshot()
        run = driver.run if driver is not None else await self.catalog.get(run_id)
        check_change(change, run_id, run.task)
        if run.state not in (RunState.RUNNING, RunState.PAUSED):
            raise IllegalTransition(
                f"cannot change the hyperparameters of run {run_id!r}: it is {run.state.name}",
                run_id,
            )
        raise TrainerUnavailable(
            f"run {run_id!r} is driven by another gateway replica, which alone changes its "
            "hyperparameters; try again (or ask that replica)",
            run_id,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the store and the trainer probes and brings back the runs a previous gateway
        left active (``Recovery``)."""
        await self._store.start()
        self._store.on_writable(self._store_changed)
        self._started = True
        self.scheduler.start()
        counts = await self._store.count_by_state()
        self._observer.runs_loaded({state.name: n for state, n in counts.items()})
        if self.router is not None:
            await self.router.start(self._recovery.recover)
        else:
            for run in await self._store.active_runs():
                await self._recovery.recover(run)
        await self.scheduler.first_round(min(2.0, self._settings.trainer_call_timeout_s))

    @property
    def closing(self) -> bool:
        """True once shutdown began."""
        return self.table.closing

    def begin_shutdown(self) -> None:
        """Refuses new runs and watches and ends open watches with ``ShuttingDown``."""
        self.table.closing = True
        for driver in self.table.drivers():
            driver.log.wake()
        if self.router is not None:
            self.router.wake_watchers()

    async def shutdown(self) -> None:
        """Ends watches (``ShuttingDown``), cancels trainer streams (the trainers keep their
        jobs for the next start), stores every active run as it is and closes the store."""
        self.begin_shutdown()
        if not self._started:
            return  # never started, or already shut down
        self._started = False
        await self.scheduler.stop()
        driven = self.table.drivers()
        await asyncio.gather(*(d.detach() for d in driven), return_exceptions=True)
        if self.router is not None:
            await self.router.stop()
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._settings.shutdown_grace_s)
        await self._store.close()
        await self._connector.close()
        _LOGGER.info("gateway core stopped")

    # -- trainers and health -----------------------------------------------------------------

    def trainers(self) -> list[TrainerReport]:
        """Every configured trainer as of the scheduler's last probe of it (its capabilities,
        GPUs included), in configured order."""
        return self.scheduler.reports()

    @property
    def healthy(self) -> bool:
        """Whether the gateway can take runs: a trainer answers and the store can be written."""
        return self.scheduler.healthy and self._store.writable

    def _store_changed(self, writable: bool) -> None:
        if writable and self.unsaved:
            self._spawn(self.unsaved.save(), "gateway-store-catch-up")
        self._health_changed()

    def _health_changed(self) -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            self._on_health(healthy)
