"""Which runs this gateway drives: all of them (``SoloOwnership``, one gateway on its own
database), or those whose lease it holds (``LeasedOwnership``, gateway replicas sharing one
PostgreSQL database; ``gateway.core.replicas`` coordinates the leases).

The registry asks its ``Ownership`` everything that depends on it: whether a new run is driven
at once, how a control reaches a run not driven here, what such a run looks like, what its
watchers follow, what happens to a driver that lost its run, and what to start and stop.

With leases:

- A *candidate* is the ``RunDriver`` of a PENDING run no replica owns (``owned`` False), queued
  like any other; it claims the run when the scheduler places it (``claim``), and a control
  claims it first, so a replica only ever changes runs it owns.
- A run this replica took over is recovered as on start (``adopt``); one whose lease it lost
  is abandoned (``lose``), its watchers handed to a ``Follower`` of the same log.
- A control of a run another replica drives is checked against the stored run, recorded for
  the owner and answered once applied (``forward``); the owner applies what others recorded
  in ``apply_controls``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.core.controls import Action, apply, refuse, try_on
from gateway.core.driver import RunDriver
from gateway.core.errors import GatewayError, IllegalTransition, RunNotFound, StoreUnavailable
from gateway.core.follower import Follower
from gateway.core.replicas import CONTROL_WAIT_S, SharedReplicas
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import NotOwner, Store, StoreWriteFailed
from gateway.core.table import RunTable

_LOGGER = logging.getLogger(__name__)


class Ownership(Protocol):
    """How the registry's runs are divided between gateways (see the module docstring)."""

    #: Whether a new run's driver drives it at once (else it is a candidate, claimed when
    #: placed).
    owns_new_runs: bool

    async def start(self, recover: Callable[[TrainingRun], Awaitable[None]]) -> None:
        """Brings back the active runs this gateway drives now, each through ``recover``."""
        ...

    async def stop(self) -> None:
        """Stops: followers end, and the runs driven here are handed on (leases released)."""
        ...

    def wake_watchers(self) -> None:
        """Wakes the watchers of runs driven elsewhere (shutdown)."""
        ...

    async def claim(self, driver: RunDriver) -> bool:
        """Claims a placed candidate's run; False when another replica has it."""
        ...

    def lost(self, driver: RunDriver) -> None:
        """A driver abandoned its run to another replica."""
        ...

    async def control_target(
        self, run_id: str, driver: RunDriver | None, action: Action, speed: float
    ) -> RunDriver | None:
        """The driver a control of a run not driven here acts on (a claimed candidate), or
        None when the control goes to the run's owner.

        Raises:
            RunNotFound, IllegalTransition, InvalidRequest: the control does not fit.
        """
        ...

    async def forward(self, run_id: str, action: Action, speed: float) -> TrainingRun:
        """Hands a control to the replica that drives the run; returns the run once applied.

        Raises:
            RunNotFound, IllegalTransition, InvalidRequest: as on the owner.
        """
        ...

    def elsewhere(self, run: TrainingRun) -> TrainingRun:
        """A stored active run not driven here, with its ``state_detail``."""
        ...

    def view(self, driver: RunDriver) -> Callable[[], TrainingRun]:
        """The run as the watchers of ``driver``'s log see it (it may lose the run)."""
        ...

    def follow(self, run: TrainingRun) -> Follower | None:
        """A follower of an active run driven elsewhere, held until ``unfollow``; None where
        every active run is driven here."""
        ...

    def unfollow(self, follower: Follower) -> None:
        """A watcher let go of its follower."""
        ...


