"""Domain errors of the gateway core. Mapped to gRPC status codes in ``gateway.status`` only."""

from __future__ import annotations

from collections.abc import Sequence

from trainwire.contract import FieldViolation


class GatewayError(Exception):
    """Base of every error the gateway reports to a client.

    Attributes:
        run_id: The run the error is about ("" when none).
    """

    def __init__(self, message: str, run_id: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id


class RunNotFound(GatewayError):
    """No run has this id (or it was deleted)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found", run_id)


class IllegalTransition(GatewayError):
    """A control that does not fit the run's state (pause a finished run, ...)."""


class InvalidRequest(GatewayError):
    """Bad request fields; ``violations`` lists every one of them."""

    def __init__(
        self, message: str, violations: Sequence[FieldViolation], run_id: str = ""
    ) -> None:
        super().__init__(message, run_id)
        self.violations = tuple(violations)


class ShuttingDown(GatewayError):
    """The gateway is shutting down; the client should retry (watchers resume)."""


class TrainerUnavailable(GatewayError):
    """No trainer could be reached."""


class TooManyPending(GatewayError):
    """The gateway already has its maximum of PENDING runs (``--max-pending``)."""


class Unauthenticated(GatewayError):
    """No token, or one the gateway does not know (``--auth-tokens``)."""


class PermissionDenied(GatewayError):
    """The caller's role is too low for the call; the message names the role needed.

    Attributes:
        metadata: ``required_role``, for ``ErrorInfo``.
    """

    def __init__(self, message: str, required_role: str) -> None:
        super().__init__(message)
        self.metadata = {"required_role": required_role}
