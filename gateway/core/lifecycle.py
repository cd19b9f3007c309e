"""The lifecycle of one driven run's job, as a pure state machine.

``step(state, event) -> (state, commands)``: the driver (``gateway.core.driver``) sends every
event that changes where its run's job stands, and carries out the commands, in order. Nothing
here does I/O, reads a clock or holds a task; the states are frozen values carrying their own
data, so a recorded event history replays to the same end (``replay``).

States (a run that is PENDING in the store is in ``Pending`` or ``Placing``; an active one,
RUNNING or PAUSED, in any of the others; ``paused`` mirrors the run's PAUSED):

- ``Pending``: created, waiting for the scheduler to place it the first time.
- ``Placing``: dispatched to trainers, waiting for rank 0's first answer (``again``: a run
  placed again after a park or a restart; ``parked``: it was parked).
- ``Running``: its job streams to it.
- ``Parking``: paused for ``park_after_s``, its job writes a final checkpoint and ends;
  ``resumed`` once a resume came meanwhile.
- ``Parked``: paused, with no job and its slot free.
- ``Restarting``: active with no job, queued to be placed again (resumed after a park, or its
  job failed and the restart policy restarts or requeues it).
- ``Finishing``: its final state is decided (done, failed, stopped); the driver flushes and
  stores it.
- ``Ended``: terminal: finished, detached (gateway shutdown: the trainer keeps the job) or
  abandoned (another replica drives it now).

A job's stream that ended is the run's to act on only while this replica owns the run: before
the run restarts or requeues (which cancels the job and places the run again), the driver stores
it (``STORE_FIRST``), and a store that names another owner lets the run go instead.

An event a state does not expect is either *ignored* (a timer or a stream end that lost a race
with a control: same state, no commands) or *illegal* (``IllegalEvent``: a bug in the caller).
Which is which is the table in ``tests/unit/test_lifecycle.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeAlias

from gateway.core.restarts import Action, Decision

#: The detail of a run queued to be placed again.
WAITING_AGAIN = "waiting for a free slot"

# -- states ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pending:
    """Waiting to be placed the first time."""


@dataclass(frozen=True, slots=True)
class Placing:
    """Dispatched; rank 0's trainer has not answered yet."""

    where: str
    again: bool = False
    parked: bool = False
    paused: bool = False


@dataclass(frozen=True, slots=True)
class Running:
    """Its job streams to it."""

    where: str
    paused: bool = False


@dataclass(frozen=True, slots=True)
class Parking:
    """Its job writes a final checkpoint and ends."""

    where: str
    resumed: bool = False


@dataclass(frozen=True, slots=True)
class Parked:
    """Paused with no job; its slot is free."""


@dataclass(frozen=True, slots=True)
class Restarting:
    """Active with no job, queued to be placed again."""

    parked: bool = False
    paused: bool = False


class Outcome(enum.Enum):
    """How a run finishes."""

    DONE = "done"
    FAILED = "failed"
    GAVE_UP = "gave up"  # failed after its last restart
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Finishing:
    """Its final state is decided and being stored."""

    outcome: Outcome


class Exit(enum.Enum):
    """How a driver lets its run go."""

    FINISHED = "finished"
    DETACHED = "detached"
    ABANDONED = "abandoned"


@dataclass(frozen=True, slots=True)
class Ended:
    """Terminal."""

    exit: Exit


State: TypeAlias = Pending | Placing | Running | Parking | Parked | Restarting | Finishing | Ended

#: States whose run is waiting in the scheduler's queue.
QUEUED = (Pending, Restarting)

# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """The scheduler placed it on ``where``."""

    where: str


@dataclass(frozen=True, slots=True)
class Reattach:
    """A gateway restart found it active (RUNNING or PAUSED): ``where`` its job runs."""

    where: str
    paused: bool
    parked: bool


@dataclass(frozen=True, slots=True)
class Answered:
    """Rank 0's trainer answered."""


