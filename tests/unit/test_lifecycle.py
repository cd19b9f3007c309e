"""The run lifecycle as a pure function: every (state, event) pair of the machine, as a table of
the state it leads to and the commands it gives, the ignored ones and the illegal ones."""

from __future__ import annotations

import itertools

import pytest

from gateway.core import lifecycle as lc
from gateway.core.ending import Ending
from gateway.core.lifecycle import Command as C
from gateway.core.restarts import Action, Decision

_ENDING = Ending("lost", restartable=True)
_CANCELLING = Ending("gateway side", cancel_job=True)
RESTART = Decision(Action.RESTART, _ENDING, number=1, culprit="trainer t1 failed")
#: A restart whose job may outlive the failure (ABORTED: another caller re-attached to it).
RESTART_CANCELLING = Decision(
    Action.RESTART,
    Ending("crashed", cancel_job=True, restartable=True),
    number=1,
    culprit="trainer t1 failed",
)
REQUEUE = Decision(Action.REQUEUE, _ENDING, culprit="trainer t2 (ranks 1-1 of 2) is busy")
END = Decision(Action.END, _CANCELLING)
GAVE_UP = Decision(Action.END, _ENDING, gave_up=True)

RUNNING = lc.Running("t1")
PAUSED = lc.Running("t1", paused=True)
PLACING = lc.Placing("t1")
AGAIN = lc.Placing("t2", again=True, parked=True)
RESTARTING = lc.Restarting()
PARKING = lc.Parking("t1")
PARKED = lc.Parked()
FINISHING = lc.Finishing(lc.Outcome.DONE)
ENDED = lc.Ended(lc.Exit.FINISHED)

STATES = [
    lc.Pending(),
    PLACING,
    AGAIN,
    RUNNING,
    PAUSED,
    PARKING,
    lc.Parking("t1", resumed=True),
    PARKED,
    RESTARTING,
    lc.Restarting(parked=True, paused=True),
    FINISHING,
    ENDED,
]
EVENTS = [
    lc.Dispatch("t2"),
    lc.Reattach("t1", paused=False, parked=False),
    lc.Answered(),
    lc.Busy(),
    lc.Pause(),
    lc.Resume(),
    lc.ParkDue(),
    lc.StreamEnded(),
    lc.StreamEnded(RESTART),
    lc.StreamEnded(REQUEUE),
    lc.StreamEnded(END),
    lc.ParkDone(),
    lc.Stop(),
    lc.Detach(),
    lc.Abandon(),
    lc.Recovered(lc.Outcome.DONE),
    lc.Stored(),
]

STOP_WITH_JOB = (C.DISARM_PARK, C.DEQUEUE, C.CANCEL_STREAM, C.FINISH, C.CANCEL_JOB_CHECKPOINT)
STOP_WITHOUT_JOB = (C.DISARM_PARK, C.DEQUEUE, C.FINISH)
STOPPED = lc.Finishing(lc.Outcome.STOPPED)
ABANDON = (lc.Ended(lc.Exit.ABANDONED), (C.DISARM_PARK, C.DEQUEUE, C.KEEP_JOB, C.RELEASE))
DETACH = (lc.Ended(lc.Exit.DETACHED), (C.DISARM_PARK, C.KEEP_JOB, C.LEAVE))

