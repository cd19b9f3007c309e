"""The replica router: with gateway replicas sharing one PostgreSQL database, what reaches runs
this replica does not drive. The core (``RunRegistry``) hosts only the runs it drives;
``promote`` (a takeover, a claimed PENDING run) is their one way in and ``demote`` (the lease
lost) their one way out. One gateway on its own database has no router: it drives every run.

- A *candidate* is a PENDING run no replica owns. It waits in the scheduler's queue here as a
  ``Candidate``; when the scheduler places it, the router claims its lease and promotes it
  with that placement, or gives the placement back. A control of a candidate claims it first,
  so a replica only ever changes runs it owns.
- A run whose lease expired is taken over (``adopt``: recovered as on start); one whose lease
  this replica lost is demoted (its driver abandons it) and its watchers go on with a
  ``Follower`` of the same log.
- A control of a run another replica drives is checked against the stored run, recorded for
  the owner and answered once applied (``forward``); the owner applies what others recorded
  (``apply_controls``). Watchers of such a run follow it in the store (``follow``).

``SharedReplicas`` (``gateway.core.replicas``) coordinates the leases and calls the router as
its ``ReplicaHost``.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable

from gateway.core.controls import Action, apply, try_on
from gateway.core.driver import RunDriver
from gateway.core.errors import GatewayError, IllegalTransition, RunNotFound, StoreUnavailable
from gateway.core.follower import Follower
from gateway.core.placement import Placement, rewards_needed, slots_needed
from gateway.core.replicas import CONTROL_WAIT_S, SharedReplicas
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import NotOwner, Store, StoreWriteFailed
from gateway.core.table import RunTable
from trainwire.contract import task_kind

_LOGGER = logging.getLogger(__name__)


class Candidate:
    """A PENDING run no replica owns, in this replica's queue (see the module docstring).

    Args:
        run: The run as stored.
        placed: Called with it and the placement the scheduler gave it (its slots reserved).
    """

    def __init__(self, run: TrainingRun, placed: Callable[[Candidate, Placement], None]) -> None:
        self.run = run
        self.kind = task_kind(run.task)
        self._placed = placed
        self.pending_detail = "waiting for the scheduler"
        #: Placed, its lease being claimed.
        self.claiming = False

    @property
    def seq(self) -> int:
        """Creation order."""
        return self.run.seq

    @property
    def placeable(self) -> bool:
        """Until it is placed."""
        return not self.claiming

    @property
    def slots(self) -> int:
        """Trainer slots its job takes."""
        return slots_needed(self.run.task)

    @property
    def rewards(self) -> tuple[str, ...]:
        """Reward functions its trainers must offer beyond the built-in ones."""
        return rewards_needed(self.run.task)

    def waiting(self, why: str) -> None:
        """The scheduler says what it waits for."""
        self.pending_detail = why

    def dispatch(self, placement: Placement) -> None:
        """Placed: its lease is claimed before its job starts."""
        self.claiming = True
        self._placed(self, placement)


def _elsewhere_detail(run: TrainingRun, candidate: Candidate | None) -> str:
    """``state_detail`` of an active run this replica does not drive."""
    if run.state is RunState.PENDING:
        if candidate is not None:
            return candidate.pending_detail
        return "waiting for a gateway replica to place it"
    trainers = ", ".join(run.trainers) or run.trainer
    where = f" on {trainers}" if trainers else ""
    return f"{run.state.name.lower()}{where}, driven by another gateway replica"


class ReplicaRouter:
    """This replica drives the runs whose lease it holds (see the module docstring); it is the
    ``ReplicaHost`` of its ``SharedReplicas``.

    Args:
        replicas: The coordinator of leases with the other replicas.
        store: The shared store.
        table: The runs driven here.
        scheduler: The placement queue.
        make_driver: A new driver of a run this replica claimed.
        spawn: Keeps a background task referenced until it is done.
        live_coalesce_s: The live wake window of followers' logs.
        clock: Monotonic seconds.
        now: Wall time in Unix nanoseconds.
    """

    def __init__(
        self,
        replicas: SharedReplicas,
        store: Store,
        table: RunTable,
        scheduler: Scheduler,
        make_driver: Callable[[TrainingRun], RunDriver],
        spawn: Callable[[Awaitable[None], str], None],
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
        self._spawn = spawn
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
        self._candidates: dict[str, Candidate] = {}
        #: The claim of a PENDING run in flight (placed, or claimed by a control), shared.
        self._claims: dict[str, asyncio.Task[RunDriver | None]] = {}

    # -- start and stop ------------------------------------------------------------------------

    async def start(self, recover: Callable[[TrainingRun], Awaitable[None]]) -> None:
        """Queues the candidates and takes over the runs without a live lease (each promoted
        through ``recover``)."""
        self._recover = recover
        await self._replicas.start(self)

    async def stop(self) -> None:
        """Ends the followers and releases the leases on the runs driven here (after they were
        stored), so another replica takes them over at once."""
        await self._replicas.stop([d.run.id for d in self._table.drivers()])
        for follower in [*self._followers.values(), *self._adopted]:
            await follower.stop()

    def wake_watchers(self) -> None:
        """Wakes the watchers of the followers (shutdown)."""
        for follower in [*self._followers.values(), *self._adopted]:
            follower.log.wake()

    # -- ReplicaHost ---------------------------------------------------------------------------

    def owned_runs(self) -> list[str]:
        """The runs this replica drives (PENDING runs it claimed included)."""
        return [d.run.id for d in self._table.drivers() if not d.finalizing]

    def sync_candidates(self, runs: list[TrainingRun]) -> None:
        """Queues the PENDING runs no replica owns that are new here, drops the others."""
        unowned = {run.id for run in runs}
        for run_id in [c for c in self._candidates if c not in unowned]:
            self.withdraw(run_id)
        for run in runs:
            self.candidate(run)

    def candidate(self, run: TrainingRun) -> None:
        """Queues a PENDING run no replica owns (one not driven or queued here already)."""
        if self._table.get(run.id) is None and run.id not in self._candidates:
            candidate = Candidate(run, self._placed)
            self._candidates[run.id] = candidate
            self._scheduler.enqueue(candidate)

    def withdraw(self, run_id: str) -> None:
        """Drops a candidate another replica claimed (not one being claimed here)."""
        candidate = self._candidates.get(run_id)
        if candidate is None or candidate.claiming or run_id in self._claims:
            return
        del self._candidates[run_id]
        self._scheduler.dequeue(candidate)

    async def adopt(self, run: TrainingRun) -> None:
        """Takes over a run: recovered as a restarted gateway would (promoted)."""
        if self._table.get(run.id) is not None:
            return
        self.withdraw(run.id)
        assert self._recover is not None
        await self._recover(run)

    async def lose(self, run_id: str) -> None:
        """Another replica holds the run's lease now: its driver abandons it (demoted)."""
        driver = self._table.get(run_id)
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
        driver = self._table.get(run_id)
        if driver is None:
            return
        stored = await self._store.get_run(run_id)
        if stored is not None:
            driver.take_metadata(stored.display_name, stored.labels)

    async def _apply_once(self, run_id: str) -> None:
        driver = self._table.get(run_id)
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

    # -- candidates: claimed and promoted ------------------------------------------------------

    def _placed(self, candidate: Candidate, placement: Placement) -> None:
        self._spawn(self._start_placed(candidate, placement), f"gateway-claim-{candidate.run.id}")

    async def _start_placed(self, candidate: Candidate, placement: Placement) -> None:
        """A placed candidate: claimed and promoted, its job dispatched where it was placed;
        or, claimed elsewhere first, its placement given back."""
        driver = await self._claim(candidate.run.id)
        if driver is None or not driver.placeable:
            for share in placement.shares:  # the reservations end
                self._scheduler.started(share.address, share.processes)
            return
        driver.dispatch(placement)

    def _claim(self, run_id: str) -> asyncio.Task[RunDriver | None]:
        """The claim of a PENDING run (one at a time per run): its driver once this replica
        owns it, else None."""
        claim = self._claims.get(run_id)
        if claim is None:
            claim = asyncio.ensure_future(self._promote_claimed(run_id))
            self._claims[run_id] = claim
            claim.add_done_callback(lambda _: self._claims.pop(run_id, None))
        return claim

    async def _promote_claimed(self, run_id: str) -> RunDriver | None:
        try:
            claimed = await self._leases.claim_pending(run_id)
        except (StoreUnavailable, StoreWriteFailed) as exc:
            _LOGGER.warning("run %s: cannot claim it: %s", run_id, exc)
            claimed = None  # queued again with the next resync
        candidate = self._candidates.pop(run_id, None)
        if candidate is not None:
            self._scheduler.dequeue(candidate)
        if claimed is None:
            return None
        driver = self._table.get(run_id)
        if driver is None:  # promoted: as stored when claimed (speed changes included)
            driver = self._make_driver(claimed)
            self._table.add(driver)
        return driver

    async def control_target(self, run_id: str) -> RunDriver | None:
        """The driver a control of a run not driven here acts on: a PENDING run no replica
        owns is claimed and promoted (and queued here); None when the control goes to the
        run's owner.

        Raises:
            RunNotFound: no such run.
        """
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        if run.state is not RunState.PENDING:
            return None
        driver = await self._claim(run_id)
        if driver is not None and driver.placeable:
            self._scheduler.enqueue(driver)
        return driver

    # -- demoted runs and followers ------------------------------------------------------------

    def demoted(self, driver: RunDriver) -> None:
        """A driver abandoned its run to another replica: its watchers go on with a follower
        of its log."""
        run_id = driver.run.id
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
            follower = self._successors.get(driver)
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
        driver = self._table.get(run_id)
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
            current.state_detail = _elsewhere_detail(current, self._candidates.get(run.id))
        return current
