"""Typed errors of the Trainwire client: one class per gRPC status code, and a subclass per
``ErrorInfo`` reason the gateway sends (``trainwire.reasons``), in the manner of googleapis'
``api_core.exceptions``.

``error_from_rpc`` maps a failed call, sync (``grpc.RpcError``) or asyncio
(``grpc.aio.AioRpcError``), to its class with the ``google.rpc`` details decoded: every
``BadRequest`` field violation, the ``LocalizedMessage`` text, the ``ErrorInfo`` reason and
metadata. Catch a code class (``NotFound``) to handle every cause of that code, or a reason class
(``RunNotFound``) for exactly one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from google.rpc import error_details_pb2, status_pb2

from trainwire.contract import FieldViolation
from trainwire.reasons import ERROR_DOMAIN, ErrorReason

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CheckpointStoreUnavailable",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "IllegalTransition",
    "Internal",
    "InvalidArgument",
    "InvalidRequest",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "RunNotFound",
    "ShuttingDown",
    "SlotsBusy",
    "StoreUnavailable",
    "TooManyPending",
    "TrainerUnavailable",
    "TrainwireError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "error_from_rpc",
]

_LOGGER = logging.getLogger(__name__)
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class TrainwireError(Exception):
    """A failed gateway call, or a watch stream that cannot be trusted.

    Attributes:
        code: The gRPC status code (``None`` only for errors raised without one).
        message: The server's message (it names the run id).
        field_violations: Every bad request field, from a ``google.rpc.BadRequest`` detail.
        localized_message: The text of a ``google.rpc.LocalizedMessage`` detail, if any.
        reason: The ``reason`` of a ``google.rpc.ErrorInfo`` detail ("" without one): an
            ``ErrorReason`` value when the reason is one of the declared set.
        metadata: The ``metadata`` of that ``ErrorInfo`` (empty without one).
        status: The whole ``google.rpc.Status`` the server sent, when it sent one.
    """

    grpc_code: grpc.StatusCode | None = None
    #: Set on the subclasses that stand for one ``ErrorInfo`` reason.
    error_reason: ErrorReason | None = None

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: Sequence[FieldViolation] = (),
        localized_message: str = "",
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
        status: status_pb2.Status | None = None,
    ) -> None:
        self.code = code if code is not None else self.grpc_code
        self.message = message
        self.field_violations: tuple[FieldViolation, ...] = tuple(field_violations)
        self.localized_message = localized_message
        if reason is None:
            reason = self.error_reason or ""
        self.reason: str = _declared(reason)
        self.metadata: dict[str, str] = dict(metadata or {})
        self.status = status
        super().__init__(message)

    @property
    def code_name(self) -> str:
        """The status code's name (``NOT_FOUND``), or ``ERROR`` without a code."""
        return self.code.name if self.code is not None else "ERROR"

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


class Cancelled(TrainwireError):
    """The call was cancelled (``CANCELLED``)."""

    grpc_code = grpc.StatusCode.CANCELLED


class Unknown(TrainwireError):
    """The server failed without saying why (``UNKNOWN``)."""

    grpc_code = grpc.StatusCode.UNKNOWN


class InvalidArgument(TrainwireError):
    """A bad request; ``field_violations`` lists every bad field (``INVALID_ARGUMENT``)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TrainwireError):
    """The call ran past its deadline (``DEADLINE_EXCEEDED``)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TrainwireError):
    """No such run (``NOT_FOUND``)."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TrainwireError):
    """``ALREADY_EXISTS`` (the gateway never sends it: request ids are idempotent)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TrainwireError):
    """``PERMISSION_DENIED``."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TrainwireError):
    """No capacity left (``RESOURCE_EXHAUSTED``)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TrainwireError):
    """An illegal transition, e.g. pausing a finished run (``FAILED_PRECONDITION``)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TrainwireError):
    """``ABORTED``."""

    grpc_code = grpc.StatusCode.ABORTED


class OutOfRange(TrainwireError):
    """``OUT_OF_RANGE``."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TrainwireError):
    """The server does not implement the method (``UNIMPLEMENTED``)."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TrainwireError):
    """A server bug or a contract violation (``INTERNAL``)."""

    grpc_code = grpc.StatusCode.INTERNAL


class Unavailable(TrainwireError):
    """The gateway (or its trainer) cannot be reached (``UNAVAILABLE``)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TrainwireError):
    """Episodes went missing: a watch stream skipped episodes (``DATA_LOSS``)."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TrainwireError):
    """``UNAUTHENTICATED``."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


_ERROR_CLASSES: dict[grpc.StatusCode, type[TrainwireError]] = {
    cls.grpc_code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
    if cls.grpc_code is not None
}


# -- one class per ErrorInfo reason the gateway sends (trainwire.reasons) -------------------------


class InvalidRequest(InvalidArgument):
    """Bad request fields, every one in ``field_violations`` (reason ``INVALID_REQUEST``)."""

    error_reason = ErrorReason.INVALID_REQUEST


class RunNotFound(NotFound):
    """No run has this id, or it was deleted (reason ``RUN_NOT_FOUND``)."""

    error_reason = ErrorReason.RUN_NOT_FOUND


class IllegalTransition(FailedPrecondition):
    """A control that does not fit the run's state (reason ``ILLEGAL_TRANSITION``)."""

    error_reason = ErrorReason.ILLEGAL_TRANSITION


