"""What people read about an active run: the one line of where it stands (``Run.state_detail``),
from its state, its lifecycle and what its trainer has trained and been granted, and the log
lines of its lifecycle's steps."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gateway.core import lifecycle as lc
from gateway.core.runs import RunState, TrainingRun

_LOGGER = logging.getLogger(__name__)


def describe(
    run: TrainingRun, state: lc.State, pending: str, where: str, granted: int, note: str
) -> str:
    """The run's detail: ``pending`` says what a waiting run waits for, ``where`` where its job
    runs, ``note`` what its checkpoints say ("" for nothing)."""
    note = f"; {note}" if note else ""
    if run.state is RunState.PENDING:
        return pending
    if lc.parked(state) and run.state is RunState.PAUSED:
        return (
            f"parked at episode {run.episode}: its training state is in the checkpoint "
            f"at episode {run.checkpoint_episode} and its trainer slot is free; resume "
            f"places it again{note}"
        )
    if isinstance(state, lc.Restarting) or (isinstance(state, lc.Placing) and state.again):
        return (
            f"{pending}, to continue from its latest checkpoint "
            f"(episode {run.checkpoint_episode or run.fork_episode}){note}"
        )
    if run.state is RunState.RUNNING:
        return (
            f"training on {where}: episode {run.trainer_episode} of "
            f"{run.config.max_episodes} trained, granted through {granted}{note}"
        )
    if run.state is RunState.PAUSED:
        return (
            f"paused at episode {run.episode}; training holds at episode "
            f"{run.trainer_episode} (granted through {granted}){note}"
        )
    return ""


def log_placed(run: TrainingRun, how: str, where: str, trainers: int) -> None:
    """Logs that the run ``how`` ("started on", "continues on") its trainers ``where``."""
    event = "started" if how == "started on" else "placed_again"
    noun = "trainers" if trainers > 1 else "trainer"
    extra = {"run_id": run.id, "event": event}
    _LOGGER.info("run %s %s %s %s", run.id, how, noun, where, extra=extra)


def log_parked(run: TrainingRun, trainers: Sequence[str]) -> None:
    """Logs that the run parked, freeing its slots on ``trainers``."""
    _LOGGER.info(
        "run %s parked at episode %d (trained through %d, checkpoint at %d); trainer slots on "
        "%s freed",
        run.id,
        run.episode,
        run.trainer_episode,
        run.checkpoint_episode,
        ", ".join(trainers),
        extra={"run_id": run.id, "event": "parked"},
    )


def log_control(run: TrainingRun, event: str, change: str = "") -> None:
    """Logs a control the run took: "paused", "resumed", "speed" or "hyperparameters" (with
    the ``change``, described)."""
    extra = {"run_id": run.id, "event": event}
    if event == "paused":
        line = "run %s paused at episode %d (trainer at %d)"
        _LOGGER.info(line, run.id, run.episode, run.trainer_episode, extra=extra)
    elif event == "resumed":
        _LOGGER.info("run %s resumed at episode %d", run.id, run.episode, extra=extra)
    elif event == "speed":
        _LOGGER.info("run %s speed %g", run.id, run.speed, extra=extra)
    else:
        line = "run %s: hyperparameters %s (episode %d published, %d trained)"
        _LOGGER.info(line, run.id, change, run.episode, run.trainer_episode, extra=extra)