@dataclass(frozen=True, slots=True)
class Busy:
    """Rank 0's trainer refused the job as busy before answering."""


@dataclass(frozen=True, slots=True)
class Pause:
    """The run was paused."""


@dataclass(frozen=True, slots=True)
class Resume:
    """The run was resumed."""


@dataclass(frozen=True, slots=True)
class ParkDue:
    """It has been paused for ``park_after_s``."""


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The job's stream ended (``decision`` None: the job trained its last episode; else the
    restart policy's decision on its failure)."""

    decision: Decision | None = None


@dataclass(frozen=True, slots=True)
class ParkDone:
    """The parking job ended (its final checkpoint written, or given up on)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The run was stopped."""


@dataclass(frozen=True, slots=True)
class Detach:
    """The gateway shuts down: the trainer keeps the job."""


@dataclass(frozen=True, slots=True)
class Abandon:
    """Another replica owns the run now."""


@dataclass(frozen=True, slots=True)
class Recovered:
    """A gateway restart found it finished (or unrecoverable): its end is stored."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Stored:
    """Its final state is stored (or queued to be): it leaves the active runs."""


Event: TypeAlias = (
    Dispatch
    | Reattach
    | Answered
    | Busy
    | Pause
    | Resume
    | ParkDue
    | StreamEnded
    | ParkDone
    | Stop
    | Detach
    | Abandon
    | Recovered
    | Stored
)

# -- commands ----------------------------------------------------------------------------------


class Command(enum.Enum):
    """What the driver carries out, in the order given."""

    START_JOB = "start the job: a stream to rank 0's trainer"
    ATTACH_JOB = "re-attach to the job after the run's published episode"
    REQUEUE = "put the run back in the scheduler's queue"
    DEQUEUE = "take the run out of the scheduler's queue"
    ARM_PARK = "start the park timer"
    DISARM_PARK = "cancel the park timer"
    PARK = "ask the job for a final checkpoint and let it end"
    MARK_STARTED = "the run starts (PENDING -> RUNNING) on its trainers"
    MARK_PLACED = "the run continues on its new trainers (no longer parked)"
    MARK_PARKED = "the run is parked"
    COUNT_RESTART = "count the restart and say why in the run's detail"
    SLOT_FREED = "tell the scheduler rank 0's slots are free"
    CANCEL_STREAM = "stop reading the job: cancel the stream, end the slot reservations"
    CANCEL_JOB = "cancel rank 0's job on its trainer (in the background)"
    CANCEL_JOB_CHECKPOINT = "cancel the job after its final checkpoint, then its shares"
    CANCEL_SHARES = "cancel the other trainers' shares (in the background)"
    KEEP_JOB = "stop reading the job and its shares; the trainers keep it"
    GRANT = "grant credit if due"
    PERSIST = "store the run"
    STORE_FIRST = (
        "store the run before its job is touched: another replica owning it lets it go (the job"
        " is that replica's); an unavailable store lets the step go on (written with the next)"
    )
    FINISH = "flush, store the final state, leave the active runs"
    LEAVE = "flush and store the run as it is, leave the active runs (gateway shutdown)"
    RELEASE = "leave the active runs without storing anything"


Commands: TypeAlias = tuple[Command, ...]


class IllegalEvent(Exception):
    """An event its state cannot take (a bug in the caller)."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"{type(event).__name__} in state {state!r}")
        self.state = state
        self.event = event


# -- the machine -------------------------------------------------------------------------------

C = Command
_NONE: Commands = ()


