"""How a driven run ends: the failure that ended its stream mapped to what users read, what the
metrics count and whose side the failure is on (``end_of``), and the one log line of the end
(``log_end``). Pure: the driver applies what ``end_of`` says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.core.errors import StoreUnavailable
from gateway.core.forks import ForkNotRestored
from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    LOST_MESSAGE,
    UNEXPECTED_MESSAGE,
    RunState,
    TrainingRun,
)
from gateway.core.shares import ShareFailed
from gateway.core.store import STORE_MESSAGE, StoreWriteFailed
from gateway.core.trainers import (
    TrainerBrokeContract,
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
    TrainerProcessDied,
    TrainerUnreachable,
)
from trainwire.contract import ContractViolation

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a failure ends a run.

    Attributes:
        message: What users read (``Run.error_message``).
        cancel_job: The trainer's job may outlive the failure (a failure on the gateway's side,
            or a trainer in an unknown state): it would run on for its detach grace computing
            for nobody, so the driver cancels it.
        label: The metrics label of a trainer failure ("" for any other failure).
        line: The log line's format, given the trainer and the failure (None: logged where it
            happened, or with its traceback by the driver).
        restartable: The trainer or the job's process died (not the user's error, not the
            gateway's): a run with a checkpoint is restarted from it.
    """

    message: str
    cancel_job: bool = False
    label: str = ""
    line: str | None = None
    restartable: bool = False


#: Trainer failures: the user message (None: the trainer's own), the label, the log line and
#: whether the job is cancelled.
_TRAINER_FAILURES: dict[type[TrainerError], tuple[str | None, str, str, bool]] = {
    # Its job (if any) would train from scratch what the fork must continue.
    ForkNotRestored: (None, "fork", "trainer %s could not start the fork: %s", True),
    TrainerProcessDied: (None, "process_died", "a process of the job on %s died: %s", False),
    TrainerFailed: (None, "failed", "trainer %s failed: %s", False),
    TrainerUnreachable: (
        LOST_MESSAGE,
        "unreachable",
        "trainer %s is gone (its address refuses connections): %s",
        False,
    ),
    TrainerLost: (LOST_MESSAGE, "lost", "trainer %s stopped responding: %s", False),
    TrainerJobGone: (INTERRUPTED_MESSAGE, "gone", "trainer %s no longer has the job: %s", False),
    TrainerBrokeContract: (
        CONTRACT_MESSAGE,
        "contract",
        "trainer %s broke the contract: %s",
        True,
    ),
    TrainerCrashed: (UNEXPECTED_MESSAGE, "crashed", "trainer %s stopped: %s", True),
    TrainerBusy: (UNEXPECTED_MESSAGE, "busy", "trainer %s busy mid-stream: %s", True),
    TrainerJobExists: (UNEXPECTED_MESSAGE, "exists", "trainer %s has a second job: %s", True),
}


#: Failures of the trainer's machine or the job's processes, not of the task: restartable.
_RESTARTABLE = (TrainerLost, TrainerJobGone, TrainerCrashed, TrainerProcessDied)


def end_of(exc: BaseException) -> Ending:
    """How the failure ``exc`` of a run's stream ends the run. A failed share of a job that
    spans trainers ends it as its cause would, naming the trainer and its ranks; every share
    is cancelled (rank 0's included)."""
    if isinstance(exc, ShareFailed):
        cause = end_of(exc.cause)
        what = "was lost" if exc.lost else "failed"
        return Ending(
            f"{exc.who} {what}: {cause.message}",
            cancel_job=True,
            label=cause.label,
            line="a trainer of its job on %s failed: %s",
            restartable=cause.restartable,
        )
    if isinstance(exc, TrainerError):
        kind = next((k for k in type(exc).__mro__ if k in _TRAINER_FAILURES), TrainerCrashed)
        default, label, line, cancel = _TRAINER_FAILURES[kind]  # type: ignore[index]
        message = exc.user_message if isinstance(exc, TrainerFailed) else default
        assert message is not None
        return Ending(message, cancel, label, line, isinstance(exc, _RESTARTABLE))
    if isinstance(exc, ContractViolation):
        return Ending(CONTRACT_MESSAGE, cancel_job=True)
    if isinstance(exc, (StoreWriteFailed, StoreUnavailable)):
        return Ending(STORE_MESSAGE, cancel_job=True)
    return Ending(UNEXPECTED_MESSAGE, cancel_job=True)


def log_end(run: TrainingRun) -> None:
    """The one INFO line of a run's end: finished (DONE), stopped or failed (ERROR)."""
    extra = {"run_id": run.id, "state": run.state.name}
    if run.state is RunState.DONE:
        _LOGGER.info(
            "run %s finished: %d episodes, best reward %g",
            run.id,
            run.episode,
            run.best_reward,
            extra={**extra, "event": "finished"},
        )
    elif run.state is RunState.STOPPED:
        _LOGGER.info(
            "run %s stopped at episode %d (trainer at %d)",
            run.id,
            run.episode,
            run.trainer_episode,
            extra={**extra, "event": "stopped"},
        )
    else:
        _LOGGER.info(
            "run %s failed at episode %d: %s",
            run.id,
            run.episode,
            run.error_message,
            extra={**extra, "event": "failed"},
        )
