"""The park of one driven run: a run paused with a job for ``park_after_s`` ends its job after a
final checkpoint and frees its slot; a resume places it again.

``ParkTimer`` is armed when the run is paused with a job and disarmed by a resume, a stop or the
run's end; a callback that fires after it was disarmed is ignored by the state machine.
``Parking`` carries a park out for the run's driver (``gateway.core.lifecycle``: ``ParkDue``,
then ``ParkDone``).

Invariants:

- The run is stored before its job ends. The park ends the job, and what the run received past
  its published episode then lives only in this gateway until the run resumes; a store that
  cannot take the run now (down or full) would leave whoever drives it next a job that is gone.
  So the job is kept and the park tried again after ``park_after_s``.
- A run another replica took over meanwhile is left to it, job and all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from gateway.core import lifecycle as lc
from gateway.core.errors import StoreUnavailable
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.store import NotOwner

if TYPE_CHECKING:
    from gateway.core.attempt import JobAttempt
    from gateway.core.ledger import CheckpointLedger

_LOGGER = logging.getLogger(__name__)


class ParkTimer:
    """Calls ``due`` once a run armed here has been paused for ``delay_s`` (0: never)."""

    def __init__(self, delay_s: float, due: Callable[[], None]) -> None:
        self._delay_s = delay_s
        self._due = due
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, run: TrainingRun) -> None:
        """Starts the timer for a paused run that is not parked (again from now)."""
        if self._delay_s <= 0 or run.state is not RunState.PAUSED or run.parked:
            return
        self.disarm()
        self._handle = asyncio.get_running_loop().call_later(self._delay_s, self._fire)

    def disarm(self) -> None:
        """Cancels the timer, if armed."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._due()


class ParkHost(Protocol):
    """What a park needs of its run's driver (``gateway.core.driver.RunDriver``)."""

    @property
    def run(self) -> TrainingRun: ...

    @property
    def state(self) -> lc.State: ...

    @property
    def attempt(self) -> JobAttempt | None: ...

    @property
    def persist(self) -> Callable[[], Awaitable[None]]:
        """Stores the run as it is."""
        ...

    async def abandon(self) -> None:
        """Lets the run go to the replica that owns it now."""
        ...

    async def apply(self, event: lc.Event) -> None:
        """Steps the run's state machine and carries out its commands."""
        ...


class Parking:
    """Parks one driven run (see the module docstring).

    Args:
        host: The run's driver.
        settings: ``park_after_s`` and the heartbeat timeout a park waits on its trainer.
        spawn: Keeps a background task referenced until it is done.
        ledger: The run's checkpoints: a park records the job's final one there.
    """

    def __init__(
        self,
        host: ParkHost,
        settings: CoreSettings,
        spawn: Callable[[Awaitable[None], str], None],
        ledger: CheckpointLedger,
    ) -> None:
        self._host = host
        self._settings = settings
        self._spawn = spawn
        self._ledger = ledger
        self._timer = ParkTimer(settings.park_after_s, self._due)

    def arm(self) -> None:
        """Starts the timer (the run was paused with a job)."""
        self._timer.arm(self._host.run)

    def disarm(self) -> None:
        """Cancels the timer, if armed."""
        self._timer.disarm()

    def start(self) -> None:
        """Ends the run's job, in the background (the state machine entered ``Parking``)."""
        self._spawn(self._park(), f"gateway-park-{self._host.run.id}")

    def _due(self) -> None:
        """The timer fired: the park starts once the run is stored."""
        self._spawn(self._store_then_park(), f"gateway-park-due-{self._host.run.id}")

    def _wanted(self) -> bool:
        state = self._host.state
        return isinstance(state, lc.Running) and state.paused

    async def _store_then_park(self) -> None:
        """Stores the run as it is, then parks it (``ParkDue``); a store that cannot take it
        keeps the job and arms the timer again, a run that is another replica's now is let go."""
        host = self._host
        if not self._wanted():
            return
        try:
            await host.persist()
        except NotOwner:
            await host.abandon()  # its new owner finds the job and parks the run in time
            return
        except StoreUnavailable as exc:
            run_id, delay = host.run.id, self._settings.park_after_s
            _LOGGER.warning(
                "run %s: not parked, its job is kept (the run could not be stored: %s); "
                "parking again in %g s",
                run_id,
                exc,
                delay,
                extra={"run_id": run_id},
            )
            if self._wanted():
                self.arm()
            return
        if self._wanted():
            await host.apply(lc.ParkDue())

    async def _park(self) -> None:
        """Ends the job after its final checkpoint (``JobAttempt.park``); the run keeps what it
        received and frees its slot."""
        host = self._host
        assert host.attempt is not None
        try:
            await host.attempt.park(self._settings.heartbeat_timeout_s, self._ledger.parked)
            if isinstance(host.state, lc.Parking):
                await host.apply(lc.ParkDone())
        except (StoreUnavailable, NotOwner) as exc:
            run_id = host.run.id
            _LOGGER.warning("run %s: parking not saved: %s", run_id, exc, extra={"run_id": run_id})