def step(state: State, event: Event) -> tuple[State, Commands]:
    """The state after ``event`` and what to carry out (see the module docstring).

    Raises:
        IllegalEvent: ``state`` cannot take ``event``.
    """
    if isinstance(state, Ended):
        if isinstance(event, (*_IGNORABLE, Stop, Abandon, Detach, Stored)):
            return state, _NONE  # a late stream end, or a run let go twice
        raise IllegalEvent(state, event)
    if isinstance(event, Abandon):
        return Ended(Exit.ABANDONED), (C.DISARM_PARK, C.DEQUEUE, C.KEEP_JOB, C.RELEASE)
    if isinstance(event, Detach):
        return Ended(Exit.DETACHED), (C.DISARM_PARK, C.KEEP_JOB, C.LEAVE)
    if isinstance(state, Finishing):
        if isinstance(event, Stored):
            return Ended(Exit.FINISHED), _NONE
        if isinstance(event, (*_IGNORABLE, Pause, Resume)):
            return state, _NONE
        raise IllegalEvent(state, event)
    if isinstance(event, Stop):
        stopped = Finishing(Outcome.STOPPED)
        if isinstance(state, (Placing, Running)):
            # The job's final checkpoint is the trained model.
            return stopped, (
                C.DISARM_PARK,
                C.DEQUEUE,
                C.CANCEL_STREAM,
                C.FINISH,
                C.CANCEL_JOB_CHECKPOINT,
            )
        if isinstance(state, Parking):
            # Its job is writing its final checkpoint already; the park cancels the shares.
            return stopped, (C.DISARM_PARK, C.DEQUEUE, C.CANCEL_STREAM, C.FINISH)
        return stopped, (C.DISARM_PARK, C.DEQUEUE, C.FINISH)
    if isinstance(event, Recovered):
        if isinstance(state, Pending):
            return Finishing(event.outcome), (C.FINISH,)
        raise IllegalEvent(state, event)
    handler = _HANDLERS.get((type(state), type(event)))
    if handler is None:
        if isinstance(event, ParkDue):
            return state, _NONE
        raise IllegalEvent(state, event)
    return handler(state, event)


#: Events a finishing or ended run may still receive after a race it lost (a timer fired, a
#: stream ended, a park finished): ignored. Elsewhere only the park timer can lose a race (its
#: callback may run after it was cancelled); the driver sends the others only where they apply.
_IGNORABLE = (ParkDue, StreamEnded, ParkDone, Busy)


