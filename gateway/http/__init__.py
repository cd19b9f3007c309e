"""The gateway's HTTP face: the JSON API, server-sent events of runs, and the page.

It runs in the gateway's event loop beside ``grpc.aio`` and calls the same ``GatewayServicer``
and ``RunRegistry``: ``app`` (aiohttp app, middlewares, lifecycle), ``api`` (JSON API
transcoded to the servicer), ``sse`` (event streams), ``errors`` (statuses as HTTP), ``context``
(the servicer context of an HTTP call), ``episode_json`` (fast JSON of episodes), ``static/``
(the page).
"""

from gateway.http.app import HttpFace, build_app

__all__ = ["HttpFace", "build_app"]
