"""Who may call what: bearer tokens, their roles, and the checks on both of the gateway's faces.

The tokens file (``--auth-tokens FILE``) holds one ``TOKEN_SHA256 ROLE NAME`` per line (``#``
comments and blank lines allowed): hashes only, so the file does not let its reader in.
``python -m gateway.tools.add_token`` makes a token and appends its line. A file that every user
may read or write is refused. A presented token is hashed and compared with every stored hash
in constant time (``hmac.compare_digest``, no early exit).

Roles are ordered, each including the one before (``RPC_ROLES``): ``viewer`` reads (GetRun,
ListRuns, WatchRun, GetRunCurve, ListCheckpoints, DownloadCheckpoint: a model is read like its run),
``operator`` also drives runs (CreateRun, PauseRun, ResumeRun, StopRun, SetRunSpeed,
UpdateRun, SetRunHyperparameters),
``admin`` also deletes (DeleteRun). Health is open; reflection, and anything not
named, needs ``viewer`` (a GatewayService RPC missing from the table needs ``admin``).

``Authenticator.check`` is the one decision; ``AuthInterceptor`` applies it to gRPC calls and
``gateway.http.auth`` to the HTTP side (the same roles, ``Authorization: Bearer``). Each refusal is
logged once, with the token's name (never the token) and the method. The caller's name reaches
``CreateRun`` (``Run.creator``) through ``current_principal``.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import hmac
import inspect
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.core.errors import GatewayError, PermissionDenied, Unauthenticated
from gateway.status import to_status
from trainwire_ops.tls import private_file_problem

_LOGGER = logging.getLogger(__name__)

GATEWAY_SERVICE = "trainwire.v1.GatewayService"
#: Services anyone may call (load balancers and orchestrators probe health without a token).
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")


class Role(enum.IntEnum):
    """What a token may do; each role includes the ones below it."""

    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        """``viewer``, ``operator`` or ``admin``: the word in the tokens file."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role a word names.

        Raises:
            ValueError: no such role.
        """
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown role {text!r}: one of {', '.join(r.label for r in cls)}"
            ) from None


#: The role each GatewayService RPC needs.
RPC_ROLES: dict[str, Role] = {
    "GetRun": Role.VIEWER,
    "ListRuns": Role.VIEWER,
    "WatchRun": Role.VIEWER,
    "ListCheckpoints": Role.VIEWER,
    "DownloadCheckpoint": Role.VIEWER,
    "GetRunCurve": Role.VIEWER,
    "CreateRun": Role.OPERATOR,
    "PauseRun": Role.OPERATOR,
    "ResumeRun": Role.OPERATOR,
    "StopRun": Role.OPERATOR,
    "SetRunSpeed": Role.OPERATOR,
    "UpdateRun": Role.OPERATOR,
    "SetRunHyperparameters": Role.OPERATOR,
    "DeleteRun": Role.ADMIN,
}


def required_role(method: str) -> Role | None:
    """The role a gRPC method (``/package.Service/Method``) needs; ``None``: open."""
    service, _, name = method.lstrip("/").partition("/")
    if service in OPEN_SERVICES:
        return None
    if service == GATEWAY_SERVICE:
        return RPC_ROLES.get(name, Role.ADMIN)
    return Role.VIEWER  # reflection, and anything else served beside


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the token's name and role."""

    name: str
    role: Role


def check_name(name: str) -> None:
    """Raises ``ValueError`` unless ``name`` can name a token (it is logged and shown)."""
    if not _NAME.match(name):
        raise ValueError(
            f"name {name[:64]!r} must be 1-64 of A-Z a-z 0-9 . _ @ - (starting with a letter or "
            "digit)"
        )


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token, as the tokens file stores it."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenFileError(ValueError):
    """A tokens file that cannot be used (never quoting a hash or a token)."""


