"""Gateway replicas: how the gateways that share one PostgreSQL database divide the runs.

``SharedReplicas`` coordinates a replica with the others through the database
(``gateway.core.store.postgres_leases``); its host is the replica's ``ReplicaRouter``
(``gateway.core.router``). A single gateway on its own database needs none of this.

- **Ownership.** Each active run is driven by exactly one replica, its *owner*, which holds a
  lease on it (``runs.owner``, ``runs.lease_until`` on the database's clock). The owner renews
  its leases every ``lease_s / 3`` seconds; a replica that finds a lease gone stops driving that
  run without cancelling its trainer job (``RunDriver.abandon``). Every write of a run is fenced
  by its owner (``gateway.core.store.postgres``), so a replica that stalled past its lease
  writes nothing more.
- **Placement.** Every replica queues every PENDING run no replica owns (*candidates*, FIFO by
  creation), and claims one atomically only when its scheduler places it on a trainer: two
  replicas that place the same run race in one ``UPDATE``, and the loser drops it. A run the
  trainer refuses as busy (``SLOTS_BUSY``) is released to the queue of every replica again.
- **Failover.** Once a RUNNING or PAUSED run's lease has expired (its owner died) or was
  released (its owner stopped), a replica takes it over: it claims the run and re-attaches to
  the trainer's job after the last committed episode, exactly as a restarted gateway does
  (``gateway.core.recovery``). Replicas look for such runs every ``SCAN_S`` and at once when a
  replica announces a release.
- **Controls.** A control sent to a replica that does not own the run is validated against the
  stored run (the same errors as on the owner), recorded as the run's desired state or speed,
  and announced; the owner applies it at once (``apply_controls``) and records that it did;
  the requesting replica answers with the run once applied (it waits up to
  ``CONTROL_WAIT_S``). A control of a PENDING run no replica owns is applied by the replica that
  got it, after claiming the run.
- **Wake-ups.** Each replica listens on one channel (``LISTEN trainwire``) for the changes the
  others announce in their commit transactions; the periodic scans are the safety net.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gateway.core.runs import TrainingRun
from gateway.core.store.postgres import PostgresStore
from gateway.core.store.postgres_leases import Control, Leases, notifications

_LOGGER = logging.getLogger(__name__)

#: Seconds between two looks for runs without a live lease (and two renewals at most).
SCAN_S = 1.0
#: Seconds between two full reads of the PENDING runs no replica owns (the safety net of the
#: ``c`` and ``p`` notifications).
PENDING_RESYNC_S = 5.0
#: How long a replica waits for another one to apply a control before it answers (a control
#: that meets a lost lease waits for a take-over, which takes seconds on a loaded machine).
CONTROL_WAIT_S = 10.0
#: Seconds before the notification connection is opened again after it broke.
RECONNECT_S = 1.0


class ReplicaHost(Protocol):
    """What the coordinator asks of the run registry."""

    def owned_runs(self) -> list[str]:
        """The runs this replica drives (and PENDING runs it claimed)."""
        ...

    def sync_candidates(self, runs: list[TrainingRun]) -> None:
        """``runs`` are the PENDING runs no replica owns: queue the new ones, drop the rest."""
        ...

    def withdraw(self, run_id: str) -> None:
        """Another replica claimed the run: drop it from the queue (unless dispatched)."""
        ...

    async def adopt(self, run: TrainingRun) -> None:
        """This replica took the RUNNING or PAUSED run over: re-attach to its job."""
        ...

    async def lose(self, run_id: str) -> None:
        """This replica's lease on the run is gone: stop driving it."""
        ...

    async def apply_controls(self, run_id: str) -> None:
        """Apply the controls other replicas requested for a run this replica owns."""
        ...

    def changed(self, run_id: str) -> None:
        """The run changed in the store (wakes whoever follows it)."""
        ...

    async def refresh_metadata(self, run_id: str) -> None:
        """Another replica changed the name or labels of a run this replica owns."""
        ...


