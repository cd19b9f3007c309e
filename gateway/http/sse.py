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

Each episode's event is written once and kept in an ``EventCache`` shared by every stream, so
a replay of a history already sent (a reload, a second page) costs little more than its writes:
a replayed batch (up to 256 episodes) goes out in one write.

Errors before the first byte (unknown run, bad ``after`` or ``view``) are answered like every
other call (``gateway.http.errors``); once the stream has begun, an error or a gateway shutdown
ends it, and the client resumes from its last event id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from gateway import convert
from gateway.core.errors import InvalidRequest
from gateway.core.history import frame_payload
from gateway.core.registry import (
    CaughtUp,
    EpisodeFrames,
    Finished,
    Keepalive,
    RunRegistry,
    WatchEvent,
)
from gateway.http.context import HttpContext
from gateway.http.episode_json import episode_json
from gateway.http.errors import HttpAbort
from gateway.status import map_errors
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2, gateway_service_pb2

_LOGGER = logging.getLogger(__name__)

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}
RETRY_MS = 1000
_KEEPALIVE = b": keepalive\n\n"


def episode_event(frame: bytes) -> bytes:
    """The ``episode`` event of a frame (``gateway.core.history``)."""
    episode = episode_pb2.Episode.FromString(frame_payload(frame))
    return f"id: {episode.episode}\nevent: episode\ndata: {episode_json(episode)}\n\n".encode()


#: What one cache entry holds beyond the contents of its frame and its event: the headers of
#: the two ``bytes`` objects (33 bytes each) and the entry's slot and link in the
#: ``OrderedDict``; 130-180 bytes in all, measured (``tests/http/test_sse_cache.py``), rounded up.
ENTRY_OVERHEAD = 256
#: The event cache's default budget: about four 5000-episode imitation runs (a motion every
#: 10th episode: ~8 MiB of frames and events each).
EVENT_CACHE_BYTES = 32 << 20


class EventCache:
    """The ``episode`` events of frames, written once and shared by every stream of the HTTP side.

    An event is a pure function of its frame's bytes, and a run's history is replayed to every
    page that opens it, again on every reload, and sent live to every page watching it. So the
    cache maps frame bytes to event bytes: equal bytes hit, whichever history (a live run's log,
    a page of a finished run read again from the store) and view (full or scalars: different
    frames) they come from. Writing costs ~6 us for a scalar episode and ~0.2 ms for one with a
    motion; a hit costs a lookup (the frame's hash is kept by the ``bytes`` object).

    Memory: at most ``budget_bytes`` for frames, events and ``ENTRY_OVERHEAD`` per entry, least
    recently used first out; an entry larger than the budget is written and not kept. Frames are
    counted though the core usually holds the same objects (its log or page cache), so the bound
    holds when the core has let them go.

    Args:
        budget_bytes: What the entries may hold, in bytes.
    """

    def __init__(self, budget_bytes: int = EVENT_CACHE_BYTES) -> None:
        self._budget = budget_bytes
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def events(self, frames: Sequence[bytes]) -> bytes:
        """One ``episode`` event per frame, as one byte string."""
        entries = self._entries
        get, touch = entries.get, entries.move_to_end
        out = []
        for frame in frames:
            event = get(frame)
            if event is None:
                event = self._write(frame)
            else:
                touch(frame)
            out.append(event)
        return b"".join(out)

    def _write(self, frame: bytes) -> bytes:
        event = episode_event(frame)
        cost = len(frame) + len(event) + ENTRY_OVERHEAD
        if cost > self._budget:
            return event
        self._entries[frame] = event
        self.size += cost
        while self.size > self._budget:
            old_frame, old_event = self._entries.popitem(last=False)
            self.size -= len(old_frame) + len(old_event) + ENTRY_OVERHEAD
        return event


def _message_event(name: str, message: Any) -> bytes:
    data = json_format.MessageToJson(message, indent=None, ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


def encode_event(event: WatchEvent, cache: EventCache) -> bytes:
    """The bytes of one watch event on the stream."""
    if isinstance(event, EpisodeFrames):
        return cache.events(event.frames)
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
        watch = self._core.watch(request.run_id, request.after_episode, scalars=request.scalars)
        async for event in watch:
            yield event


class EventStreams:
    """The events handler, and the streams it has open (so that stopping the HTTP side ends
    them at once instead of waiting for their next keepalive)."""

    def __init__(self, core: RunRegistry) -> None:
        self._watch = _Watch(core)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.cache = EventCache()

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
                await response.write(
                    f"retry: {RETRY_MS}\n\n".encode() + encode_event(first, self.cache)
                )
                # Past the first byte an error (the run deleted, the gateway stopping; logged by
                # map_errors) can only end the stream: the client resumes from its last id.
                with contextlib.suppress(HttpAbort, ConnectionError):
                    async for event in events:
                        await response.write(encode_event(event, self.cache))
                        if isinstance(event, Finished):
                            break
                return response
        except asyncio.CancelledError:
            # The client went away or the HTTP side is stopping: not an error.
            _LOGGER.debug("run %s: event stream closed", run_id, extra={"run_id": run_id})
            raise
        finally:
            self._tasks.discard(task)
