"""The restart policy as a table: (failure, active, restarts, checkpoint) -> decision."""

from __future__ import annotations

import pytest

from gateway.core.ending import end_of
from gateway.core.restarts import Action, RestartPolicy
from gateway.core.shares import ShareFailed, SharesNotReattached
from gateway.core.trainers import (
    TrainerBusy,
    TrainerCrashed,
    TrainerFailed,
    TrainerLost,
    TrainerProcessDied,
)
from trainwire.contract import ContractViolation

POLICY = RestartPolicy(max_restarts=2)
WHO = "trainer 10.0.0.2:50051 (ranks 2-3 of 4)"


def busy_share() -> ShareFailed:
    return ShareFailed(WHO, "10.0.0.2:50051", TrainerBusy("no free slot"))


def died_share() -> ShareFailed:
    return ShareFailed(WHO, "10.0.0.2:50051", TrainerProcessDied("rank 3", "a process died"))


def violation() -> ContractViolation:
    return ContractViolation("finite", "episode 3: reward is NaN", run_id="r")


CASES = [
    # failure, active, restarts, has_checkpoint -> action, gave_up, number, culprit
    (TrainerLost("gone"), True, 0, True, Action.RESTART, False, 1, "trainer T failed"),
    (TrainerProcessDied("x", "died"), True, 1, True, Action.RESTART, False, 2, "trainer T failed"),
    (TrainerCrashed("boom"), True, 0, True, Action.RESTART, False, 1, "trainer T failed"),
    (died_share(), True, 0, True, Action.RESTART, False, 1, f"{WHO} failed"),
    (
        SharesNotReattached("spanned"),
        True,
        0,
        True,
        Action.RESTART,
        False,
        1,
        "the gateway restarted (its job spanned trainers)",
    ),
    # Restarts spent: the run ends, and says it gave up.
    (TrainerLost("gone"), True, 2, True, Action.END, True, 0, ""),
    # No checkpoint (or none readable): it ends, not having given up.
    (TrainerLost("gone"), True, 0, False, Action.END, False, 0, ""),
    # Not active (PENDING, or ended meanwhile): nothing to restart.
    (TrainerLost("gone"), False, 0, True, Action.END, False, 0, ""),
    # The user's or the task's failure: never restarted.
    (TrainerFailed("x", "bad dataset"), True, 0, True, Action.END, False, 0, ""),
    (violation(), True, 0, True, Action.END, False, 0, ""),
    (RuntimeError("bug"), True, 0, True, Action.END, False, 0, ""),
    # A share refused as busy: back in the queue, whatever the checkpoints and the count.
    (busy_share(), True, 0, False, Action.REQUEUE, False, 0, f"{WHO} is busy"),
    (busy_share(), True, 2, True, Action.REQUEUE, False, 0, f"{WHO} is busy"),
    (busy_share(), False, 0, True, Action.END, False, 0, ""),
]


@pytest.mark.parametrize(
    ("failure", "active", "restarts", "has_checkpoint", "action", "gave_up", "number", "culprit"),
    CASES,
)
def test_each_failure_gets_one_decision(
    failure: BaseException,
    active: bool,
    restarts: int,
    has_checkpoint: bool,
    action: Action,
    gave_up: bool,
    number: int,
    culprit: str,
) -> None:
    decision = POLICY.decide(
        failure, "T", active=active, restarts=restarts, has_checkpoint=has_checkpoint
    )
    assert (decision.action, decision.gave_up, decision.number, decision.culprit) == (
        action,
        gave_up,
        number,
        culprit,
    )


@pytest.mark.parametrize(
    ("failure", "active", "wanted"),
    [
        (TrainerLost("gone"), True, True),
        (TrainerLost("gone"), False, False),
        (busy_share(), True, False),
        (TrainerFailed("x", "bad dataset"), True, False),
    ],
)
def test_checkpoints_are_read_only_when_the_decision_depends_on_them(
    failure: BaseException, active: bool, wanted: bool
) -> None:
    assert POLICY.wants_checkpoints(failure, active) is wanted


def test_the_decision_carries_the_failure_s_ending() -> None:
    for failure in (TrainerLost("gone"), TrainerCrashed("boom"), busy_share(), violation()):
        decision = POLICY.decide(failure, "T", active=True, restarts=0, has_checkpoint=True)
        assert decision.ending == end_of(failure)
