"""The run registry's lifecycle: start (recovering what a previous gateway left active), shutdown
(leaving active runs and their trainer jobs for the next start), health (a trainer answers and
the store can be written) and the final states a full disk could not take yet.

``LifecycleMixin`` is part of ``RunRegistry`` (``gateway.core.registry``; split off to keep each
module readable in one sitting).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from gateway.core.settings import CoreSettings
from gateway.core.driver import DriverContext, RunDriver
from gateway.core.errors import StoreUnavailable
from gateway.core.follower import Follower
from gateway.core.history import encode_frame
from gateway.core.observer import Observer
from gateway.core.replicas import ReplicaHost, Replicas
from gateway.core.runs import INTERRUPTED_MESSAGE, RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import STORE_MESSAGE, Store, StoreWriteFailed
from gateway.core.trainers import TrainerConnector
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger("gateway.core.registry")


class LifecycleMixin:
    """See the module docstring; ``RunRegistry`` provides these attributes."""

    _config: CoreSettings
    _store: Store
    _connector: TrainerConnector
    _observer: Observer
    _replicas: Replicas
    _shared: bool
    _active: dict[str, RunDriver]
    _ctx: DriverContext
    _followers: dict[str, Follower]
    _adopted: set[Follower]
    _background: set[asyncio.Task[None]]
    _unsaved: dict[str, TrainingRun]
    _on_health: Callable[[bool], None]
    _healthy: bool | None
    _closing: bool
    _started: bool
    _now: Callable[[], int]
    scheduler: Scheduler

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the store and the trainer probes and recovers the runs a previous gateway
        left active (see the module docstring)."""
        await self._store.start()
        self._store.on_writable(self._store_changed)
        self._started = True
        self.scheduler.start()
        counts = await self._store.count_by_state()
        self._observer.runs_loaded({state.name: n for state, n in counts.items()})
        if self._shared:
            # Queues candidates and takes runs over (gateway.core.replicas); RunRegistry is the
            # host (its ReplicaHostMixin part).
            await self._replicas.start(cast(ReplicaHost, self))
        else:
            for run in await self._store.active_runs():
                await self._recover(run)
        await self.scheduler.first_round(min(2.0, self._config.trainer_call_timeout_s))

    async def _recover(self, run: TrainingRun) -> None:
        driver = RunDriver(run, self._ctx)
        self._active[run.id] = driver
        self._observer.run_recovered(run.id, run.state.name)
        if run.state is RunState.PENDING:
            _LOGGER.info(
                "run %s: queued again after a gateway restart",
                run.id,
                extra={"run_id": run.id, "event": "requeued"},
            )
            self.scheduler.enqueue(driver)
            return
        frames = await self._store.read_episodes(run.id, 1, run.episode)
        if len(frames) != run.episode:
            _LOGGER.error(
                "run %s: %d of %d episodes in the store; cannot continue it",
                run.id,
                len(frames),
                run.episode,
                extra={"run_id": run.id},
            )
            run.fail(INTERRUPTED_MESSAGE, self._now())
            await driver.finalize()
            return
        if frames and episode_pb2.Episode.FromString(frames[-1]).done:
            # The done episode was committed before the gateway stopped: the run is complete.
            driver.log.frames.extend(_frames(frames))
            run.complete(self._now())
            await driver.finalize()
            return
        _LOGGER.info(
            "run %s: re-attaching to its job on %s after episode %d (%s)",
            run.id,
            run.trainer,
            run.episode,
            run.state.name,
            extra={"run_id": run.id, "event": "reattaching"},
        )
        driver.reattach(_frames(frames))

    @property
    def closing(self) -> bool:
        """True once shutdown began."""
        return self._closing

    def begin_shutdown(self) -> None:
        """Refuses new runs and watches and ends open watches with ``ShuttingDown``."""
        self._closing = True
        for driver in self._active.values():
            driver.log.wake()
        for follower in [*self._followers.values(), *self._adopted]:
            follower.log.wake()

    async def shutdown(self) -> None:
        """Ends watches (``ShuttingDown``), cancels trainer streams (the trainers keep their
        jobs for the next start), stores every active run as it is and closes the store."""
        self.begin_shutdown()
        if not self._started:
            return  # never started, or already shut down
        self._started = False
        await self.scheduler.stop()
        owned = [d for d in self._active.values() if d.owned]
        await asyncio.gather(*(d.detach() for d in owned), return_exceptions=True)
        await self._replicas.stop([d.run.id for d in owned])
        for follower in [*self._followers.values(), *self._adopted]:
            await follower.stop()
        if self._background:
            await asyncio.wait(list(self._background), timeout=self._config.shutdown_grace_s)
        await self._store.close()
        await self._connector.close()
        _LOGGER.info("gateway core stopped")

    def _spawn(self, task: asyncio.Task[None]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _ended(self, driver: RunDriver) -> None:
        if self._active.get(driver.run.id) is driver:
            del self._active[driver.run.id]
        self.scheduler.dequeue(driver)

    # -- health ------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Whether the gateway can take runs: a trainer answers and the store can be written."""
        return self.scheduler.healthy and self._store.writable

    def _trainers_changed(self, healthy: bool) -> None:
        self._health_changed()

    def _store_changed(self, writable: bool) -> None:
        if writable and self._unsaved:
            self._spawn(asyncio.create_task(self._save_unsaved(), name="gateway-store-catch-up"))
        self._health_changed()

    def _health_changed(self) -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            self._on_health(healthy)

    def _remember_unsaved(self, run: TrainingRun) -> None:
        self._unsaved[run.id] = run

    async def _save_unsaved(self) -> None:
        """Writes the final states the store could not take while it was not writable."""
        for run_id, run in list(self._unsaved.items()):
            try:
                await self._store.update_run(run)
            except StoreWriteFailed:
                return  # not writable after all: the next recovery tries again
            if self._unsaved.get(run_id) is run:
                del self._unsaved[run_id]
            _LOGGER.info(
                "run %s: its final state %s is saved now",
                run_id,
                run.state.name,
                extra={"run_id": run_id},
            )

    def _require_writable(self, what: str) -> None:
        if not self._store.writable:
            raise StoreUnavailable(f"cannot {what}: {STORE_MESSAGE}")


def _frames(data: list[bytes]) -> list[bytes]:
    return [encode_frame(d) for d in data]
