"""Where the trainer's errors become gRPC statuses with rich details.

Domain errors (``trainer_service.core.errors``) carry their code and reason as class data and go
through ``trainwire_ops.rich_status.error_status``, the builder the gateway and the test fakes
use too. Besides them:

| error | status | details |
| --- | --- | --- |
| ProviderError | its ``code`` | LocalizedMessage (user message) + ErrorInfo (its reason) |
| ContractViolation | INTERNAL | ErrorInfo CONTRACT_VIOLATION (metadata ``rule``) |
| anything else | INTERNAL | LocalizedMessage (UNEXPECTED_MESSAGE) + ErrorInfo INTERNAL_ERROR |

Statuses are applied with ``set_code`` / ``set_details`` / ``set_trailing_metadata`` rather than
``abort_with_status`` so that the handler returns normally (and ``grpc_testing``, which lacks
``abort_with_status``, sees the same status as a real client).
"""

from __future__ import annotations

import logging

import grpc

from trainer_service.core.errors import TrainerError
from trainer_service.core.provider import ProviderError
from trainwire import contract
from trainwire.reasons import ErrorReason
from trainwire_ops.rich_status import apply, error_status, rich_status

_LOGGER = logging.getLogger(__name__)

UNEXPECTED_MESSAGE = "Training stopped unexpectedly."
#: The reason that alone means "busy, try again": ``RESOURCE_EXHAUSTED`` without it may also
#: mean a message too large or a device out of memory.
SLOTS_BUSY = ErrorReason.SLOTS_BUSY


def _status_code(name: str) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` called ``name``; FAILED_PRECONDITION for a bad name."""
    code = getattr(grpc.StatusCode, name, None)
    if not isinstance(code, grpc.StatusCode) or code is grpc.StatusCode.OK:
        _LOGGER.warning("provider gave an invalid status code %r; using FAILED_PRECONDITION", name)
        return grpc.StatusCode.FAILED_PRECONDITION
    return code


def to_status(exc: BaseException, run_id: str) -> grpc.Status:
    """Maps an exception raised while serving ``run_id`` to the status the client receives.

    Logs what the client does not see: a provider error's detail, an unexpected exception's
    traceback (once, here). An invalid ``run_id`` is never echoed whole nor put in metadata.
    """
    shown = contract.display_run_id(run_id) if run_id else "(none)"
    if contract.check_run_id(run_id):
        run_id = ""
    if isinstance(exc, TrainerError):
        return error_status(exc)
    if isinstance(exc, ProviderError):
        code = _status_code(exc.code)
        _LOGGER.warning(
            "run %s: provider failed (%s, %s): %s | %s",
            shown,
            code.name,
            exc.reason,
            exc.user_message,
            exc.detail,
        )
        return rich_status(
            code,
            f"run {shown}: {exc.user_message}",
            exc.reason,
            metadata={"run_id": run_id},
            localized=exc.user_message,
        )
    if isinstance(exc, contract.ContractViolation):
        # Already logged as CONTRACT VIOLATION where it was detected.
        return rich_status(
            grpc.StatusCode.INTERNAL,
            f"run {shown}: the trainer produced an invalid episode stream ({exc.rule})",
            ErrorReason.CONTRACT_VIOLATION,
            metadata={"run_id": run_id, "rule": exc.rule},
        )
    _LOGGER.error("run %s: training stopped unexpectedly", shown, exc_info=exc)
    return rich_status(
        grpc.StatusCode.INTERNAL,
        f"run {shown}: {UNEXPECTED_MESSAGE}",
        ErrorReason.INTERNAL_ERROR,
        metadata={"run_id": run_id},
        localized=UNEXPECTED_MESSAGE,
    )


#: Sets a status on the RPC without raising; the handler then returns.
apply_status = apply