class SoloOwnership:
    """One gateway drives every run of its database.

    Args:
        store: The store (a recovered gateway reads its active runs).
        table: The active runs.
        scheduler: The placement queue.
    """

    owns_new_runs = True

    def __init__(self, store: Store, table: RunTable, scheduler: Scheduler) -> None:
        self._store = store
        self._table = table
        self._scheduler = scheduler

    async def start(self, recover: Callable[[TrainingRun], Awaitable[None]]) -> None:
        """Recovers every active run of the store."""
        for run in await self._store.active_runs():
            await recover(run)

    async def stop(self) -> None:
        """Nothing to hand on."""

    def wake_watchers(self) -> None:
        """No run is driven elsewhere."""

    async def claim(self, driver: RunDriver) -> bool:
        """Every run is this gateway's."""
        return True

    def lost(self, driver: RunDriver) -> None:
        """A store that fences writes refused one: the run leaves the active runs."""
        self._table.remove(driver)
        self._scheduler.dequeue(driver)

    async def control_target(
        self, run_id: str, driver: RunDriver | None, action: Action, speed: float
    ) -> RunDriver | None:
        """A run not driven here is finished (or was never there)."""
        run = driver.run if driver is not None else await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        refuse(run, action, speed)

    async def forward(self, run_id: str, action: Action, speed: float) -> TrainingRun:
        """No other gateway drives it: refused as for a finished run."""
        return await self.control_target(run_id, None, action, speed)  # type: ignore[return-value]

    def elsewhere(self, run: TrainingRun) -> TrainingRun:
        """(Never the case here.)"""
        return run

    def view(self, driver: RunDriver) -> Callable[[], TrainingRun]:
        """The driver's own run."""
        return driver.snapshot

    def follow(self, run: TrainingRun) -> Follower | None:
        """Nothing to follow: an active run not in the table is finishing."""
        return None

    def unfollow(self, follower: Follower) -> None:
        """(Never called here.)"""


def _elsewhere_detail(run: TrainingRun, candidate: RunDriver | None) -> str:
    """``state_detail`` of an active run this replica does not drive."""
    if run.state is RunState.PENDING:
        if candidate is not None:
            return candidate.pending_detail
        return "waiting for a gateway replica to place it"
    trainers = ", ".join(run.trainers) or run.trainer
    where = f" on {trainers}" if trainers else ""
    return f"{run.state.name.lower()}{where}, driven by another gateway replica"


