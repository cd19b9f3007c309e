"""``GET /v1/runs/{run_id}/events``: a run's watch as server-sent events.

The stream is the core's watch (``RunRegistry.watch``, the one behind ``WatchRun``) written as
``text/event-stream``:

- ``retry: 1000`` first, so a browser reconnects after a second, not three;
- each episode as ``id: <episode>``, ``event: episode``, ``data: <Episode JSON>``;
- ``event: caught_up`` (``data: <CaughtUp JSON>``) once the history that existed at attach time
  has been sent;
- a comment ``: keepalive`` after ``--keepalive`` seconds of silence;
- ``event: finished`` with the final ``Run``, then the stream ends.

It resumes after ``Last-Event-ID`` (what ``EventSource`` sends when it reconnects), else after
``?after=N`` (default 0: from the first episode): a reconnect continues after the last episode it
saw, exactly once. ``?view=scalars`` streams the episodes without their detail (motions,
completions: numbers only, for curves and tables); ``?view=full``, the default, with it.

Each episode's JSON is written once, when the gateway publishes the episode, and kept with it
(the core's ``JSON`` views, ``gateway.core.framing``; stored beside the episode), so a stream
only frames it: a replay from the store costs about what a ``WatchRun`` replay from the store
costs, and a replayed batch (up to 256 episodes) goes out in one write.

Errors before the first byte (unknown run, bad ``after`` or ``view``) are answered like every
other call (``gateway.http.errors``); once the stream has begun, an error or a gateway shutdown
ends it, and the client resumes from its last event id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from gateway import convert
from gateway.core.errors import InvalidRequest
from gateway.core.registry import (
    CaughtUp,
    EpisodeFrames,
    Finished,
    Keepalive,
    RunRegistry,
    WatchEvent,
)
from gateway.http.context import HttpContext
from gateway.http.errors import HttpAbort
from gateway.status import map_errors
from trainwire.contract import FieldViolation
from trainwire.v1 import gateway_service_pb2

_LOGGER = logging.getLogger(__name__)

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}
RETRY_MS = 1000
_KEEPALIVE = b": keepalive\n\n"


def episode_events(frames: EpisodeFrames) -> bytes:
    """The ``episode`` events of consecutive episodes' JSON (a watch's ``JSON`` view)."""
    data = frames.frames
    if not data:
        return b""
    first = frames.first
    ids = map(str.encode, map(str, range(first, first + len(data))))
    # "id: N\nevent: episode\ndata: JSON\n\n" each, put together in C: a replay frames every
    # episode.
    parts = [b"id: "]
    parts += itertools.chain.from_iterable(
        zip(ids, itertools.repeat(_TO_DATA), data, itertools.repeat(_TO_NEXT_ID))
    )
    parts[-1] = b"\n\n"
    return b"".join(parts)


_TO_DATA = b"\nevent: episode\ndata: "
_TO_NEXT_ID = b"\n\nid: "


def _message_event(name: str, message: Any) -> bytes:
    data = json_format.MessageToJson(message, indent=None, ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


def encode_event(event: WatchEvent) -> bytes:
    """The bytes of one watch event (of a ``JSON`` view) on the stream."""
    if isinstance(event, EpisodeFrames):
        return episode_events(event)
    if isinstance(event, Keepalive):
        return _KEEPALIVE
    if isinstance(event, CaughtUp):
        return _message_event(
            "caught_up", gateway_service_pb2.CaughtUp(last_episode=event.last_episode)
        )
    if isinstance(event, Finished):
        return _message_event("finished", convert.run_to_proto(event.run))
    raise TypeError(f"unknown watch event {event!r}")  # pragma: no cover


def _episode_number(text: str, field: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 63:  # an int64 episode number
        raise InvalidRequest(
            f"{field} must be an episode number >= 0, got {text!r}",
            [FieldViolation(field, f"{text!r}; need an integer >= 0")],
        )
    return value


def resume_point(request: web.Request) -> int:
    """The episode to resume after: ``Last-Event-ID`` when the client sends one (a reconnect),
    else ``?after=``, else 0.

    Raises:
        InvalidRequest: not an integer >= 0.
    """
    last_id = request.headers.get("Last-Event-ID", "").strip()
    if last_id:
        return _episode_number(last_id, "Last-Event-ID")
    return _episode_number(request.query.get("after", "0"), "after")


#: ``?view=``: what each episode carries, as the core's watch takes it (``scalars``).
VIEWS = {"full": False, "scalars": True}


def scalar_view(request: web.Request) -> bool:
    """Whether ``?view=scalars`` asks for episodes without their detail (default ``full``).

    Raises:
        InvalidRequest: another view.
    """
    view = request.query.get("view", "full")
    if view not in VIEWS:
        raise InvalidRequest(
            f"view must be one of {', '.join(VIEWS)}, got {view!r}",
            [FieldViolation("view", f"{view!r}; need one of {', '.join(VIEWS)}")],
        )
    return VIEWS[view]


@dataclass(frozen=True, slots=True)
class WatchQuery:
    """What a stream watches: the run, the episode to resume after, and the view."""

    run_id: str
    after_episode: int
    scalars: bool


class _Watch:
    """The watch behind a stream; errors are mapped as ``WatchRun`` maps them."""

    def __init__(self, core: RunRegistry) -> None:
        self._core = core

    @map_errors
    async def WatchRun(self, request: WatchQuery, context: Any) -> AsyncGenerator[WatchEvent, None]:
        watch = self._core.watch(
            request.run_id, request.after_episode, scalars=request.scalars, json=True
        )
        async for event in watch:
            yield event


class EventStreams:
    """The events handler, and the streams it has open (so that stopping the HTTP side ends
    them at once instead of waiting for their next keepalive)."""

    def __init__(self, core: RunRegistry) -> None:
        self._watch = _Watch(core)
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def open_streams(self) -> int:
        """Streams open now."""
        return len(self._tasks)

    def close_all(self) -> None:
        """Ends every open stream (their clients reconnect and resume)."""
        for task in list(self._tasks):
            task.cancel()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/runs/{run_id}/events``."""
        run_id = request.match_info["run_id"]
        watch_request = WatchQuery(run_id, resume_point(request), scalar_view(request))
        context = HttpContext(request)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with contextlib.aclosing(self._watch.WatchRun(watch_request, context)) as events:
                # The first event comes at once (a batch, or caught_up: never finished); an
                # unknown run raises here, before any byte is sent, and gets a JSON error.
                first = await anext(events)
                response = web.StreamResponse(headers=HEADERS)
                await response.prepare(request)
                await response.write(f"retry: {RETRY_MS}\n\n".encode() + encode_event(first))
                # Past the first byte an error (the run deleted, the gateway stopping; logged by
                # map_errors) can only end the stream: the client resumes from its last id.
                with contextlib.suppress(HttpAbort, ConnectionError):
                    async for event in events:
                        await response.write(encode_event(event))
                        if isinstance(event, Finished):
                            break
                return response
        except asyncio.CancelledError:
            # The client went away or the HTTP side is stopping: not an error.
            _LOGGER.debug("run %s: event stream closed", run_id, extra={"run_id": run_id})
            raise
        finally:
            self._tasks.discard(task)
