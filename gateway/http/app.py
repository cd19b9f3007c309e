"""The gateway's HTTP side: the aiohttp app and its lifecycle, in the gateway's event loop.

``build_app`` puts together the JSON API (``gateway.http.api``), the event streams
(``gateway.http.sse``) and the page (``GET /``, assets under ``/static/``, shipped in this
package: no CDN, nothing fetched at run time). ``HttpFace`` serves it beside the gRPC server,
over the same ``RunRegistry``.

Middlewares, outermost first: ``errors_middleware`` writes every failure as a Google API JSON
error; then the ``middlewares`` given to ``build_app``. That is the one place for an
authentication check: a middleware that raises a domain error (or ``HttpAbort`` with an
UNAUTHENTICATED / PERMISSION_DENIED status) before calling the handler is answered 401 / 403 in
the same JSON shape, on every route, the event streams included.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.core.registry import RunRegistry
from gateway.http.api import JsonApi
from gateway.http.errors import HttpAbort, error_body, status_for_http, status_of
from gateway.http.sse import EventStreams
from gateway.servicer import GatewayServicer

_LOGGER = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 16 << 20

#: The page loads only what this server sends: no other origin, no inline script.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
        "frame-ancestors 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answers every failure with ``{"error": {...}}`` (``gateway.http.errors``)."""
    http_status: int | None = None
    try:
        return await handler(request)
    except HttpAbort as exc:
        status = exc.status
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        http_status = exc.status
        status = status_for_http(exc.status, f"{request.method} {request.path}: {exc.reason}")
    except Exception as exc:
        status = status_of(exc, f"{request.method} {request.path}")
    code, body = error_body(status, http_status)
    return web.Response(status=code, body=body, content_type="application/json")


async def _page_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(_PAGE_HEADERS)
    if request.path == "/" or request.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-cache"  # revalidate (ETag): fresh after upgrades
    if request.path.endswith(".js") and response.status == 200:
        # Module scripts load only with a JavaScript type, whatever the system's MIME table
        # says: the registered one (RFC 9239).
        response.content_type = "text/javascript"
        response.charset = "utf-8"


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def build_app(
    core: RunRegistry, middlewares: Sequence[Middleware] = ()
) -> tuple[web.Application, EventStreams]:
    """The app and its event streams.

    Args:
        core: The registry the servicer and the event streams use.
        middlewares: Run inside ``errors_middleware``, before every handler (auth goes here).
    """
    # Bodies up to 16 MiB reach the servicer, as over gRPC, so its own size checks answer.
    app = web.Application(
        middlewares=[errors_middleware, *middlewares], client_max_size=MAX_BODY_BYTES
    )
    streams = EventStreams(core)
    app.add_routes(JsonApi(GatewayServicer(core)).routes())
    app.add_routes(
        [
            web.get("/v1/runs/{run_id:[^/:]+}/events", streams.handle),
            web.get("/", _index),
            web.static("/static/", STATIC_DIR, follow_symlinks=False),
        ]
    )
    app.on_response_prepare.append(_page_headers)
    return app, streams


class HttpFace:
    """The HTTP side of a gateway; ``start`` and ``stop`` may alternate (tests restart it to cut
    every event stream).

    Args:
        core: The run registry.
        shutdown_grace_s: How long ``stop`` lets requests in flight finish.
        middlewares: See ``build_app``.
    """

    def __init__(
        self,
        core: RunRegistry,
        shutdown_grace_s: float = 2.0,
        middlewares: Sequence[Middleware] = (),
    ) -> None:
        self._core = core
        self._grace = shutdown_grace_s
        self._middlewares = tuple(middlewares)
        self._runner: web.AppRunner | None = None
        self._streams: EventStreams | None = None
        self.host = ""
        self.port = 0
        self._tls = False

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, ``https://`` over TLS (brackets around an IPv6 host)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    @property
    def open_streams(self) -> int:
        """Event streams open now."""
        return self._streams.open_streams if self._streams is not None else 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Serves on ``host:port`` (0 picks a free port), over TLS with ``ssl_context``;
        returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        app, self._streams = build_app(self._core, self._middlewares)
        # handler_cancellation: a client that goes away ends its event stream at once (not at
        # the next keepalive). No access log: the page polls, and one line per request at INFO
        # would drown the lifecycle lines.
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=self._grace
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        self._tls = ssl_context is not None
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            reason = exc.strerror or str(exc)
            raise OSError(
                exc.errno, f"gateway http: cannot listen on {host}:{port}: {reason}"
            ) from exc
        self._runner, self.host, self.port = runner, host, site.port
        _LOGGER.info("gateway http on %s", self.url)
        return self.port

    async def stop(self) -> None:
        """Ends the event streams (clients resume from their last event id) and stops serving,
        letting other requests in flight finish for up to the grace period."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()  # no new connections, then end the streams
        if self._streams is not None:
            self._streams.close_all()
        await runner.cleanup()
        _LOGGER.info("gateway http stopped")