class LeasedOwnership:
    """This replica drives the runs whose lease it holds (see the module docstring); it is the
    ``ReplicaHost`` of its ``SharedReplicas``.

    Args:
        replicas: The coordinator of leases with the other replicas.
        store: The shared store.
        table: The active runs (and candidates).
        scheduler: The placement queue.
        make_driver: A new driver of a run (not owned).
        live_coalesce_s: The live wake window of followers' logs.
        clock: Monotonic seconds.
        now: Wall time in Unix nanoseconds.
    """

    owns_new_runs = False

    def __init__(
        self,
        replicas: SharedReplicas,
        store: Store,
        table: RunTable,
        scheduler: Scheduler,
        make_driver: Callable[[TrainingRun, bool], RunDriver],
        live_coalesce_s: float,
        clock: Callable[[], float],
        now: Callable[[], int],
    ) -> None:
        self._replicas = replicas
        self._leases = replicas.leases
        self._store = store
        self._table = table
        self._scheduler = scheduler
        self._make_driver = make_driver
        self._live_coalesce_s = live_coalesce_s
        self._clock = clock
        self._now = now
        self._recover: Callable[[TrainingRun], Awaitable[None]] | None = None
        # Watched runs another replica drives: the followers new watchers join, and those that
        # took over the log of a driver that lost its run.
        self._followers: dict[str, Follower] = {}
        self._adopted: set[Follower] = set()
        self._successors: weakref.WeakKeyDictionary[RunDriver, Follower] = (
            weakref.WeakKeyDictionary()
        )
        self._applying: dict[str, bool] = {}  # run id -> controls arrived while applying
        self._claiming: set[str] = set()  # candidates a control claims now

    # -- start and stop ------------------------------------------------------------------------

    async def start(self, recover: Callable[[TrainingRun], Awaitable[None]]) -> None:
        """Queues the candidates and takes over the runs without a live lease."""
        self._recover = recover
        await self._replicas.start(self)

    async def stop(self) -> None:
        """Ends the followers and releases the leases on the runs driven here (after they were
        stored), so another replica takes them over at once."""
        await self._replicas.stop([d.run.id for d in self._table.owned()])
        for follower in [*self._followers.values(), *self._adopted]:
            await follower.stop()

    def wake_watchers(self) -> None:
        """Wakes the watchers of the followers (shutdown)."""
        for follower in [*self._followers.values(), *self._adopted]:
            follower.log.wake()

    # -- ReplicaHost ---------------------------------------------------------------------------

    def owned_runs(self) -> list[str]:
        """The runs this replica drives (and PENDING runs it claimed)."""
        return [d.run.id for d in self._table.owned() if not d.finalizing]

    def sync_candidates(self, runs: list[TrainingRun]) -> None:
        """Queues the PENDING runs no replica owns that are new here, drops the others."""
        unowned = {run.id for run in runs}
        for driver in self._table.drivers():
            if not driver.owned and driver.run.id not in unowned:
                self.withdraw(driver.run.id)
        for run in runs:
            if self._table.get(run.id) is None:
                self._candidate(run)

    def withdraw(self, run_id: str) -> None:
        """Drops a candidate another replica claimed (not one being claimed here)."""
        driver = self._table.get(run_id)
        if driver is None or driver.owned or driver.task is not None:
            return
        if run_id in self._claiming:
            return
        self._table.remove(driver)
        self._scheduler.dequeue(driver)

    async def adopt(self, run: TrainingRun) -> None:
        """Recovers a run this replica took over, as a restarted gateway would."""
        existing = self._table.get(run.id)
        if existing is not None:
            if existing.owned:
                return
            self._table.remove(existing)
        assert self._recover is not None
        await self._recover(run)

    async def lose(self, run_id: str) -> None:
        """Abandons a run whose lease this replica lost."""
        driver = self._table.driving(run_id)
        if driver is not None:
            await driver.abandon()

    def changed(self, run_id: str) -> None:
        """Wakes the followers of a run that changed in the store."""
        follower = self._followers.get(run_id)
        if follower is not None:
            follower.wake()
        for adopted in self._adopted:
            if adopted.run_id == run_id:
                adopted.wake()

    async def apply_controls(self, run_id: str) -> None:
        """Applies the controls other replicas recorded for a run this replica owns, and
        records that it did (or why it could not)."""
        if run_id in self._applying:
            self._applying[run_id] = True  # the running application goes round again
            return
        self._applying[run_id] = False
        try:
            while True:
                await self._apply_once(run_id)
                if not self._applying[run_id]:
                    return
                self._applying[run_id] = False
        finally:
            del self._applying[run_id]

    async def refresh_metadata(self, run_id: str) -> None:
        """Another replica changed the display name or labels of a run driven here: the
        driver's run takes them from the store (``update_run`` never writes them)."""
        driver = self._table.driving(run_id)
        if driver is None:
            return
        stored = await self._store.get_run(run_id)
        if stored is not None:
            driver.take_metadata(stored.display_name, stored.labels)

    async def _apply_once(self, run_id: str) -> None:
        driver = self._table.driving(run_id)
        if driver is None:
            return
        control = await self._leases.control(run_id)
        if control is None or control.seq <= control.applied:
            return
        error = ""
        try:
            if driver.finalizing:
                raise IllegalTransition(
                    f"cannot change run {run_id!r}: it is {driver.run.state.name}", run_id
                )
            if control.speed is not None:
                await driver.set_speed(control.speed)
            for action in (Action.PAUSE, Action.RESUME, Action.STOP):
                if control.state is action.desired:
                    await apply(driver, action)
        except NotOwner:
            await driver.abandon()  # its new owner applies them
            return
        except GatewayError as exc:
            error = str(exc)
        await self._leases.applied(run_id, control.seq, error)

    # -- candidates and claims -----------------------------------------------------------------

    def _candidate(self, run: TrainingRun) -> RunDriver:
        driver = self._make_driver(run, False)
        self._table.add(driver)
        self._scheduler.enqueue(driver)
        return driver

    async def claim(self, driver: RunDriver) -> bool:
        """Claims a placed candidate's run for this replica."""
        try:
            claimed = await self._leases.claim_pending(driver.run.id)
        except (StoreUnavailable, StoreWriteFailed) as exc:
            _LOGGER.warning("run %s: cannot claim it: %s", driver.run.id, exc)
            return False  # queued again with the next resync
        if claimed is None:
            return False
        driver.take_speed(claimed.speed)  # what other replicas changed meanwhile
        driver.owned = True
        return True

    async def control_target(
        self, run_id: str, driver: RunDriver | None, action: Action, speed: float
    ) -> RunDriver | None:
        """A PENDING run no replica owns is claimed here for the control; any other run not
        driven here gets the control through its owner (None)."""
        if driver is not None and driver.owned:  # finishing here
            refuse(driver.run, action, speed)
        if driver is None:
            run = await self._store.get_run(run_id)
            if run is None:
                raise RunNotFound(run_id)
            if run.state is not RunState.PENDING:
                return None
            driver = self._table.get(run_id) or self._candidate(run)
            if driver.owned:
                return driver if not driver.finalizing else None
        self._claiming.add(run_id)
        try:
            claimed = await self._leases.claim_pending(run_id)
        finally:
            self._claiming.discard(run_id)
        if claimed is None:
            self.withdraw(run_id)
            return None
        if self._table.get(run_id) is not driver:
            return None  # it went meanwhile; its state is read again from the store
        driver.take_speed(claimed.speed)
        driver.owned = True
        return driver

    # -- lost runs and followers ---------------------------------------------------------------

    def lost(self, driver: RunDriver) -> None:
        """The driver abandoned its run: its watchers go on with a follower of its log."""
        run_id = driver.run.id
        self._table.remove(driver)
        self._scheduler.dequeue(driver)
        # (Its task is already cancelled here: whether it was driving shows in its state.)
        if driver.run.state is RunState.PENDING and not driver.log.watchers:
            return  # a candidate another replica claimed first
        _LOGGER.info(
            "run %s: another gateway replica drives it now",
            run_id,
            extra={"run_id": run_id, "event": "lost"},
        )
        if driver.log.watchers and not driver.log.closed:
            follower = Follower(
                driver.snapshot(),
                self._store,
                self._follower_ended,
                log=driver.log,
                clock=self._clock,
            )
            self._adopted.add(follower)
            self._successors[driver] = follower

    def view(self, driver: RunDriver) -> Callable[[], TrainingRun]:
        """The driver's run, or, once it lost the run, that of the follower of its log."""

        def view() -> TrainingRun:
            follower = self._successors.get(driver) if not driver.owned else None
            return follower.snapshot() if follower is not None else driver.snapshot()

        return view

    def follow(self, run: TrainingRun) -> Follower | None:
        """The follower of an active run another replica drives (made for its first
        watcher)."""
        if not run.state.active:
            return None
        follower = self._followers.get(run.id)
        if follower is None or follower.task.done():
            follower = Follower(
                run,
                self._store,
                self._follower_ended,
                min_wake_interval=self._live_coalesce_s,
                clock=self._clock,
            )
            self._followers[run.id] = follower
        follower.users += 1
        return follower

    def unfollow(self, follower: Follower) -> None:
        """A watcher let go: the last one gone ends the follower."""
        follower.users -= 1
        if follower.users == 0:
            follower.wake()

    def _follower_ended(self, follower: Follower) -> None:
        if self._followers.get(follower.run_id) is follower:
            del self._followers[follower.run_id]
        self._adopted.discard(follower)

    # -- controls of runs driven elsewhere -----------------------------------------------------

    async def forward(self, run_id: str, action: Action, speed: float) -> TrainingRun:
        """Records the control for the run's owner and answers once it applied it (see the
        module docstring)."""
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        changes, probe = try_on(run, action, speed, self._now())
        if not changes:
            return self.elsewhere(run)
        requested = await self._leases.request(
            run_id, action.desired, probe.speed if action is Action.SPEED else None
        )
        if requested is None:  # it finished meanwhile: refused as for a finished run
            return await self.forward(run_id, action, speed)
        if not requested.owned:
            self._replicas.scan_now()  # its replica is gone: take it over (and apply this)
        control = await self._replicas.wait_applied(run_id, requested.seq, CONTROL_WAIT_S)
        if control is not None and control.error and control.applied == requested.seq:
            raise IllegalTransition(control.error, run_id)
        driver = self._table.driving(run_id)
        if driver is not None:
            return driver.snapshot()  # taken over here meanwhile
        current = await self._store.get_run(run_id)
        if current is None:
            raise RunNotFound(run_id)
        return self.elsewhere(current)

    def elsewhere(self, run: TrainingRun) -> TrainingRun:
        """The stored run with the ``state_detail`` of a run driven by another replica."""
        current = run.snapshot()
        if current.state.active:
            current.state_detail = _elsewhere_detail(current, self._table.get(run.id))
        return current
