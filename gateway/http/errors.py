"""Errors of the HTTP face: gRPC statuses as Google API JSON error bodies.

Domain errors become statuses in one place, ``gateway.status`` (its table, its ``to_status``);
this module only carries a status over HTTP: the HTTP code of each gRPC code (the mapping of
``google/rpc/code.proto``, except FAILED_PRECONDITION, which answers 409: a control that does
not fit the run's state conflicts with it) and the body
``{"error": {"code": 404, "status": "NOT_FOUND", "message": "...", "details": [...]}}`` whose
``details`` are the status's ``google.rpc`` details (``ErrorInfo``, ``BadRequest``) in the
protobuf JSON mapping, as Google APIs answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import status_pb2
from grpc_status import rpc_status

from gateway.core.errors import GatewayError
from gateway.status import status_code_for, to_status
from trainwire.contract import ContractViolation

_LOGGER = logging.getLogger(__name__)

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}

#: The gRPC code named in the body of an error that aiohttp raised itself (no route, ...).
_CODE_OF_HTTP: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.OUT_OF_RANGE,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class HttpAbort(grpc.aio.AbortError):
    """A call ended with a status (raised by ``HttpContext.abort*``).

    It is a ``grpc.aio.AbortError`` so that ``gateway.status.map_errors`` lets it through as it
    does a real abort.

    Attributes:
        status: The status, as ``grpc_status.rpc_status.to_status`` builds it.
    """

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.status = status


def status_of(exc: Exception, what: str) -> grpc.Status:
    """The status of an exception raised outside a servicer method (parsing a request, ...),
    logged as ``gateway.status`` logs what it maps: one INFO line for a domain error, the
    traceback for anything else."""
    if isinstance(exc, GatewayError | ContractViolation):
        run_id = getattr(exc, "run_id", "")
        extra = {"run_id": run_id} if run_id else None
        _LOGGER.info("%s: %s: %s", what, status_code_for(exc).name, exc, extra=extra)
        return to_status(exc)
    _LOGGER.exception("%s failed unexpectedly", what)
    return plain_status(grpc.StatusCode.INTERNAL, f"{what} failed: internal error (logged)")


def plain_status(code: grpc.StatusCode, message: str) -> grpc.Status:
    """A status without details."""
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message))


def status_for_http(http_status: int, message: str) -> grpc.Status:
    """The status of an HTTP error that no servicer answered (an unknown path, a method the
    path does not take)."""
    code = _CODE_OF_HTTP.get(http_status)
    if code is None:
        code = grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.UNKNOWN
    return plain_status(code, message)


def _rich(status: grpc.Status) -> status_pb2.Status:
    for key, value in status.trailing_metadata or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    return status_pb2.Status(code=status.code.value[0], message=status.details or "")


def error_body(status: grpc.Status, http_status: int | None = None) -> tuple[int, bytes]:
    """The HTTP status and JSON body of a status."""
    rich = _rich(status)
    code = http_status or HTTP_STATUS.get(status.code, 500)
    error: dict[str, Any] = {
        "code": code,
        "status": status.code.name,
        "message": rich.message or status.code.name,
    }
    if rich.details:
        error["details"] = [json_format.MessageToDict(detail) for detail in rich.details]
    return code, json.dumps({"error": error}, ensure_ascii=False).encode()
