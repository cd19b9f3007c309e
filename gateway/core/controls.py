"""The controls of a run (pause, resume, stop, speed): applied to the driver that drives it,
refused where they do not fit the run's state, and tried on a copy of a run another replica
drives before they are recorded for its owner."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NoReturn

from gateway.core.errors import IllegalTransition
from gateway.core.runs import RunState, TrainingRun

if TYPE_CHECKING:
    from gateway.core.driver import RunDriver


class Action(enum.Enum):
    """A control of a run."""

    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"
    SPEED = "change the speed of"  # how it names itself in errors

    @property
    def desired(self) -> RunState | None:
        """The state it asks for (None: a speed)."""
        return _DESIRED.get(self)


_DESIRED = {
    Action.PAUSE: RunState.PAUSED,
    Action.RESUME: RunState.RUNNING,
    Action.STOP: RunState.STOPPED,
}


async def apply(driver: RunDriver, action: Action, speed: float = 0.0) -> None:
    """Applies a control to the driver of a run.

    Raises:
        IllegalTransition, InvalidRequest: it does not fit the run.
        NotOwner: another replica took the run over meanwhile.
    """
    if action is Action.PAUSE:
        await driver.pause()
    elif action is Action.RESUME:
        await driver.resume()
    elif action is Action.STOP:
        await driver.stop()
    else:
        await driver.set_speed(speed)


def refuse(run: TrainingRun, action: Action, speed: float) -> NoReturn:
    """Raises the error a control of ``run`` gets where it does not fit the run's state."""
    if action is Action.SPEED:
        run.snapshot().set_speed(speed)  # InvalidRequest first, then the finished state
    raise IllegalTransition(f"cannot {action.value} run {run.id!r}: it is {run.state.name}", run.id)


def try_on(run: TrainingRun, action: Action, speed: float, now: int) -> tuple[bool, TrainingRun]:
    """Applies a control to a copy of ``run``: whether it changes anything, and the copy.

    Raises:
        IllegalTransition, InvalidRequest: as on the owner.
    """
    probe = run.snapshot()
    if action is Action.PAUSE:
        changes = probe.pause()
    elif action is Action.RESUME:
        changes = probe.resume()
    elif action is Action.STOP:
        probe.stop(now)
        changes = True
    else:
        probe.set_speed(speed)
        changes = True
    return changes, probe