#: (state, event) -> (state, commands) for every transition that does something.
TABLE: list[tuple[lc.State, lc.Event, lc.State, tuple[C, ...]]] = [
    # Placing a run, the first time and again.
    (lc.Pending(), lc.Dispatch("t2"), lc.Placing("t2"), (C.START_JOB,)),
    (RESTARTING, lc.Dispatch("t2"), lc.Placing("t2", again=True), (C.START_JOB,)),
    (
        lc.Restarting(parked=True, paused=True),
        lc.Dispatch("t2"),
        lc.Placing("t2", again=True, parked=True, paused=True),
        (C.START_JOB,),
    ),
    (PLACING, lc.Answered(), RUNNING, (C.MARK_STARTED, C.PERSIST)),
    (AGAIN, lc.Answered(), lc.Running("t2"), (C.MARK_PLACED, C.PERSIST)),
    (
        lc.Placing("t2", again=True, paused=True),
        lc.Answered(),
        lc.Running("t2", paused=True),
        (C.MARK_PLACED, C.PERSIST, C.ARM_PARK),
    ),
    (PLACING, lc.Busy(), lc.Pending(), (C.REQUEUE,)),
    (AGAIN, lc.Busy(), lc.Restarting(parked=True), (C.REQUEUE,)),
    # A gateway restart.
    (
        lc.Pending(),
        lc.Reattach("t1", paused=False, parked=False),
        RUNNING,
        (C.ATTACH_JOB, C.ARM_PARK),
    ),
    (lc.Pending(), lc.Reattach("t1", paused=True, parked=True), PARKED, ()),
    (
        lc.Pending(),
        lc.Reattach("t1", paused=False, parked=True),
        lc.Restarting(parked=True),
        (C.REQUEUE,),
    ),
    (lc.Pending(), lc.Recovered(lc.Outcome.DONE), FINISHING, (C.FINISH,)),
    # Pause, resume and the park.
    (RUNNING, lc.Pause(), PAUSED, (C.ARM_PARK, C.PERSIST)),
    (PLACING, lc.Pause(), lc.Placing("t1", paused=True), (C.PERSIST,)),
    (AGAIN, lc.Pause(), lc.Placing("t2", again=True, parked=True, paused=True), (C.PERSIST,)),
    (RESTARTING, lc.Pause(), lc.Restarting(paused=True), (C.PERSIST,)),
    (lc.Parking("t1", resumed=True), lc.Pause(), PARKING, (C.PERSIST,)),
    (PAUSED, lc.Resume(), RUNNING, (C.DISARM_PARK, C.GRANT, C.PERSIST)),
    (lc.Placing("t1", paused=True), lc.Resume(), PLACING, (C.PERSIST,)),
    (lc.Restarting(paused=True), lc.Resume(), RESTARTING, (C.PERSIST,)),
    (
        lc.Restarting(parked=True, paused=True),
        lc.Resume(),
        lc.Restarting(parked=True),
        (C.PERSIST,),
    ),
    (PARKING, lc.Resume(), lc.Parking("t1", resumed=True), (C.PERSIST,)),
    (PARKED, lc.Resume(), lc.Restarting(parked=True), (C.REQUEUE, C.PERSIST)),
    (PAUSED, lc.ParkDue(), PARKING, (C.PARK,)),
    (PARKING, lc.ParkDone(), PARKED, (C.SLOT_FREED, C.MARK_PARKED, C.PERSIST)),
    (
        lc.Parking("t1", resumed=True),
        lc.ParkDone(),
        lc.Restarting(parked=True),
        (C.SLOT_FREED, C.MARK_PARKED, C.REQUEUE, C.PERSIST),
    ),
    # The job's stream ends: done, failed, restarted or requeued, from each state with a job.
    *(
        (state, lc.StreamEnded(), lc.Finishing(lc.Outcome.DONE), (C.CANCEL_SHARES, C.FINISH))
        for state in (PLACING, AGAIN, RUNNING, PAUSED)
    ),
    *(
        (
            state,
            lc.StreamEnded(END),
            lc.Finishing(lc.Outcome.FAILED),
            (C.CANCEL_SHARES, C.FINISH, C.CANCEL_JOB),
        )
        for state in (PLACING, AGAIN, RUNNING, PAUSED)
    ),
    (
        PLACING,
        lc.StreamEnded(GAVE_UP),
        lc.Finishing(lc.Outcome.GAVE_UP),
        (C.CANCEL_SHARES, C.FINISH),
    ),
    *(
        (
            state,
            lc.StreamEnded(RESTART),
            after,
            (C.COUNT_RESTART, C.SLOT_FREED, C.STORE_FIRST, C.CANCEL_SHARES, C.REQUEUE),
        )
        for state, after in (
            (PLACING, RESTARTING),
            (AGAIN, lc.Restarting(parked=True)),
            (RUNNING, RESTARTING),
            (PAUSED, lc.Restarting(paused=True)),
        )
    ),
    (
        RUNNING,
        lc.StreamEnded(RESTART_CANCELLING),
        RESTARTING,
        (C.COUNT_RESTART, C.SLOT_FREED, C.STORE_FIRST, C.CANCEL_JOB, C.CANCEL_SHARES, C.REQUEUE),
    ),
    *(
        (
            state,
            lc.StreamEnded(REQUEUE),
            after,
            (C.SLOT_FREED, C.STORE_FIRST, C.CANCEL_JOB, C.CANCEL_SHARES, C.REQUEUE),
        )
        for state, after in (
            (PLACING, RESTARTING),
            (AGAIN, lc.Restarting(parked=True)),
            (RUNNING, RESTARTING),
            (PAUSED, lc.Restarting(paused=True)),
        )
    ),
    # Stop, from every state that has not ended.
    (lc.Pending(), lc.Stop(), STOPPED, STOP_WITHOUT_JOB),
    (PLACING, lc.Stop(), STOPPED, STOP_WITH_JOB),
    (AGAIN, lc.Stop(), STOPPED, STOP_WITH_JOB),
    (RUNNING, lc.Stop(), STOPPED, STOP_WITH_JOB),
    (PAUSED, lc.Stop(), STOPPED, STOP_WITH_JOB),
    *(
        (parking, lc.Stop(), STOPPED, (C.DISARM_PARK, C.DEQUEUE, C.CANCEL_STREAM, C.FINISH))
        for parking in (PARKING, lc.Parking("t1", resumed=True))
    ),
    (PARKED, lc.Stop(), STOPPED, STOP_WITHOUT_JOB),
    (RESTARTING, lc.Stop(), STOPPED, STOP_WITHOUT_JOB),
    (lc.Restarting(parked=True, paused=True), lc.Stop(), STOPPED, STOP_WITHOUT_JOB),
    # The end, and letting go.
    (FINISHING, lc.Stored(), ENDED, ()),
    *((s, lc.Abandon(), *ABANDON) for s in STATES if not isinstance(s, lc.Ended)),
    *((s, lc.Detach(), *DETACH) for s in STATES if not isinstance(s, lc.Ended)),
]

