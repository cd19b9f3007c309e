"""The restart policy: the one decision on what a driven run does after its job failed.

``RestartPolicy.decide`` turns the failure, whether the run is active (RUNNING or PAUSED),
whether it has a checkpoint to continue from and its restart count into a ``Decision``:

- ``REQUEUE``: a trainer refused its share of a job spanning trainers as busy. Rank 0 waits for
  every rank, so the job never trained: it is cancelled and the run goes back in the queue at
  its place, with no restart counted.
- ``RESTART``: the trainer or the job's process died (``Ending.restartable``), the run is
  active, has a checkpoint and has restarts left: it is placed again from its newest usable
  checkpoint, as restart ``number`` of ``max_restarts``.
- ``END``: anything else. ``gave_up`` says the failure came after the last restart.

Pure: the driver reads the checkpoints (only when ``wants_checkpoints``) and carries out the
decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.core.ending import Ending, end_of
from gateway.core.shares import ShareFailed, SharesNotReattached
from gateway.core.trainers import TrainerBusy


class Action(enum.Enum):
    """What the driver does with a run whose job failed."""

    REQUEUE = "requeue"
    RESTART = "restart"
    END = "end"


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's answer.

    Attributes:
        action: Requeue, restart or end.
        ending: How the failure maps to users, metrics and the trainer's job (``end_of``).
        gave_up: ``END`` because ``max_restarts`` restarts were spent.
        number: ``RESTART``: the restart's number (the run's new ``restarts``).
        culprit: ``REQUEUE`` and ``RESTART``: who failed, for people.
    """

    action: Action
    ending: Ending
    gave_up: bool = False
    number: int = 0
    culprit: str = ""


def _busy_share(failure: BaseException) -> bool:
    return isinstance(failure, ShareFailed) and isinstance(failure.cause, TrainerBusy)


def culprit_of(failure: BaseException, trainer: str) -> str:
    """Who failed, for people: the gateway, another trainer's share, or rank 0's trainer."""
    if isinstance(failure, SharesNotReattached):
        return "the gateway restarted (its job spanned trainers)"
    if isinstance(failure, ShareFailed):
        return f"{failure.who} failed"
    return f"trainer {trainer} failed"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Decides requeue, restart or end (see the module docstring)."""

    max_restarts: int

    def wants_checkpoints(self, failure: BaseException, active: bool) -> bool:
        """Whether the decision depends on the run having a checkpoint (only then does the
        driver read them)."""
        return active and not _busy_share(failure) and end_of(failure).restartable

    def decide(
        self,
        failure: BaseException,
        trainer: str,
        *,
        active: bool,
        restarts: int,
        has_checkpoint: bool,
    ) -> Decision:
        """The decision for ``failure`` of the job on rank 0's ``trainer``.

        Args:
            failure: What ended the job's stream.
            trainer: Rank 0's trainer.
            active: The run is RUNNING or PAUSED (not PENDING, not ended).
            restarts: Restarts the run has had.
            has_checkpoint: The run has a checkpoint to continue from (False when they could
                not be read).
        """
        ending = end_of(failure)
        if active and _busy_share(failure):
            assert isinstance(failure, ShareFailed)
            return Decision(Action.REQUEUE, ending, culprit=f"{failure.who} is busy")
        if not (active and ending.restartable and has_checkpoint):
            return Decision(Action.END, ending)
        if restarts >= self.max_restarts:
            return Decision(Action.END, ending, gave_up=True)
        return Decision(
            Action.RESTART, ending, number=restarts + 1, culprit=culprit_of(failure, trainer)
        )
