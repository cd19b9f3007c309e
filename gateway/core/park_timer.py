"""The park timer of one driven run: armed when the run is paused with a job, it tells the
driver once the run has been paused for ``park_after_s`` (``gateway.core.lifecycle.ParkDue``).
Disarmed by a resume, a stop or the run's end; a callback that fires after it was disarmed is
ignored by the state machine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.core.runs import RunState, TrainingRun


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
