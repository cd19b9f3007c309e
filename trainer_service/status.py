"""The one table that turns the trainer's domain errors into gRPC statuses with rich details.

| domain error | status | details |
| --- | --- | --- |
| InvalidRequest | INVALID_ARGUMENT | google.rpc.BadRequest |
| NoFreeSlot | RESOURCE_EXHAUSTED | ErrorInfo SLOTS_BUSY |
| JobExists | ALREADY_EXISTS | ErrorInfo JOB_EXISTS |
| JobNotFound | NOT_FOUND | ErrorInfo JOB_NOT_FOUND |
| EpisodesNotHeld | FAILED_PRECONDITION | ErrorInfo EPISODES_NOT_HELD |
| Reattached | ABORTED | ErrorInfo REATTACHED |
| JobCancelled | CANCELLED | ErrorInfo JOB_CANCELLED |
| ShuttingDown | UNAVAILABLE | ErrorInfo SHUTTING_DOWN |
| ProviderError | its ``code`` | LocalizedMessage (user message) + ErrorInfo (its reason) |
| ContractViolation | INTERNAL | ErrorInfo CONTRACT_VIOLATION |
| anything else | INTERNAL | LocalizedMessage "Training stopped unexpectedly." + ErrorInfo |

Statuses are applied with ``set_code`` / ``set_details`` / ``set_trailing_metadata`` rather than
``abort_with_status`` so that the handler returns normally (and ``grpc_testing``, which lacks
``abort_with_status``, sees the same status as a real client).
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from trainer_service.core.errors import (
    EpisodesNotHeld,
    InvalidRequest,
    JobCancelled,
    JobExists,
    JobNotFound,
    NoFreeSlot,
    Reattached,
    ShuttingDown,
)
from trainer_service.core.provider import ProviderError
from trainwire import contract

_LOGGER = logging.getLogger(__name__)

DOMAIN = "trainwire"
LOCALE = "en-US"
UNEXPECTED_MESSAGE = "Training stopped unexpectedly."
#: The reason that alone means "busy, try again" (design.md, "Status codes").
SLOTS_BUSY = "SLOTS_BUSY"

#: Job-table errors: status code and ErrorInfo reason.
_JOB_ERRORS: dict[type[BaseException], tuple[grpc.StatusCode, str]] = {
    JobExists: (grpc.StatusCode.ALREADY_EXISTS, "JOB_EXISTS"),
    JobNotFound: (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND"),
    EpisodesNotHeld: (grpc.StatusCode.FAILED_PRECONDITION, "EPISODES_NOT_HELD"),
    Reattached: (grpc.StatusCode.ABORTED, "REATTACHED"),
    JobCancelled: (grpc.StatusCode.CANCELLED, "JOB_CANCELLED"),
    ShuttingDown: (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"),
}


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _error_info(reason: str, run_id: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(
        reason=reason, domain=DOMAIN, metadata={"run_id": run_id, **metadata}
    )


def _status_code(name: str) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` called ``name``; INTERNAL-proof fallback for a bad name."""
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
    details: list[Message]
    if isinstance(exc, InvalidRequest):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        # The LocalizedMessage is what the gateway shows the run's user.
        details = [
            contract.bad_request(exc.violations),
            error_details_pb2.LocalizedMessage(locale=LOCALE, message=exc.user_message),
        ]
    elif isinstance(exc, NoFreeSlot):
        code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        details = [_error_info(SLOTS_BUSY, run_id, slots_total=str(exc.slots_total))]
    elif type(exc) in _JOB_ERRORS:
        code, reason = _JOB_ERRORS[type(exc)]
        message = str(exc)
        details = [_error_info(reason, run_id)]
    elif isinstance(exc, ProviderError):
        code = _status_code(exc.code)
        message = f"run {shown}: {exc.user_message}"
        details = [
            error_details_pb2.LocalizedMessage(locale=LOCALE, message=exc.user_message),
            _error_info(exc.reason, run_id),
        ]
        _LOGGER.warning(
            "run %s: provider failed (%s, %s): %s | %s",
            shown,
            code.name,
            exc.reason,
            exc.user_message,
            exc.detail,
        )
    elif isinstance(exc, contract.ContractViolation):
        # Already logged as CONTRACT VIOLATION where it was detected.
        code = grpc.StatusCode.INTERNAL
        message = f"run {shown}: the trainer produced an invalid episode stream ({exc.rule})"
        details = [_error_info("CONTRACT_VIOLATION", run_id, rule=exc.rule)]
    else:
        _LOGGER.error("run %s: training stopped unexpectedly", shown, exc_info=exc)
        code = grpc.StatusCode.INTERNAL
        message = f"run {shown}: {UNEXPECTED_MESSAGE}"
        details = [
            error_details_pb2.LocalizedMessage(locale=LOCALE, message=UNEXPECTED_MESSAGE),
            _error_info("INTERNAL_ERROR", run_id),
        ]
    status = status_pb2.Status(
        code=getattr(code_pb2, code.name), message=message, details=[_pack(d) for d in details]
    )
    return rpc_status.to_status(status)


def apply_status(context: grpc.ServicerContext, status: grpc.Status) -> None:
    """Sets ``status`` on the RPC; the handler then returns."""
    context.set_trailing_metadata(status.trailing_metadata)
    context.set_code(status.code)
    context.set_details(status.details)
