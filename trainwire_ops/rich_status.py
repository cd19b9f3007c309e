"""The one builder of rich gRPC statuses, for both services and the test fakes.

A Trainwire status is a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer with,
in this order: a ``google.rpc.BadRequest`` listing every bad field (when there are any), a
``google.rpc.LocalizedMessage`` for people (when there is one: the gateway shows a trainer's as
the run's ``error_message``), and always a ``google.rpc.ErrorInfo`` with domain ``trainwire`` and
a reason of ``trainwire.reasons.ErrorReason``. Clients decide by that reason
(``trainwire.errors``, the gateway's ``trainer_client``), never by parsing the message.

Domain exceptions carry their status code (a ``grpc.StatusCode`` name, since the services'
cores import no grpc) and their reason as class data (``DomainError``); ``error_status`` reads
them, so each service's table is its exception classes themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from trainwire.contract import FieldViolation, bad_request
from trainwire.reasons import ERROR_DOMAIN, ErrorReason

__all__ = ["LOCALE", "DomainError", "error_status", "rich_status", "status_code"]

#: Locale of every ``LocalizedMessage`` the services send.
LOCALE = "en-US"


class DomainError(Protocol):
    """What ``error_status`` reads from a domain exception.

    Attributes:
        status_code: The ``grpc.StatusCode`` name (``"NOT_FOUND"``); class data.
        reason: The ``ErrorInfo`` reason; class data.
    """

    status_code: ClassVar[str]
    reason: ClassVar[ErrorReason]

    def error_metadata(self) -> dict[str, str]:
        """``ErrorInfo.metadata`` (``run_id`` when the error is about a run, ...)."""
        ...


def status_code(name: str) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` called ``name`` (``"NOT_FOUND"``).

    Raises:
        ValueError: no such code, or ``OK`` (a status built here always reports a failure).
    """
    code = getattr(grpc.StatusCode, name, None)
    if not isinstance(code, grpc.StatusCode) or code is grpc.StatusCode.OK:
        raise ValueError(f"not an error status code: {name!r}")
    return code


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    *,
    metadata: Mapping[str, str] | None = None,
    violations: Sequence[FieldViolation] = (),
    localized: str | None = None,
) -> grpc.Status:
    """A status with its ``google.rpc`` details, for ``abort_with_status`` or ``apply``.

    Args:
        code: The status code (never OK).
        message: The status message (names the run id).
        reason: The ``ErrorInfo`` reason (an ``ErrorReason``; a provider's own reason passes
            through as given).
        metadata: ``ErrorInfo.metadata``; empty values are left out.
        violations: Every bad field, as ``google.rpc.BadRequest``.
        localized: Text for people, as ``google.rpc.LocalizedMessage``.
    """
    if code is grpc.StatusCode.OK:
        raise ValueError("a rich status reports a failure, not OK")
    details: list[Message] = []
    if violations:
        details.append(bad_request(violations))
    if localized:
        details.append(error_details_pb2.LocalizedMessage(locale=LOCALE, message=localized))
    details.append(
        error_details_pb2.ErrorInfo(
            reason=str(reason),
            domain=ERROR_DOMAIN,
            metadata={k: v for k, v in (metadata or {}).items() if v},
        )
    )
    status = status_pb2.Status(
        code=code.value[0], message=message, details=[_pack(d) for d in details]
    )
    return rpc_status.to_status(status)


def error_status(exc: DomainError, *, localized: str | None = None) -> grpc.Status:
    """The status of a domain exception, from its class data and its fields.

    ``violations`` (a sequence of ``FieldViolation``) and ``user_message`` (the text for
    people) are read when the exception has them.
    """
    return rich_status(
        status_code(type(exc).status_code),
        str(exc),
        type(exc).reason,
        metadata=exc.error_metadata(),
        violations=getattr(exc, "violations", ()),
        localized=localized if localized is not None else getattr(exc, "user_message", None),
    )


def apply(context: grpc.ServicerContext, status: grpc.Status) -> None:
    """Sets ``status`` on a sync RPC without raising (``grpc_testing`` lacks
    ``abort_with_status``); the handler then returns."""
    context.set_trailing_metadata(status.trailing_metadata)
    context.set_code(status.code)
    context.set_details(status.details)
