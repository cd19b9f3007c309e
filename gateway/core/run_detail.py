"""The one line people read about where an active run stands (``Run.state_detail``), from its
state, its lifecycle and what its trainer has trained and been granted."""

from __future__ import annotations

from gateway.core import lifecycle as lc
from gateway.core.runs import RunState, TrainingRun


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
