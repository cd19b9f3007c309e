"""The one place where domain errors become gRPC statuses.

Each ``GatewayError`` carries its code and ``ErrorInfo`` reason as class data
(``gateway.core.errors``); ``to_status`` builds the rich status with
``trainwire_ops.rich_status``, the builder the trainer and the test fakes use too.
``map_errors`` applies it to a servicer method, unary or streaming. An unexpected exception is
logged once with its traceback and answered ``INTERNAL`` with a plain message, never a traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from gateway.core.errors import GatewayError
from trainwire.contract import ContractViolation
from trainwire.reasons import ErrorReason
from trainwire_ops.rich_status import error_status, rich_status, status_code

_LOGGER = logging.getLogger(__name__)


def _domain_errors(base: type[GatewayError]) -> list[type[GatewayError]]:
    found = []
    for cls in base.__subclasses__():
        found.append(cls)
        found.extend(_domain_errors(cls))
    return found


def status_code_for(exc: Exception) -> grpc.StatusCode:
    """The status code of a domain error (INTERNAL for anything unknown)."""
    if isinstance(exc, GatewayError):
        return status_code(type(exc).status_code)
    return grpc.StatusCode.INTERNAL


def status_codes() -> dict[type[Exception], grpc.StatusCode]:
    """Every domain error the gateway answers with, and its status code (the table, as data)."""
    table: dict[type[Exception], grpc.StatusCode] = {
        cls: status_code(cls.status_code) for cls in _domain_errors(GatewayError)
    }
    table[ContractViolation] = grpc.StatusCode.INTERNAL
    return table


#: The table, derived from the classes' data (tests and the HTTP side read it).
STATUS_CODES = status_codes()


def to_status(exc: Exception) -> grpc.Status:
    """The rich status of a domain error: code, message, ``ErrorInfo`` with its reason and
    metadata and, for bad requests, ``BadRequest`` with every field violation."""
    if isinstance(exc, GatewayError):
        return error_status(exc)
    if isinstance(exc, ContractViolation):
        return rich_status(grpc.StatusCode.INTERNAL, str(exc), ErrorReason.CONTRACT_VIOLATION)
    return rich_status(grpc.StatusCode.INTERNAL, str(exc), ErrorReason.INTERNAL_ERROR)


F = TypeVar("F", bound=Callable[..., Any])


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, GatewayError | ContractViolation):
        run_id = getattr(exc, "run_id", "")
        extra = {"run_id": run_id} if run_id else None
        _LOGGER.info("%s: %s: %s", method, status_code_for(exc).name, exc, extra=extra)
        await context.abort_with_status(to_status(exc))
    _LOGGER.exception("%s failed unexpectedly", method)
    await context.abort_with_status(
        rich_status(
            grpc.StatusCode.INTERNAL,
            f"{method} failed: internal error (logged)",
            ErrorReason.INTERNAL_ERROR,
        )
    )


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