class TokenTable:
    """The tokens file, parsed.

    Args:
        entries: (SHA-256 digest, principal) pairs.
    """

    def __init__(self, entries: Sequence[tuple[bytes, Principal]]) -> None:
        self._entries = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def parse(cls, text: str, source: str = "tokens file") -> TokenTable:
        """Parses ``TOKEN_SHA256 ROLE NAME`` lines.

        Raises:
            TokenFileError: a malformed line (its number is named, not its content).
        """
        entries: list[tuple[bytes, Principal]] = []
        seen: set[str] = set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 3:
                raise TokenFileError(
                    f"{source} line {number}: want 'TOKEN_SHA256 ROLE NAME', got {len(parts)} "
                    "fields"
                )
            digest, role_text, name = parts
            if not _HASH.match(digest):
                raise TokenFileError(
                    f"{source} line {number}: the first field must be a token's SHA-256 in hex "
                    "(64 characters 0-9a-f); create lines with python -m gateway.tools.add_token"
                )
            try:
                role = Role.parse(role_text)
            except ValueError as exc:
                raise TokenFileError(f"{source} line {number}: {exc}") from None
            try:
                check_name(name)
            except ValueError as exc:
                raise TokenFileError(f"{source} line {number}: {exc}") from None
            if digest in seen:
                raise TokenFileError(f"{source} line {number}: the same token is listed twice")
            seen.add(digest)
            entries.append((bytes.fromhex(digest), Principal(name, role)))
        return cls(entries)

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        """Reads a tokens file; refuses one that every user may read or write.

        Raises:
            TokenFileError: unreadable, too open, or malformed.
        """
        problem = private_file_problem(path)
        if problem is not None:
            raise TokenFileError(f"--auth-tokens: {problem}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise TokenFileError(f"--auth-tokens: cannot read {path}: {reason}") from None
        return cls.parse(text, str(path))

    def authenticate(self, token: str) -> Principal | None:
        """The principal of a token, or ``None``. Every stored hash is compared, in constant
        time, whether or not one matched already."""
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for stored, principal in self._entries:
            if hmac.compare_digest(stored, digest):
                found = principal
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` value (``None`` when absent)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class Authenticator:
    """The gateway's one authentication and authorization decision.

    Args:
        path: The tokens file (re-read by ``reload``).

    Raises:
        TokenFileError: the file cannot be used.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._table = TokenTable.load(self.path)
        _LOGGER.info("auth: %d token(s) from %s", len(self._table), self.path)

    def reload(self) -> bool:
        """Re-reads the tokens file (SIGHUP); a bad file is logged and changes nothing."""
        try:
            table = TokenTable.load(self.path)
        except TokenFileError as exc:
            _LOGGER.error("auth: reload failed; keeping the previous tokens: %s", exc)
            return False
        with self._lock:
            self._table = table
        _LOGGER.info("auth: reloaded %d token(s) from %s", len(table), self.path)
        return True

    def check(self, authorization: str | None, method: str, required: Role, peer: str) -> Principal:
        """Who calls, if they may call ``method``.

        Raises:
            Unauthenticated: no token, or an unknown one.
            PermissionDenied: the token's role is below ``required``.
        """
        token = bearer_token(authorization)
        if token is None:
            _LOGGER.warning("auth: refused %s from %s: no bearer token", method, peer)
            raise Unauthenticated(
                f"{method} needs a token: send 'authorization: Bearer TOKEN' (role "
                f"{required.label} or above)"
            )
        with self._lock:
            table = self._table
        principal = table.authenticate(token)
        if principal is None:
            _LOGGER.warning("auth: refused %s from %s: unknown token", method, peer)
            raise Unauthenticated(f"{method}: the token is not known to this gateway")
        if principal.role < required:
            _LOGGER.warning(
                "auth: refused %s from %s: token %r has role %s, needs %s",
                method,
                peer,
                principal.name,
                principal.role.label,
                required.label,
            )
            raise PermissionDenied(
                f"{method} needs role {required.label}; token {principal.name!r} has "
                f"{principal.role.label}",
                required_role=required.label,
            )
        return principal


_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "trainwire_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the unary call or HTTP request being served (``None`` without auth)."""
    return _PRINCIPAL.get()


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Makes ``principal`` the ``current_principal`` of the code run inside."""
    token = _PRINCIPAL.set(principal)
    try:
        yield
    finally:
        _PRINCIPAL.reset(token)


# -- gRPC ------------------------------------------------------------------------------------------


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies ``Authenticator.check`` to every gRPC call but health's: a refused call ends
    ``UNAUTHENTICATED`` / ``PERMISSION_DENIED`` (with ``ErrorInfo``) before its handler runs."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        required = required_role(method)
        if handler is None or required is None:
            return handler
        return _guarded(handler, self._auth, method.lstrip("/"), required)


def _guarded(
    handler: grpc.RpcMethodHandler, auth: Authenticator, method: str, required: Role
) -> grpc.RpcMethodHandler:
    async def admit(context: grpc.aio.ServicerContext) -> Principal:
        try:
            return auth.check(_authorization(context), method, required, context.peer())
        except GatewayError as exc:
            await context.abort_with_status(to_status(exc))
            raise  # unreachable: abort_with_status raises

    def unary(inner: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with acting_as(await admit(context)):
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

        return call

    def streaming(inner: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(context)
            result = inner(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):  # a handler that writes with context.write
                await result
            else:
                for item in result:
                    yield item

        return call

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary(handler.stream_unary))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=streaming(handler.unary_stream))
    return handler._replace(stream_stream=streaming(handler.stream_stream))
