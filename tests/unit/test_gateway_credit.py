"""The credit window and how a failure ends a run, alone: pure units of the gateway core."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.credit import MIN_LEAD, UNPACED_WINDOW, CreditWindow, lead_for
from gateway.core.ending import end_of
from gateway.core.errors import StoreUnavailable
from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    LOST_MESSAGE,
    UNEXPECTED_MESSAGE,
)
from gateway.core.store import STORE_MESSAGE, StoreWriteFailed
from gateway.core.trainers import (
    TrainerBrokeContract,
    TrainerBusy,
    TrainerCrashed,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
)
from trainwire.contract import ContractViolation


def test_lead_is_seconds_of_the_paced_rate_with_a_floor_and_a_window_when_unpaced() -> None:
    assert lead_for(None, 2.0) == UNPACED_WINDOW
    assert lead_for(20.0, 2.0) == 40
    assert lead_for(0.5, 2.0) == MIN_LEAD
    assert lead_for(3.3, 1.0) == 4  # ceil(3.3), above the floor
    assert lead_for(7.1, 1.0) == 8


def test_a_grant_goes_out_per_quarter_lead_one_at_a_time_and_never_past_the_end() -> None:
    credit = CreditWindow(max_episodes=100)
    assert credit.opening(published=0, lead=40, paused=False) == 40
    assert credit.granted == 40
    assert credit.due(published=9, lead=40) is None  # 49 - 40 < a quarter lead
    assert credit.due(published=10, lead=40) == 50
    assert credit.due(published=30, lead=40) is None  # one in flight
    credit.sent(50, delivered=True)
    assert credit.due(published=30, lead=40) == 70
    credit.sent(70, delivered=False)  # lost: the next commit grants again
    assert credit.granted == 50
    assert credit.due(published=65, lead=40) == 100  # capped at max_episodes
    credit.sent(100, delivered=True)
    assert credit.due(published=99, lead=40) is None


def test_a_paused_run_opens_with_what_it_holds() -> None:
    credit = CreditWindow(max_episodes=100, granted=12)
    assert credit.opening(published=10, lead=40, paused=True) == 12
    assert credit.target(published=10, lead=40, paused=True) == 12


@settings(max_examples=200, deadline=None)
@given(
    max_episodes=st.integers(1, 500),
    lead=st.integers(MIN_LEAD, 300),
    steps=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=60),
)
def test_granted_stays_within_a_lead_of_what_was_published(
    max_episodes: int, lead: int, steps: list[tuple[int, bool]]
) -> None:
    """Whatever the order of commits and grant answers: granted <= published + lead at the
    time of the grant, never beyond max_episodes, never backwards."""
    credit = CreditWindow(max_episodes)
    published = 0
    granted = credit.opening(published, lead, paused=False)
    assert granted <= min(max_episodes, published + lead)
    in_flight: int | None = None
    for advance, delivered in steps:
        published = min(max_episodes, published + advance)
        if in_flight is not None:
            before = credit.granted
            credit.sent(in_flight, delivered)
            assert credit.granted >= before
            in_flight = None
        target = credit.due(published, lead)
        if target is not None:
            assert credit.granted < target <= min(max_episodes, published + lead)
            in_flight = target
        assert credit.granted <= max_episodes


def test_each_failure_ends_a_run_with_its_message_and_says_whether_to_cancel_the_job() -> None:
    cases = [
        (TrainerLost("x"), LOST_MESSAGE, False, "lost"),
        (TrainerJobGone("x"), INTERRUPTED_MESSAGE, False, "gone"),
        (TrainerBrokeContract("x"), CONTRACT_MESSAGE, True, "contract"),
        (TrainerCrashed("x"), UNEXPECTED_MESSAGE, True, "crashed"),
        (TrainerBusy("x"), UNEXPECTED_MESSAGE, True, "busy"),
        (TrainerJobExists("x"), UNEXPECTED_MESSAGE, True, "exists"),
        (
            TrainerFailed("x", "The clip 'moonwalk' is unknown."),
            "The clip 'moonwalk' is unknown.",
            False,
            "failed",
        ),
    ]
    for exc, message, cancel, label in cases:
        ending = end_of(exc)
        assert (ending.message, ending.cancel_job, ending.label) == (message, cancel, label), exc
        assert ending.line is not None and "%s" in ending.line
    violation = ContractViolation("best_reward", "episode 3: best_reward went down", run_id="r")
    assert end_of(violation).message == CONTRACT_MESSAGE
    assert end_of(violation).cancel_job
    assert end_of(StoreWriteFailed("disk full")).message == STORE_MESSAGE
    assert end_of(StoreUnavailable("x")).message == STORE_MESSAGE
    assert end_of(RuntimeError("bug")).message == UNEXPECTED_MESSAGE
