"""The servicer context of a call that came over HTTP.

The JSON API is a transcoder: a handler builds the request message, calls the same
``GatewayServicer`` method that gRPC calls, with an ``HttpContext`` in place of the
``grpc.aio.ServicerContext``, and writes the response message as JSON. ``map_errors`` turns a
domain error into a status and calls ``abort_with_status``; here that raises ``HttpAbort``, which
the app's error middleware writes as a JSON error body.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc
from aiohttp import web

from gateway.http.errors import HttpAbort, plain_status

#: Request headers passed to servicers as invocation metadata (gRPC keys are lower case).
FORWARDED_HEADERS = ("authorization", "user-agent")


class HttpContext:
    """What a servicer method may use of its context, for an HTTP request.

    Args:
        request: The HTTP request.
    """

    def __init__(self, request: web.Request) -> None:
        self._request = request

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> NoReturn:
        """Ends the call with a status."""
        raise HttpAbort(plain_status(code, details))

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        """Ends the call with a rich status."""
        raise HttpAbort(status)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The forwarded request headers (``FORWARDED_HEADERS``) as gRPC metadata."""
        headers = self._request.headers
        return tuple((name, headers[name]) for name in FORWARDED_HEADERS if name in headers)

    def peer(self) -> str:
        """The client's address, in gRPC's form (``ipv4:127.0.0.1:5000``)."""
        transport = self._request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if not peer:
            return "unknown"
        host, port = peer[0], peer[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def time_remaining(self) -> float | None:
        """HTTP requests carry no deadline."""
        return None
