"""The run registry's side of gateway replicas (``gateway.core.replicas``): candidates, claims,
takeovers, lost runs, followers and controls of runs another replica drives.

``ReplicaHostMixin`` is part of ``RunRegistry`` (split off to keep each module readable); with
one gateway (SQLite) none of it runs but ``_lost`` and ``_view``, which then do nothing new.

- A *candidate* is the ``RunDriver`` of a PENDING run no replica owns (``owned`` False), queued
  like any other; it claims the run when the scheduler places it (``_claim``), and a control
  claims it first (``_claim_candidate``), so a replica only ever changes runs it owns.
- A run this replica took over is recovered as on start (``adopt``); one whose lease it lost
  is abandoned (``lose``), its watchers handed to a ``Follower`` of the same log.
- A control of a run another replica drives is checked against the stored run, recorded for
  the owner and answered once applied (``_control_elsewhere``); the owner applies what others
  recorded in ``apply_controls``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import NoReturn

from gateway.core.settings import CoreSettings
from gateway.core.driver import DriverContext, RunDriver
from gateway.core.errors import GatewayError, IllegalTransition, RunNotFound, StoreUnavailable
from gateway.core.follower import Follower
from gateway.core.replicas import CONTROL_WAIT_S, Replicas
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import NotOwner, Store, StoreWriteFailed

_LOGGER = logging.getLogger(__name__)

#: How each control names itself in errors ("cannot pause run 'x': it is DONE").
VERBS = {"pause": "pause", "resume": "resume", "stop": "stop", "speed": "change the speed of"}
#: The state each control asks for.
DESIRED = {"pause": RunState.PAUSED, "resume": RunState.RUNNING, "stop": RunState.STOPPED}


def _refuse(run: TrainingRun, action: str, speed: float) -> NoReturn:
    """Raises the error a control of ``run`` gets where it does not fit its state."""
    if action == "speed":
        run.snapshot().set_speed(speed)  # InvalidRequest first, then the finished state
    raise IllegalTransition(
        f"cannot {VERBS[action]} run {run.id!r}: it is {run.state.name}", run.id
    )


def _elsewhere_detail(run: TrainingRun, candidate: RunDriver | None) -> str:
    """``state_detail`` of an active run this replica does not drive."""
    if run.state is RunState.PENDING:
        if candidate is not None:
            return candidate.pending_detail
        return "waiting for a gateway replica to place it"
    where = f" on {run.trainer}" if run.trainer else ""
    return f"{run.state.name.lower()}{where}, driven by another gateway replica"


class ReplicaHostMixin:
    """See the module docstring; ``RunRegistry`` provides these attributes."""

    _config: CoreSettings
    _store: Store
    _replicas: Replicas
    _shared: bool
    _active: dict[str, RunDriver]
    _ctx: DriverContext
    _followers: dict[str, Follower]
    _adopted: set[Follower]
    _applying: dict[str, bool]
    _claiming: set[str]
    _successors: weakref.WeakKeyDictionary[RunDriver, Follower]
    _clock: Callable[[], float]
    _now: Callable[[], int]
    scheduler: Scheduler

    async def _recover(self, run: TrainingRun) -> None:
        raise NotImplementedError

    # -- ReplicaHost ---------------------------------------------------------------------------

    def owned_runs(self) -> list[str]:
        """The runs this replica drives (and PENDING runs it claimed)."""
        return [run_id for run_id, d in self._active.items() if d.owned and not d.finalizing]

    def sync_candidates(self, runs: list[TrainingRun]) -> None:
        """Queues the PENDING runs no replica owns that are new here, drops the others."""
        unowned = {run.id for run in runs}
        for run_id, driver in list(self._active.items()):
            if not driver.owned and run_id not in unowned:
                self.withdraw(run_id)
        for run in runs:
            if run.id not in self._active:
                self._candidate(run)

    def withdraw(self, run_id: str) -> None:
        """Drops a candidate another replica claimed (not one being claimed here)."""
        driver = self._active.get(run_id)
        if driver is None or driver.owned or driver.task is not None:
            return
        if run_id in self._claiming:
            return
        del self._active[run_id]
        self.scheduler.dequeue(driver)

    async def adopt(self, run: TrainingRun) -> None:
        """Recovers a run this replica took over, as a restarted gateway would."""
        existing = self._active.get(run.id)
        if existing is not None:
            if existing.owned:
                return
            del self._active[run.id]
        await self._recover(run)

    async def lose(self, run_id: str) -> None:
        """Abandons a run whose lease this replica lost."""
        driver = self._active.get(run_id)
        if driver is not None and driver.owned:
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

    async def _apply_once(self, run_id: str) -> None:
        leases = self._replicas.leases
        driver = self._active.get(run_id)
        if leases is None or driver is None or not driver.owned:
            return
        control = await leases.control(run_id)
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
            if control.state is RunState.PAUSED:
                await driver.pause()
            elif control.state is RunState.RUNNING:
                await driver.resume()
            elif control.state is RunState.STOPPED:
                await driver.stop()
        except NotOwner:
            await driver.abandon()  # its new owner applies them
            return
        except GatewayError as exc:
            error = str(exc)
        await leases.applied(run_id, control.seq, error)

    # -- candidates and claims -----------------------------------------------------------------

    def _candidate(self, run: TrainingRun) -> RunDriver:
        driver = RunDriver(run, self._ctx)
        driver.owned = False
        self._active[run.id] = driver
        self.scheduler.enqueue(driver)
        return driver

    @staticmethod
    def _take(driver: RunDriver, claimed: TrainingRun) -> None:
        """A claimed candidate takes what other replicas changed meanwhile (its speed)."""
        driver.run.speed = claimed.speed
        driver.pacer.set_speed(claimed.speed)
        driver.owned = True

    async def _claim(self, driver: RunDriver) -> bool:
        """``DriverContext.claim``: claims a placed candidate's run for this replica."""
        leases = self._replicas.leases
        assert leases is not None
        try:
            claimed = await leases.claim_pending(driver.run.id)
        except (StoreUnavailable, StoreWriteFailed) as exc:
            _LOGGER.warning("run %s: cannot claim it: %s", driver.run.id, exc)
            return False  # queued again with the next resync
        if claimed is None:
            return False
        self._take(driver, claimed)
        return True

    async def _claim_candidate(self, run_id: str, driver: RunDriver | None) -> RunDriver | None:
        """The driver of a PENDING run no replica owns, claimed here for a control; None when
        another replica drives the run (or it is not active)."""
        leases = self._replicas.leases
        assert leases is not None
        if driver is None:
            run = await self._store.get_run(run_id)
            if run is None:
                raise RunNotFound(run_id)
            if run.state is not RunState.PENDING:
                return None
            driver = self._active.get(run_id) or self._candidate(run)
            if driver.owned:
                return driver if not driver.finalizing else None
        self._claiming.add(run_id)
        try:
            claimed = await leases.claim_pending(run_id)
        finally:
            self._claiming.discard(run_id)
        if claimed is None:
            self.withdraw(run_id)
            return None
        if self._active.get(run_id) is not driver:
            return None  # it went meanwhile; its state is read again from the store
        self._take(driver, claimed)
        return driver

    # -- lost runs and followers ---------------------------------------------------------------

    def _lost(self, driver: RunDriver) -> None:
        """``DriverContext.on_lost``: the driver abandoned its run to another replica."""
        run_id = driver.run.id
        if self._active.get(run_id) is driver:
            del self._active[run_id]
        self.scheduler.dequeue(driver)
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

    def _view(self, driver: RunDriver) -> Callable[[], TrainingRun]:
        """The run as a watcher of ``driver``'s log sees it: the driver's, or, once it lost
        the run, that of the follower that took its log over."""

        def view() -> TrainingRun:
            follower = self._successors.get(driver) if not driver.owned else None
            return follower.snapshot() if follower is not None else driver.snapshot()

        return view

    def _follow(self, run: TrainingRun) -> Follower:
        """The follower of a run another replica drives (made for its first watcher)."""
        follower = self._followers.get(run.id)
        if follower is None or follower.task.done():
            follower = Follower(
                run,
                self._store,
                self._follower_ended,
                min_wake_interval=self._config.live_coalesce_s,
                clock=self._clock,
            )
            self._followers[run.id] = follower
        return follower

    def _follower_ended(self, follower: Follower) -> None:
        if self._followers.get(follower.run_id) is follower:
            del self._followers[follower.run_id]
        self._adopted.discard(follower)

    # -- controls of runs driven elsewhere -----------------------------------------------------

    async def _control_elsewhere(self, run_id: str, action: str, speed: float) -> TrainingRun:
        """A control of a run another replica drives (see the module docstring).

        Raises:
            RunNotFound, IllegalTransition, InvalidRequest: as on the owner.
        """
        leases = self._replicas.leases
        assert leases is not None
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        probe = run.snapshot()
        if action == "pause":
            changes = probe.pause()
        elif action == "resume":
            changes = probe.resume()
        elif action == "stop":
            probe.stop(self._now())
            changes = True
        else:
            probe.set_speed(speed)
            changes = True
        if not changes:
            return self._elsewhere(run)
        requested = await leases.request(
            run_id, DESIRED.get(action), probe.speed if action == "speed" else None
        )
        if requested is None:  # it finished meanwhile: refused as for a finished run
            return await self._control_elsewhere(run_id, action, speed)
        if not requested.owned:
            self._replicas.scan_now()  # its replica is gone: take it over (and apply this)
        control = await self._replicas.wait_applied(run_id, requested.seq, CONTROL_WAIT_S)
        if control is not None and control.error and control.applied == requested.seq:
            raise IllegalTransition(control.error, run_id)
        driver = self._active.get(run_id)
        if driver is not None and driver.owned:
            return driver.snapshot()  # taken over here meanwhile
        current = await self._store.get_run(run_id)
        if current is None:
            raise RunNotFound(run_id)
        return self._elsewhere(current)

    def _elsewhere(self, run: TrainingRun) -> TrainingRun:
        current = run.snapshot()
        if current.state.active:
            current.state_detail = _elsewhere_detail(current, self._active.get(run.id))
        return current
