"""The trainer's domain errors.

Each class carries its status code (a ``grpc.StatusCode`` name: the core imports no grpc) and its
``ErrorInfo`` reason (``trainwire.reasons``) as class data, the same shape as the gateway's
``gateway.core.errors`` (``InvalidRequest`` and ``ShuttingDown`` mean the same in both);
``trainer_service.status`` builds the statuses with ``trainwire_ops.rich_status``.

| error | status | reason |
| --- | --- | --- |
| InvalidRequest | INVALID_ARGUMENT + BadRequest + LocalizedMessage | INVALID_REQUEST |
| NoFreeSlot | RESOURCE_EXHAUSTED | SLOTS_BUSY (metadata slots_total) |
| JobExists | ALREADY_EXISTS | JOB_EXISTS |
| JobNotFound | NOT_FOUND | JOB_NOT_FOUND |
| EpisodesNotHeld | FAILED_PRECONDITION | EPISODES_NOT_HELD |
| Reattached | ABORTED | REATTACHED |
| JobCancelled | CANCELLED | JOB_CANCELLED |
| JobFinished | FAILED_PRECONDITION | JOB_FINISHED |
| ShuttingDown | UNAVAILABLE | SHUTTING_DOWN |
| CheckpointNotFound | NOT_FOUND | CHECKPOINT_NOT_FOUND |
| CheckpointCorrupt | DATA_LOSS | CHECKPOINT_CORRUPT |
| CheckpointStoreUnavailable | UNAVAILABLE | CHECKPOINT_STORE_UNAVAILABLE |

``ProviderError`` (a provider's failure, with a message for users) lives in
``trainer_service.core.provider`` next to the interface providers implement;
``trainwire.contract.ContractViolation`` is the contract's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from trainwire.contract import FieldViolation, check_run_id, describe_violations, display_run_id
from trainwire.reasons import ErrorReason


class TrainerError(Exception):
    """Base of the trainer's domain errors; ``run_id`` names the job ("" when the request's id
    is missing or invalid: such an id is never echoed whole)."""

    #: The ``grpc.StatusCode`` name of the status it becomes.
    status_code: ClassVar[str] = "INTERNAL"
    #: Its ``ErrorInfo`` reason.
    reason: ClassVar[ErrorReason] = ErrorReason.INTERNAL_ERROR

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(f"run {display_run_id(run_id)}: {message}" if run_id else message)
        self.run_id = run_id if run_id and not check_run_id(run_id) else ""

    def error_metadata(self) -> dict[str, str]:
        """``ErrorInfo.metadata``: the run id, when it is a valid one."""
        return {"run_id": self.run_id} if self.run_id else {}


class InvalidRequest(TrainerError):
    """The request has bad fields (maps to ``INVALID_ARGUMENT`` + ``google.rpc.BadRequest`` and
    a ``LocalizedMessage`` that the gateway shows its user)."""

    status_code = "INVALID_ARGUMENT"
    reason = ErrorReason.INVALID_REQUEST

    def __init__(
        self, run_id: str, violations: Sequence[FieldViolation], message: str = ""
    ) -> None:
        super().__init__(run_id, message or f"invalid request: {describe_violations(violations)}")
        self.violations = tuple(violations)
        self.user_message = message or (
            f"The trainer refused this task: {describe_violations(violations)}"
        )


class NoFreeSlot(TrainerError):
    """Every slot is busy (maps to ``RESOURCE_EXHAUSTED`` with reason ``SLOTS_BUSY``)."""

    status_code = "RESOURCE_EXHAUSTED"
    reason = ErrorReason.SLOTS_BUSY

    def __init__(self, run_id: str, slots_total: int) -> None:
        super().__init__(
            run_id,
            f"all {slots_total} trainer slot(s) are busy; try again later or another trainer",
        )
        self.slots_total = slots_total

    def error_metadata(self) -> dict[str, str]:
        return {**super().error_metadata(), "slots_total": str(self.slots_total)}


class ShuttingDown(TrainerError):
    """The trainer is shutting down (maps to ``UNAVAILABLE``)."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.SHUTTING_DOWN

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "the trainer is shutting down; try another trainer")


class JobExists(TrainerError):
    """A job of this run is live and the call did not ask to re-attach (``ALREADY_EXISTS``)."""

    status_code = "ALREADY_EXISTS"
    reason = ErrorReason.JOB_EXISTS

    def __init__(self, run_id: str) -> None:
        super().__init__(
            run_id,
            "a job of this run is already live; re-attach with attach_after_episode "
            "or cancel it first",
        )


class JobNotFound(TrainerError):
    """No live job has this run id (``NOT_FOUND``)."""

    status_code = "NOT_FOUND"
    reason = ErrorReason.JOB_NOT_FOUND

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "no live job of this run on this trainer")


class EpisodesNotHeld(TrainerError):
    """A re-attach asked for episodes the job no longer holds (``FAILED_PRECONDITION``)."""

    status_code = "FAILED_PRECONDITION"
    reason = ErrorReason.EPISODES_NOT_HELD

    def __init__(self, run_id: str, after_episode: int, first_held: int, last: int) -> None:
        super().__init__(
            run_id,
            f"cannot re-attach after episode {after_episode}: the job holds episodes "
            f"{first_held}..{last} only",
        )
        self.after_episode = after_episode


class Reattached(TrainerError):
    """Another ``Train`` call re-attached to this job; this stream ends (``ABORTED``)."""

    status_code = "ABORTED"
    reason = ErrorReason.REATTACHED

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "another caller re-attached to this job; this stream ends")


class JobCancelled(TrainerError):
    """The job was cancelled with ``CancelJob`` while this stream was attached (``CANCELLED``)."""

    status_code = "CANCELLED"
    reason = ErrorReason.JOB_CANCELLED

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "the job was cancelled")


class JobFinished(TrainerError):
    """The job has trained its last episode or stopped, so a change of its hyperparameters
    has no step left to act on (``FAILED_PRECONDITION``)."""

    status_code = "FAILED_PRECONDITION"
    reason = ErrorReason.JOB_FINISHED

    def __init__(self, run_id: str, last_episode: int) -> None:
        super().__init__(
            run_id,
            f"the job has no optimizer step left to change: it ended at episode {last_episode}",
        )


class CheckpointNotFound(TrainerError):
    """The checkpoint store holds no such checkpoint (``NOT_FOUND``)."""

    status_code = "NOT_FOUND"
    reason = ErrorReason.CHECKPOINT_NOT_FOUND


class CheckpointCorrupt(TrainerError):
    """A stored checkpoint does not match its digest (``DATA_LOSS``)."""

    status_code = "DATA_LOSS"
    reason = ErrorReason.CHECKPOINT_CORRUPT


class CheckpointStoreUnavailable(TrainerError):
    """The trainer has no checkpoint store, or cannot read it (``UNAVAILABLE``)."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.CHECKPOINT_STORE_UNAVAILABLE
