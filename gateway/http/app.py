"""The gateway's HTTP side: the aiohttp app and its lifecycle, in the gateway's event loop.

``build_app`` puts together the JSON API (``gateway.http.api``), the event streams
(``gateway.http.sse``) and the page (``GET /``, assets under ``/static/``, shipped in this
package: no CDN, nothing fetched at run time; ``PageFiles`` serves them from memory, gzipped).
``HttpFace`` serves it beside the gRPC server, over the same ``RunRegistry``.

Middlewares, outermost first: ``errors_middleware`` writes every failure as a Google API JSON
error; then the ``middlewares`` given to ``build_app``. That is the one place for an
authentication check: a middleware that raises a domain error (or ``HttpAbort`` with an
UNAUTHENTICATED / PERMISSION_DENIED status) before calling the handler is answered 401 / 403 in
the same JSON shape, on every route, the event streams included.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import mimetypes
import os
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
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
#: The page's assets (their files under ``STATIC_DIR``; opened before a token in ``auth``).
STATIC_ROUTE = "/static/{filename:.+}"
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


@dataclass(frozen=True)
class _File:
    """One file of the page as read, with its gzipped bytes when they are smaller."""

    mtime_ns: int
    size: int
    body: bytes
    etag: str
    gzipped: bytes | None
    content_type: str


class PageFiles:
    """The page's files (``index.html`` and everything under ``static/``), served from memory.

    Each file is read, tagged (a strong ``ETag`` from its bytes) and gzipped once, and again
    when a ``stat`` shows it changed. A client that accepts gzip gets the gzipped bytes (their
    own ``ETag``; ``Vary: Accept-Encoding``); a matching ``If-None-Match`` gets 304. Nothing
    outside the directory is served, symbolic links included.

    Args:
        root: The directory of the page's files.
    """

    #: gzip only what it makes smaller by at least this fraction
    MIN_SAVING = 0.1

    def __init__(self, root: Path) -> None:
        self._root = root.resolve()
        self._files: dict[Path, _File] = {}

    @property
    def root(self) -> Path:
        """The directory served."""
        return self._root

    async def index(self, request: web.Request) -> web.Response:
        """``GET /``: the page."""
        return self.respond(request, "index.html")

    async def asset(self, request: web.Request) -> web.Response:
        """``GET /static/{filename}``: one of the page's assets."""
        return self.respond(request, request.match_info["filename"])

    def respond(self, request: web.Request, name: str) -> web.Response:
        """The answer to a GET or HEAD of the file ``name`` (a path under the root)."""
        page_file = self._file(name)
        gzipped = page_file.gzipped is not None and _accepts_gzip(request)
        etag = f'"{page_file.etag}-gz"' if gzipped else f'"{page_file.etag}"'
        headers = {"ETag": etag}
        if page_file.gzipped is not None:
            headers["Vary"] = "Accept-Encoding"
        if _matches(request.headers.get("If-None-Match", ""), etag):
            return web.Response(status=304, headers=headers)
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        body = page_file.gzipped if gzipped else page_file.body
        response = web.Response(body=body, headers=headers)
        response.content_type = page_file.content_type
        return response

    def _file(self, name: str) -> _File:
        """The file ``name`` under the root, read again if it changed; ``HTTPNotFound`` for
        anything else (missing, a directory, a link, or outside the root)."""
        path = self._root / name
        try:
            inside = path.resolve(strict=True) == path and path.is_relative_to(self._root)
            st = os.stat(path, follow_symlinks=False)
        except (OSError, ValueError):
            raise web.HTTPNotFound() from None
        if not inside or not stat.S_ISREG(st.st_mode):
            raise web.HTTPNotFound()
        known = self._files.get(path)
        if known is not None and (known.mtime_ns, known.size) == (st.st_mtime_ns, st.st_size):
            return known
        body = path.read_bytes()
        packed = gzip.compress(body, compresslevel=9, mtime=0)
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        page_file = _File(
            mtime_ns=st.st_mtime_ns,
            size=st.st_size,
            body=body,
            etag=hashlib.blake2b(body, digest_size=12).hexdigest(),
            gzipped=packed if len(packed) <= (1 - self.MIN_SAVING) * len(body) else None,
            content_type=content_type,
        )
        self._files[path] = page_file
        return page_file


def _accepts_gzip(request: web.Request) -> bool:
    """Whether the request's ``Accept-Encoding`` takes gzip (a ``q`` of 0 refuses it)."""
    for item in request.headers.get("Accept-Encoding", "").lower().split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip() in ("gzip", "x-gzip"):
            quality = params.strip().removeprefix("q=")
            try:
                return not params or float(quality) > 0
            except ValueError:
                return False
    return False


def _matches(if_none_match: str, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``etag`` (weak comparison, RFC 9110 13.1.2)."""
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags


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
    page = PageFiles(STATIC_DIR)
    app.add_routes(JsonApi(GatewayServicer(core), lambda: core.trainers()).routes())
    app.add_routes(
        [
            web.get("/v1/runs/{run_id:[^/:]+}/events", streams.handle),
            web.get("/", page.index),
            web.get(STATIC_ROUTE, page.asset),
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
