"""The HTTP side's authentication: ``gateway.auth``'s decision in the app's middleware slot.

Every route of the JSON API and the event streams stands for a ``GatewayService`` RPC
(``HTTP_RPCS``) and needs that RPC's role; the page and its assets are open (they hold no data,
and the page asks for a token when the API answers 401). A refusal is answered in the JSON
error shape (401 with ``WWW-Authenticate: Bearer``, or 403), logged once by the check.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.auth import GATEWAY_SERVICE, RPC_ROLES, Authenticator, Role, acting_as
from gateway.core.errors import GatewayError, Unauthenticated
from gateway.http.errors import error_body
from gateway.status import to_status

_LOGGER = logging.getLogger(__name__)

#: The RPC each route of the JSON API and the event streams stands for, by (method, path).
HTTP_RPCS: dict[tuple[str, str], str] = {
    ("GET", "/v1/runs"): "ListRuns",
    ("POST", "/v1/runs"): "CreateRun",
    ("GET", "/v1/runs/{run_id}"): "GetRun",
    ("PATCH", "/v1/runs/{run_id}"): "UpdateRun",
    ("DELETE", "/v1/runs/{run_id}"): "DeleteRun",
    ("POST", "/v1/runs/{run_id}:pause"): "PauseRun",
    ("POST", "/v1/runs/{run_id}:resume"): "ResumeRun",
    ("POST", "/v1/runs/{run_id}:stop"): "StopRun",
    ("POST", "/v1/runs/{run_id}:setSpeed"): "SetRunSpeed",
    ("POST", "/v1/runs/{run_id}:setHyperparameters"): "SetRunHyperparameters",
    ("GET", "/v1/runs/{run_id}/motion"): "GetRun",
    ("GET", "/v1/runs/{run_id}/curve"): "GetRunCurve",
    ("GET", "/v1/motions"): "ListRuns",  # read like the runs (viewer)
    ("GET", "/v1/trainers"): "ListRuns",  # likewise
    ("GET", "/v1/runs/{run_id}/events"): "WatchRun",
    ("GET", "/v1/runs/{run_id}/checkpoints"): "ListCheckpoints",
    ("GET", "/v1/runs/{run_id}/checkpoints/{episode}:download"): "DownloadCheckpoint",
}
#: What a browser loads before it has a token, by route: the page and its assets (no data in
#: them).
OPEN_ROUTES = frozenset({"/", "/static/{filename}"})
EVENTS_ROUTE = "/v1/runs/{run_id}/events"
DOWNLOAD_ROUTE = "/v1/runs/{run_id}/checkpoints/{episode}:download"
#: Routes a browser opens without headers (an ``EventSource``, a download link): they may carry
#: the token as ``?access_token=``.
URL_TOKEN_ROUTES = frozenset({EVENTS_ROUTE, DOWNLOAD_ROUTE})


def http_rule(request: web.Request) -> tuple[str, Role | None]:
    """The name logged for a request and the role it needs (``None``: open)."""
    method = "GET" if request.method == "HEAD" else request.method
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else ""
    if method == "GET" and canonical in OPEN_ROUTES:
        return f"{method} {request.path}", None
    rpc = HTTP_RPCS.get((method, canonical))
    label = (
        f"{GATEWAY_SERVICE}/{rpc} ({method} {request.path})" if rpc else f"{method} {request.path}"
    )
    # A data route missing from HTTP_RPCS needs the highest role: a new route fails closed.
    return label, RPC_ROLES[rpc] if rpc else Role.ADMIN


def _refusal(exc: GatewayError) -> web.Response:
    code, body = error_body(to_status(exc))
    headers = {"WWW-Authenticate": 'Bearer realm="trainwire"'} if code == 401 else None
    return web.Response(status=code, body=body, content_type="application/json", headers=headers)


def http_middleware(authenticator: Authenticator) -> Middleware:
    """The HTTP side's check (``gateway.http.app``'s auth slot): the same roles as gRPC, from
    ``Authorization: Bearer TOKEN``. The event streams and checkpoint downloads also take
    ``?access_token=TOKEN`` (RFC 6750), since a browser's ``EventSource`` and a download link
    send no headers."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        label, required = http_rule(request)
        if required is None:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        query_token = request.query.get("access_token")
        if query_token is not None:
            if request.match_info.route.resource is None or (
                request.match_info.route.resource.canonical not in URL_TOKEN_ROUTES
            ):
                _LOGGER.warning("auth: refused %s: a token in the URL", label)
                return _refusal(
                    Unauthenticated(
                        f"{label}: send the token in the Authorization header, not the URL"
                    )
                )
            authorization = authorization or f"Bearer {query_token}"
        peer = request.remote or "unknown"
        try:
            principal = authenticator.check(authorization, label, required, peer)
        except GatewayError as exc:
            return _refusal(exc)
        with acting_as(principal):
            return await handler(request)

    return authenticate
