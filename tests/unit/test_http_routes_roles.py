"""Every route of the HTTP side needs a role, so a route added without one fails closed: each
data route stands for a GatewayService RPC (and so needs that RPC's role), the rest are open on
purpose (the page, its assets, the built-in motions)."""

from __future__ import annotations

from gateway.auth import RPC_ROLES
from gateway.http.app import build_app
from gateway.http.auth import HTTP_RPCS, OPEN_ROUTES


def test_every_route_is_open_on_purpose_or_stands_for_an_rpc() -> None:
    app, _ = build_app(object())  # type: ignore[arg-type]  (routes only bind handlers)
    seen = set()
    for route in app.router.routes():
        resource = route.resource
        assert resource is not None
        canonical = resource.canonical
        method = route.method
        if method == "HEAD":
            continue
        seen.add((method, canonical))
        if method == "GET" and canonical in OPEN_ROUTES:
            continue
        assert (method, canonical) in HTTP_RPCS, f"{method} {canonical} needs an entry"
        assert HTTP_RPCS[(method, canonical)] in RPC_ROLES
    assert set(HTTP_RPCS) <= seen  # and the table names no route that is gone
