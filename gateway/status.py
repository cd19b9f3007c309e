"""The one place where domain errors become gRPC statuses.

``STATUS_CODES`` is the table (style.md, "Errors"); ``map_errors`` applies it to a servicer
method, unary or streaming. An unexpected exception is logged once with its traceback and
answered ``INTERNAL`` with a plain message, never a traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from gateway.core.errors import (
    GatewayError,
    IllegalTransition,
    InvalidRequest,
    PermissionDenied,
    RunNotFound,
    ShuttingDown,
    TooManyPending,
    TrainerUnavailable,
    Unauthenticated,
)
from trainwire.contract import ContractViolation, bad_request

_LOGGER = logging.getLogger(__name__)

ERROR_DOMAIN = "trainwire"

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    RunNotFound: grpc.StatusCode.NOT_FOUND,
    IllegalTransition: grpc.StatusCode.FAILED_PRECONDITION,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    TrainerUnavailable: grpc.StatusCode.UNAVAILABLE,
    TooManyPending: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ContractViolation: grpc.StatusCode.INTERNAL,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_code_for(exc: Exception) -> grpc.StatusCode:
    """The status code of a domain error (INTERNAL for anything unknown)."""
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def _reason(class_name: str) -> str:
    """``RunNotFound`` -> ``RUN_NOT_FOUND``: ErrorInfo reasons are UPPER_SNAKE_CASE."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).upper()


def to_status(exc: Exception) -> grpc.Status:
    """The rich status of a domain error: code, message, ``ErrorInfo`` and, for bad requests,
    ``BadRequest`` with every field violation."""
    code = status_code_for(exc)
    details: list[any_pb2.Any] = []
    if isinstance(exc, InvalidRequest):
        packed = any_pb2.Any()
        packed.Pack(bad_request(exc.violations))
        details.append(packed)
    info = error_details_pb2.ErrorInfo(reason=_reason(type(exc).__name__), domain=ERROR_DOMAIN)
    run_id = getattr(exc, "run_id", "")
    if run_id:
        info.metadata["run_id"] = run_id
    info.metadata.update(getattr(exc, "metadata", {}))
    packed = any_pb2.Any()
    packed.Pack(info)
    details.append(packed)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=str(exc), details=details)
    return rpc_status.to_status(status)


F = TypeVar("F", bound=Callable[..., Any])


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, GatewayError | ContractViolation):
        run_id = getattr(exc, "run_id", "")
        extra = {"run_id": run_id} if run_id else None
        _LOGGER.info("%s: %s: %s", method, status_code_for(exc).name, exc, extra=extra)
        await context.abort_with_status(to_status(exc))
    _LOGGER.exception("%s failed unexpectedly", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: internal error (logged)")


def map_errors(method: F) -> F:
    """Decorates a servicer method: domain errors become their statuses (see the table)."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, name, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, name, exc)

    return unary  # type: ignore[return-value]
