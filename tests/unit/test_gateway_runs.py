"""The run state machine: every legal transition, every illegal one, absorbing end states."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import IllegalTransition, InvalidRequest
from gateway.core.runs import RunState, TrainingRun
from trainwire.v1 import episode_pb2

ACTIONS = ("start", "pause", "resume", "stop", "complete", "fail", "speed")

# The run lifecycle's transition table, written out independently of the implementation:
# (state, action) -> next state; None means illegal.
EXPECTED: dict[tuple[RunState, str], RunState | None] = {}
for s in RunState:
    if s is RunState.UNSPECIFIED:
        continue
    for a in ACTIONS:
        EXPECTED[s, a] = None
EXPECTED.update(
    {
        (RunState.PENDING, "start"): RunState.RUNNING,
        (RunState.PENDING, "stop"): RunState.STOPPED,
        (RunState.PENDING, "fail"): RunState.ERROR,
        (RunState.PENDING, "speed"): RunState.PENDING,
        (RunState.RUNNING, "pause"): RunState.PAUSED,
        (RunState.RUNNING, "resume"): RunState.RUNNING,
        (RunState.RUNNING, "stop"): RunState.STOPPED,
        (RunState.RUNNING, "complete"): RunState.DONE,
        (RunState.RUNNING, "fail"): RunState.ERROR,
        (RunState.RUNNING, "speed"): RunState.RUNNING,
        (RunState.PAUSED, "pause"): RunState.PAUSED,
        (RunState.PAUSED, "resume"): RunState.RUNNING,
        (RunState.PAUSED, "stop"): RunState.STOPPED,
        (RunState.PAUSED, "complete"): RunState.DONE,
        (RunState.PAUSED, "fail"): RunState.ERROR,
        (RunState.PAUSED, "speed"): RunState.PAUSED,
    }
)


def new_run() -> TrainingRun:
    return TrainingRun(
        id="r1", task=episode_pb2.TrainTask(), config=episode_pb2.TrainConfig(max_episodes=5)
    )


def apply(run: TrainingRun, action: str, now: int) -> None:
    if action == "start":
        run.start("trainer:1", now)
    elif action == "pause":
        run.pause()
    elif action == "resume":
        run.resume()
    elif action == "stop":
        run.stop(now)
    elif action == "complete":
        run.complete(now)
    elif action == "fail":
        run.fail("it broke", now)
    else:
        run.set_speed(2.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ACTIONS), max_size=12))
def test_any_sequence_follows_the_transition_table(actions: list[str]) -> None:
    run = new_run()
    for now, action in enumerate(actions, start=1):
        before = run.state
        expected = EXPECTED[before, action]
        if expected is None:
            with pytest.raises(IllegalTransition) as info:
                apply(run, action, now)
            assert "r1" in str(info.value) and info.value.run_id == "r1"
            assert run.state is before  # an illegal control changes nothing
        else:
            apply(run, action, now)
            assert run.state is expected
        if run.state.finished:
            assert run.end_time > 0
            assert (run.error_message != "") == (run.state is RunState.ERROR)
        else:
            assert run.end_time == 0


def test_no_op_controls_report_no_change() -> None:
    run = new_run()
    run.start("t:1", 1)
    assert run.resume() is False
    assert run.pause() is True
    assert run.pause() is False
    assert run.resume() is True


@pytest.mark.parametrize(
    ("speed", "expected"), [(0.0, 0.1), (0.01, 0.1), (50.0, 20.0), (3.5, 3.5), (-4.0, 0.1)]
)
def test_speed_is_clamped(speed: float, expected: float) -> None:
    run = new_run()
    run.set_speed(speed)
    assert run.speed == expected


@pytest.mark.parametrize("speed", [math.nan, math.inf, -math.inf])
def test_non_finite_speed_is_invalid_even_on_a_finished_run(speed: float) -> None:
    run = new_run()
    with pytest.raises(InvalidRequest) as info:
        run.set_speed(speed)
    assert info.value.violations[0].field == "speed"
    run.stop(1)
    with pytest.raises(InvalidRequest):
        run.set_speed(speed)
    with pytest.raises(IllegalTransition):
        run.set_speed(1.0)


def test_snapshot_is_independent() -> None:
    run = new_run()
    snap = run.snapshot()
    run.start("t:1", 5)
    assert snap.state is RunState.PENDING and run.state is RunState.RUNNING


def test_a_snapshot_keeps_the_checkpoint_fields_and_later_changes_leave_it_alone() -> None:
    run = new_run()
    run.checkpoint_episode, run.restarts, run.parked = 6, 1, True
    snapshot = run.snapshot()
    run.checkpoint_episode, run.restarts, run.parked = 9, 2, False
    assert (snapshot.checkpoint_episode, snapshot.restarts, snapshot.parked) == (6, 1, True)
    fresh = new_run()
    assert (fresh.checkpoint_episode, fresh.restarts, fresh.parked) == (0, 0, False)