class SharedReplicas:
    """This replica among the others on one PostgreSQL database (see the module docstring).

    Args:
        store: The shared store (started by the registry before ``start``).
        lease_s: How long a lease holds without renewal.
        clock: Monotonic seconds.
    """

    def __init__(
        self, store: PostgresStore, lease_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self.lease_s = lease_s
        self.replica_id = store.replica_id
        self._clock = clock
        self._leases = Leases(store, lease_s)
        self.leases = self._leases
        self._host: ReplicaHost | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._kick = asyncio.Event()
        self._listening = asyncio.Event()
        self._pending_dirty = True
        self._applied: dict[str, asyncio.Event] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def start(self, host: ReplicaHost) -> None:
        """Listens, queues the unowned PENDING runs, takes over the runs without a live lease
        and starts renewing and scanning."""
        self._host = host
        self._tasks.append(asyncio.create_task(self._listen(), name="gateway-replicas-listen"))
        try:
            async with asyncio.timeout(10):
                await self._listening.wait()
        except TimeoutError:
            _LOGGER.warning("not listening for other replicas yet; scanning meanwhile")
        await self._scan(renew=False)
        self._tasks.append(asyncio.create_task(self._loop(), name="gateway-replicas"))
        _LOGGER.info(
            "gateway replica %s on %s (lease %g s)",
            self.replica_id,
            self._store.where,
            self.lease_s,
        )

    async def stop(self, owned: list[str]) -> None:
        """Stops listening and scanning, and releases the leases on ``owned`` so that another
        replica takes those runs over at once."""
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._tasks = []
        try:
            await self._leases.release(owned)
        except Exception as exc:  # they expire by themselves
            _LOGGER.warning("could not release %d leases (they expire): %s", len(owned), exc)
        else:
            if owned:
                _LOGGER.info("released %d runs to the other replicas", len(owned))

    def scan_now(self) -> None:
        """Looks for runs to take over at once."""
        self._kick.set()

    async def wait_applied(self, run_id: str, seq: int, timeout: float) -> Control | None:
        """Waits (at most ``timeout`` seconds) until the run's owner applied control ``seq``;
        returns the run's controls then, or None when it did not in time."""
        deadline = self._clock() + timeout
        event = self._applied.setdefault(run_id, asyncio.Event())
        try:
            while True:
                event.clear()
                control = await self._leases.control(run_id)
                if control is None or control.applied >= seq:
                    return control
                left = deadline - self._clock()
                if left <= 0:
                    return None
                try:
                    async with asyncio.timeout(min(left, 0.2)):
                        await event.wait()
                except TimeoutError:
                    pass
        finally:
            self._applied.pop(run_id, None)

    # -- notifications -----------------------------------------------------------------------

    async def _listen(self) -> None:
        while True:
            try:
                async for kind, run_id in notifications(self._store.url):
                    if not kind:
                        self._listening.set()
                        self._pending_dirty = True  # what was missed while not listening
                        self._kick.set()
                        continue
                    self._dispatch(kind, run_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _LOGGER.warning("listening for other replicas failed (%s); again shortly", exc)
            await asyncio.sleep(RECONNECT_S)

    def _dispatch(self, kind: str, run_id: str) -> None:
        host = self._host
        assert host is not None
        if kind in ("c", "p"):
            self._pending_dirty = True
            self._kick.set()
        elif kind == "k":
            host.withdraw(run_id)
        elif kind == "l":
            self._kick.set()
        elif kind == "x":
            if run_id in host.owned_runs():
                self._spawn(host.apply_controls(run_id), f"gateway-control-{run_id}")
        elif kind == "m":
            if run_id in host.owned_runs():
                self._spawn(host.refresh_metadata(run_id), f"gateway-metadata-{run_id}")
        elif kind == "a":
            event = self._applied.get(run_id)
            if event is not None:
                event.set()
        host.changed(run_id)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- leases and scans --------------------------------------------------------------------

    async def _loop(self) -> None:
        renew_every = self.lease_s / 3
        next_renew = self._clock() + renew_every
        failing = ""
        while True:
            try:
                async with asyncio.timeout(min(SCAN_S, renew_every)):
                    await self._kick.wait()
                await asyncio.sleep(0.02)  # a burst of notifications makes one scan
            except TimeoutError:
                pass
            self._kick.clear()
            renew = self._clock() >= next_renew
            if renew:
                next_renew = self._clock() + renew_every
            try:
                await self._scan(renew)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is down: the next scan tries again
                if str(exc) != failing:  # once per kind of failure, not once a second
                    _LOGGER.warning("replica scan failed (tried again every second): %s", exc)
                failing = str(exc)
            else:
                if failing:
                    _LOGGER.info("replica scans work again")
                failing = ""

    async def _scan(self, renew: bool) -> None:
        host = self._host
        assert host is not None
        if renew:
            owned = host.owned_runs()
            held = await self._leases.renew(owned)
            for run_id in owned:
                if run_id not in held:
                    _LOGGER.warning(
                        "run %s: this replica's lease on it is gone; another replica drives it now",
                        run_id,
                        extra={"run_id": run_id},
                    )
                    await host.lose(run_id)
        for run_id in await self._leases.orphans():
            if run_id in host.owned_runs():
                continue  # ours, with a late renewal: renewed below
            run = await self._leases.take_over(run_id)
            if run is None:
                continue  # another replica was quicker
            _LOGGER.info(
                "run %s: taking it over (its replica stopped or its lease expired)",
                run_id,
                extra={"run_id": run_id, "event": "taken_over"},
            )
            await host.adopt(run)
            await host.apply_controls(run_id)
        if self._pending_dirty or renew:
            self._pending_dirty = False
            host.sync_candidates(await self._leases.unclaimed_pending())
