"""Domain errors of the gateway core.

Each class carries its status code (a ``grpc.StatusCode`` name: the core imports no grpc) and its
``ErrorInfo`` reason (``trainwire.reasons``) as class data; ``gateway.status`` turns them into
rich statuses with ``trainwire_ops.rich_status``, the builder the trainer uses too.

| error | status | reason |
| --- | --- | --- |
| RunNotFound | NOT_FOUND | RUN_NOT_FOUND |
| IllegalTransition | FAILED_PRECONDITION | ILLEGAL_TRANSITION |
| InvalidRequest | INVALID_ARGUMENT + BadRequest | INVALID_REQUEST |
| ShuttingDown | UNAVAILABLE | SHUTTING_DOWN |
| TrainerUnavailable | UNAVAILABLE | TRAINER_UNAVAILABLE |
| TooManyPending | RESOURCE_EXHAUSTED | TOO_MANY_PENDING |
| CheckpointNotFound | NOT_FOUND | CHECKPOINT_NOT_FOUND |
| CheckpointCorrupt | DATA_LOSS | CHECKPOINT_CORRUPT |
| CheckpointStoreUnavailable | UNAVAILABLE | CHECKPOINT_STORE_UNAVAILABLE |
| Unauthenticated | UNAUTHENTICATED | UNAUTHENTICATED |
| PermissionDenied | PERMISSION_DENIED | PERMISSION_DENIED |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from trainwire.contract import FieldViolation
from trainwire.reasons import ErrorReason


class GatewayError(Exception):
    """Base of every error the gateway reports to a client.

    Attributes:
        run_id: The run the error is about ("" when none).
    """

    #: The ``grpc.StatusCode`` name of the status it becomes.
    status_code: ClassVar[str] = "INTERNAL"
    #: Its ``ErrorInfo`` reason.
    reason: ClassVar[ErrorReason] = ErrorReason.INTERNAL_ERROR

    def __init__(self, message: str, run_id: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id

    def error_metadata(self) -> dict[str, str]:
        """``ErrorInfo.metadata``: the run id, when the error is about a run."""
        return {"run_id": self.run_id} if self.run_id else {}


class RunNotFound(GatewayError):
    """No run has this id (or it was deleted)."""

    status_code = "NOT_FOUND"
    reason = ErrorReason.RUN_NOT_FOUND

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found", run_id)


class IllegalTransition(GatewayError):
    """A control that does not fit the run's state (pause a finished run, ...)."""

    status_code = "FAILED_PRECONDITION"
    reason = ErrorReason.ILLEGAL_TRANSITION


class InvalidRequest(GatewayError):
    """Bad request fields; ``violations`` lists every one of them."""

    status_code = "INVALID_ARGUMENT"
    reason = ErrorReason.INVALID_REQUEST

    def __init__(
        self, message: str, violations: Sequence[FieldViolation], run_id: str = ""
    ) -> None:
        super().__init__(message, run_id)
        self.violations = tuple(violations)


class ShuttingDown(GatewayError):
    """The gateway is shutting down; the client should retry (watchers resume)."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.SHUTTING_DOWN


class TrainerUnavailable(GatewayError):
    """No trainer could be reached."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.TRAINER_UNAVAILABLE


class StoreUnavailable(GatewayError):
    """The store cannot be written (disk full, read-only): runs cannot be created or saved."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.STORE_UNAVAILABLE


class TooManyPending(GatewayError):
    """The gateway already has its maximum of PENDING runs (``--max-pending``)."""

    status_code = "RESOURCE_EXHAUSTED"
    reason = ErrorReason.TOO_MANY_PENDING


class CheckpointNotFound(GatewayError):
    """The run has no checkpoint at that episode; the message lists the ones it has."""

    status_code = "NOT_FOUND"
    reason = ErrorReason.CHECKPOINT_NOT_FOUND


class CheckpointCorrupt(GatewayError):
    """A stored checkpoint no longer matches its recorded digest."""

    status_code = "DATA_LOSS"
    reason = ErrorReason.CHECKPOINT_CORRUPT


class CheckpointStoreUnavailable(GatewayError):
    """The checkpoint store cannot be read."""

    status_code = "UNAVAILABLE"
    reason = ErrorReason.CHECKPOINT_STORE_UNAVAILABLE


class Unauthenticated(GatewayError):
    """No token, or one the gateway does not know (``--auth-tokens``)."""

    status_code = "UNAUTHENTICATED"
    reason = ErrorReason.UNAUTHENTICATED


class PermissionDenied(GatewayError):
    """The caller's role is too low for the call; the message names the role needed.

    Attributes:
        metadata: ``required_role``, for ``ErrorInfo``.
    """

    status_code = "PERMISSION_DENIED"
    reason = ErrorReason.PERMISSION_DENIED

    def __init__(self, message: str, required_role: str) -> None:
        super().__init__(message)
        self.metadata = {"required_role": required_role}

    def error_metadata(self) -> dict[str, str]:
        return {**super().error_metadata(), **self.metadata}