def _dispatch(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(event, Dispatch)
    if isinstance(state, Restarting):
        return Placing(event.where, True, state.parked, state.paused), (C.START_JOB,)
    return Placing(event.where), (C.START_JOB,)


def _reattach(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(event, Reattach)
    if event.parked:
        if event.paused:
            return Parked(), _NONE
        return Restarting(parked=True), (C.REQUEUE,)
    return Running(event.where, event.paused), (C.ATTACH_JOB, C.ARM_PARK)


def _answered(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(state, Placing)
    mark = C.MARK_PLACED if state.again else C.MARK_STARTED
    park = (C.ARM_PARK,) if state.paused else _NONE
    return Running(state.where, state.paused), (mark, C.PERSIST, *park)


def _busy(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(state, Placing)
    if state.again:
        return Restarting(state.parked, state.paused), (C.REQUEUE,)
    return Pending(), (C.REQUEUE,)


def _pause(state: State, event: Event) -> tuple[State, Commands]:
    if isinstance(state, Parking) and state.resumed:
        return replace(state, resumed=False), (C.PERSIST,)
    if not isinstance(state, (Running, Placing, Restarting)) or state.paused:
        raise IllegalEvent(state, event)  # paused already: the run did not change
    park = (C.ARM_PARK,) if isinstance(state, Running) else _NONE
    return replace(state, paused=True), (*park, C.PERSIST)


def _resume(state: State, event: Event) -> tuple[State, Commands]:
    if isinstance(state, Parked):
        return Restarting(parked=True), (C.REQUEUE, C.PERSIST)
    if isinstance(state, Parking):
        if state.resumed:
            raise IllegalEvent(state, event)
        return replace(state, resumed=True), (C.PERSIST,)
    assert isinstance(state, (Running, Placing, Restarting))
    if not state.paused:
        raise IllegalEvent(state, event)  # running already: the run did not change
    if isinstance(state, Running):
        return replace(state, paused=False), (C.DISARM_PARK, C.GRANT, C.PERSIST)
    return replace(state, paused=False), (C.PERSIST,)


def _park_due(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(state, Running)
    if not state.paused:
        return state, _NONE
    return Parking(state.where), (C.PARK,)


def _park_done(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(state, Parking)
    if state.resumed:
        return Restarting(parked=True), (C.SLOT_FREED, C.MARK_PARKED, C.REQUEUE, C.PERSIST)
    return Parked(), (C.SLOT_FREED, C.MARK_PARKED, C.PERSIST)


def _stream_ended(state: State, event: Event) -> tuple[State, Commands]:
    assert isinstance(event, StreamEnded)
    assert isinstance(state, (Placing, Running))
    decision = event.decision
    if decision is None:
        return Finishing(Outcome.DONE), (C.CANCEL_SHARES, C.FINISH)
    cancel = (C.CANCEL_JOB,) if decision.ending.cancel_job else _NONE
    if decision.action is Action.END:
        outcome = Outcome.GAVE_UP if decision.gave_up else Outcome.FAILED
        return Finishing(outcome), (C.CANCEL_SHARES, C.FINISH, *cancel)
    parked = isinstance(state, Placing) and state.parked
    again = Restarting(parked, state.paused)
    # The store is written before the job is touched: a replica that lost the run's lease
    # (its stream ended because the new owner re-attached) must not cancel the new owner's job
    # nor place the run again.
    if decision.action is Action.REQUEUE:
        return again, (C.SLOT_FREED, C.STORE_FIRST, C.CANCEL_JOB, C.CANCEL_SHARES, C.REQUEUE)
    return again, (
        C.COUNT_RESTART,
        C.SLOT_FREED,
        C.STORE_FIRST,
        *cancel,
        C.CANCEL_SHARES,
        C.REQUEUE,
    )


_HANDLERS = {
    (Pending, Dispatch): _dispatch,
    (Restarting, Dispatch): _dispatch,
    (Pending, Reattach): _reattach,
    (Placing, Answered): _answered,
    (Running, Answered): lambda s, e: (s, _NONE),  # a re-attached job answered
    (Placing, Busy): _busy,
    (Placing, Pause): _pause,
    (Running, Pause): _pause,
    (Restarting, Pause): _pause,
    (Parking, Pause): _pause,
    (Parked, Pause): _pause,
    (Placing, Resume): _resume,
    (Running, Resume): _resume,
    (Restarting, Resume): _resume,
    (Parking, Resume): _resume,
    (Parked, Resume): _resume,
    (Running, ParkDue): _park_due,
    (Parking, ParkDone): _park_done,
    (Placing, StreamEnded): _stream_ended,
    (Running, StreamEnded): _stream_ended,
}


def replay(events: Iterable[Event], start: State | None = None) -> State:
    """The state a history of events leads to from ``start`` (``Pending()`` by default)."""
    state: State = Pending() if start is None else start
    for event in events:
        state, _ = step(state, event)
    return state


# -- what the states tell others ---------------------------------------------------------------


def queued(state: State) -> bool:
    """Whether the scheduler may place it."""
    return isinstance(state, QUEUED)


def over(state: State) -> bool:
    """Whether its end is decided (finishing or ended)."""
    return isinstance(state, (Finishing, Ended))


def has_job(state: State) -> bool:
    """Whether a job of it may be on a trainer (dispatched, running or parking)."""
    return isinstance(state, (Placing, Running, Parking))


def parked(state: State) -> bool:
    """Whether the run counts as parked (its training state only in a checkpoint), until its
    job placed again answers."""
    if isinstance(state, (Placing, Restarting)):
        return state.parked
    return isinstance(state, Parked)