#: Events that lost a race (a timer, a stream end, a late answer): same state, no commands.
IGNORED = [
    # The park timer's callback may run after it was cancelled.
    *((state, lc.ParkDue()) for state in STATES if state != PAUSED),
    (RUNNING, lc.Answered()),  # every message after the first
    (PAUSED, lc.Answered()),
    # A finishing or ended run: a stream's last word, a park that finished, a late control.
    *(
        (state, event)
        for state in (FINISHING, ENDED)
        for event in EVENTS
        if isinstance(event, (lc.StreamEnded, lc.ParkDone, lc.Busy))
    ),
    *((FINISHING, e) for e in (lc.Pause(), lc.Resume())),
    *((ENDED, e) for e in (lc.Stop(), lc.Abandon(), lc.Detach(), lc.Stored())),
]


def _key(state: lc.State, event: lc.Event) -> tuple[lc.State, lc.Event]:
    return state, event


@pytest.mark.parametrize(("state", "event", "after", "commands"), TABLE)
def test_a_transition_leads_where_the_table_says(
    state: lc.State, event: lc.Event, after: lc.State, commands: tuple[C, ...]
) -> None:
    assert lc.step(state, event) == (after, commands)


def test_a_stream_end_stores_the_run_before_it_touches_the_job() -> None:
    # A replica that lost the lease learns it from the store: before it cancels the job or
    # places the run again (which the new owner's job would not survive).
    touching = {C.CANCEL_JOB, C.CANCEL_SHARES, C.REQUEUE}
    checked = 0
    for state, event, _, commands in TABLE:
        decision = event.decision if isinstance(event, lc.StreamEnded) else None
        if decision is not None and decision.action is not Action.END:
            assert C.STORE_FIRST in commands, (state, event)
            first_touch = min(commands.index(c) for c in touching if c in commands)
            assert commands.index(C.STORE_FIRST) < first_touch, (state, event)
            checked += 1
    assert checked == 9


@pytest.mark.parametrize(("state", "event"), IGNORED)
def test_an_event_that_lost_a_race_is_ignored(state: lc.State, event: lc.Event) -> None:
    assert lc.step(state, event) == (state, ())


def test_every_other_pair_is_illegal_and_says_which() -> None:
    known = {_key(s, e) for s, e, *_ in TABLE} | {_key(s, e) for s, e in IGNORED}
    illegal = 0
    missing = []
    for state, event in itertools.product(STATES, EVENTS):
        if _key(state, event) in known:
            continue
        try:
            outcome = lc.step(state, event)
        except lc.IllegalEvent as exc:
            assert (exc.state, exc.event) == (state, event)
            assert type(event).__name__ in str(exc)
            illegal += 1
            continue
        missing.append((state, event, outcome))
    assert missing == []
    assert illegal > 40  # e.g. Answered while Pending, Dispatch while Running, Stored while Running


@pytest.mark.parametrize("event", EVENTS)
def test_ended_is_terminal(event: lc.Event) -> None:
    try:
        after, commands = lc.step(ENDED, event)
    except lc.IllegalEvent:
        return
    assert (after, commands) == (ENDED, ())


def test_the_run_counts_as_parked_until_its_job_placed_again_answers() -> None:
    events = [lc.Dispatch("t1"), lc.Answered(), lc.Pause(), lc.ParkDue(), lc.ParkDone()]
    state = lc.replay(events)
    assert state == PARKED and lc.parked(state) and not lc.queued(state)
    state, _ = lc.step(state, lc.Resume())
    assert lc.parked(state) and lc.queued(state)
    state, _ = lc.step(state, lc.Dispatch("t2"))
    assert lc.parked(state) and lc.has_job(state) and not lc.queued(state)
    state, _ = lc.step(state, lc.Answered())
    assert state == lc.Running("t2") and not lc.parked(state)
    assert lc.replay([lc.Stop(), lc.Stored()], state) == ENDED and lc.over(ENDED)