class TooManyPending(ResourceExhausted):
    """The gateway holds its maximum of pending runs (reason ``TOO_MANY_PENDING``)."""

    error_reason = ErrorReason.TOO_MANY_PENDING


class SlotsBusy(ResourceExhausted):
    """A trainer has no free slot (reason ``SLOTS_BUSY``; callers of a trainer see it)."""

    error_reason = ErrorReason.SLOTS_BUSY


class ShuttingDown(Unavailable):
    """The service is shutting down; retry (``watch`` resumes by itself)."""

    error_reason = ErrorReason.SHUTTING_DOWN


class TrainerUnavailable(Unavailable):
    """No trainer could be reached (reason ``TRAINER_UNAVAILABLE``)."""

    error_reason = ErrorReason.TRAINER_UNAVAILABLE


class StoreUnavailable(Unavailable):
    """The gateway cannot write its store (reason ``STORE_UNAVAILABLE``)."""

    error_reason = ErrorReason.STORE_UNAVAILABLE


class CheckpointNotFound(NotFound):
    """The run has no checkpoint at that episode (reason ``CHECKPOINT_NOT_FOUND``)."""

    error_reason = ErrorReason.CHECKPOINT_NOT_FOUND


class CheckpointCorrupt(DataLoss):
    """A stored checkpoint no longer matches its digest (reason ``CHECKPOINT_CORRUPT``), or a
    download did not (raised by ``download_checkpoint``)."""

    error_reason = ErrorReason.CHECKPOINT_CORRUPT


class CheckpointStoreUnavailable(Unavailable):
    """The gateway cannot read the checkpoint store (reason ``CHECKPOINT_STORE_UNAVAILABLE``)."""

    error_reason = ErrorReason.CHECKPOINT_STORE_UNAVAILABLE


_CODE_CLASSES: dict[grpc.StatusCode, type[TrainwireError]] = {
    cls.grpc_code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
    if cls.grpc_code is not None
}

#: (code, reason) -> the reason's class. A reason only selects its class together with the code
#: it is declared with, so a server that pairs them oddly still gets its code's class.
_REASON_CLASSES: dict[tuple[grpc.StatusCode, ErrorReason], type[TrainwireError]] = {
    (cls.grpc_code, cls.error_reason): cls
    for cls in (
        InvalidRequest,
        RunNotFound,
        IllegalTransition,
        TooManyPending,
        SlotsBusy,
        ShuttingDown,
        TrainerUnavailable,
        StoreUnavailable,
        CheckpointNotFound,
        CheckpointCorrupt,
        CheckpointStoreUnavailable,
    )
    if cls.grpc_code is not None and cls.error_reason is not None
}


def _declared(reason: str) -> str:
    """``reason`` as an ``ErrorReason`` when it is one (it compares equal to its string)."""
    try:
        return ErrorReason(reason)
    except ValueError:
        return reason


def error_class(code: grpc.StatusCode, reason: str = "") -> type[TrainwireError]:
    """The class ``error_from_rpc`` raises for a status ``code`` with ``ErrorInfo`` ``reason``."""
    declared = _declared(reason)
    if isinstance(declared, ErrorReason):
        cls = _REASON_CLASSES.get((code, declared))
        if cls is not None:
            return cls
    return _CODE_CLASSES.get(code, TrainwireError)


def rich_status(exc: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` in a failed call's trailers (sync or asyncio call).

    None when there is none, when it does not parse, or when its code differs from the call's
    (then the call itself is trusted).
    """
    try:
        calls = (grpc.Call, grpc.aio.AioRpcError)
        trailers = exc.trailing_metadata() if isinstance(exc, calls) else ()
    except Exception:  # a half-built call (e.g. a local failure) has no usable trailers
        _LOGGER.debug("no status details on %r", exc, exc_info=True)
        return None
    for key, value in trailers or ():
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:
            _LOGGER.debug("ignoring malformed status details", exc_info=True)
            return None
        code = exc.code()
        if code is not None and status.code != code.value[0]:
            _LOGGER.debug("ignoring status details of code %d on %s", status.code, code.name)
            return None
        return status
    return None


def error_from_rpc(exc: grpc.RpcError) -> TrainwireError:
    """Maps a failed call to its typed ``TrainwireError``, decoding ``google.rpc`` details.

    Use as ``raise error_from_rpc(exc) from exc`` so the original error stays attached. Works
    for sync calls and for ``grpc.aio.AioRpcError``.
    """
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    message = ""
    if isinstance(exc, grpc.Call | grpc.aio.AioRpcError):
        code = exc.code() or grpc.StatusCode.UNKNOWN
        message = exc.details() or ""
    if not message:
        message = code.name.lower().replace("_", " ")
    violations: list[FieldViolation] = []
    localized = ""
    reason = ""
    metadata: dict[str, str] = {}
    status = rich_status(exc)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.extend(
                    FieldViolation(v.field, v.description) for v in bad.field_violations
                )
            elif detail.Is(error_details_pb2.LocalizedMessage.DESCRIPTOR):
                text = error_details_pb2.LocalizedMessage()
                detail.Unpack(text)
                localized = text.message
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain in ("", ERROR_DOMAIN):
                    reason = info.reason
                    metadata = dict(info.metadata)
    cls = error_class(code, reason)
    return cls(
        message,
        code=code,
        field_violations=violations,
        localized_message=localized,
        reason=reason,
        metadata=metadata,
        status=status,
    )
