"""Helpers for the HTTP side's tests: a real gateway (fake trainer behind it) on its own event
loop in a thread, for tests that block (a browser, urllib), plain JSON calls with deadlines, and
a strict parser of server-sent events."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from google.protobuf import json_format

from gateway.server import Gateway
from tests.fakes.gateway_harness import running_gateway
from tests.fakes.waiting import TIMEOUT
from tests.fakes.watch_faults import ThreadedServer
from trainwire.v1 import episode_pb2


class ApiError(Exception):
    """A JSON API call answered an error; ``status`` and ``body`` say which."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def call(
    base: str, method: str, path: str, body: Any = None, timeout: float = TIMEOUT
) -> dict[str, Any]:
    """One JSON API call (blocking); raises ``ApiError`` on an error status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    if method == "POST":
        request.add_header("Content-Type", "application/json")
        if data is None:
            request.data = b""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        with exc:
            raise ApiError(exc.code, json.loads(exc.read() or b"{}")) from None


def create_body(
    max_episodes: int = 20, episodes_per_second: float = -1.0, clip: str = "wave", **extra: Any
) -> dict[str, Any]:
    """A CreateRunRequest in JSON for an imitation run (unpaced unless told otherwise)."""
    return {
        "task": {"imitation": {"rigName": "stickman", "clipName": clip}},
        "config": {"maxEpisodes": max_episodes, "seed": "7"},
        "episodesPerSecond": episodes_per_second,
        **extra,
    }


@dataclass
class LiveGateway:
    """A gateway served from a thread; ``url`` is its HTTP side."""

    gateway: Gateway
    served: ThreadedServer

    @property
    def url(self) -> str:
        assert self.gateway.http is not None
        return self.gateway.http.url

    def api(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """A JSON API call."""
        return call(self.url, method, path, body)

    def create(self, **kwargs: Any) -> dict[str, Any]:
        """Creates an imitation run; returns the Run (JSON)."""
        return self.api("POST", "/v1/runs", create_body(**kwargs))["run"]

    def run(self, run_id: str) -> dict[str, Any]:
        """The run (JSON)."""
        return self.api("GET", f"/v1/runs/{run_id}")["run"]

    def restart_http(self) -> None:
        """Stops the HTTP side (every event stream breaks) and serves again on the same port."""
        http = self.gateway.http
        assert http is not None
        host, port = http.host, http.port

        async def restart() -> None:
            await http.stop()
            await http.start(host, port)

        self.served.call(restart())


@contextlib.contextmanager
def threaded_gateway(trainers: tuple[str, ...], **overrides: Any) -> Iterator[LiveGateway]:
    """``running_gateway`` (the one gateway harness) with its HTTP side on 127.0.0.1:0, on its
    own event loop in a thread."""
    stack = contextlib.AsyncExitStack()
    gateways: list[Gateway] = []

    async def start() -> Any:
        client = await stack.enter_async_context(
            running_gateway(trainers, **{"http_port": 0, **overrides})
        )
        gateways.append(client.gateway)
        return client.gateway.server, client.gateway.port

    with ThreadedServer(start, stack.aclose) as served:
        yield LiveGateway(gateways[0], served)


# -- server-sent events ----------------------------------------------------------------------


@dataclass
class SseEvent:
    """One dispatched event."""

    event: str
    data: str
    id: str | None


@dataclass
class SseParser:
    """A strict parser of the event streams the gateway writes.

    It follows the HTML standard's stream interpretation (lines end with LF; ``field: value``
    with one optional space; a blank line dispatches; ``:`` starts a comment) and, stricter than
    a browser, rejects what the gateway never writes: CR, a field other than id / event / data /
    retry, an event without a name or without data, two data lines in one event, a line longer
    than the stream has bytes for.
    """

    buffer: bytes = b""
    comments: list[str] = field(default_factory=list)
    retry: list[int] = field(default_factory=list)
    _fields: dict[str, str] = field(default_factory=dict)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Parses a chunk; returns the events it completed."""
        assert b"\r" not in chunk, "the gateway ends lines with LF only"
        self.buffer += chunk
        events: list[SseEvent] = []
        while b"\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n", 1)
            line = raw.decode("utf-8")
            if not line:
                if self._fields:
                    events.append(self._dispatch())
                continue
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            assert name in ("id", "event", "data", "retry"), f"unknown field in {line!r}"
            if name == "retry":
                assert value.isdigit(), line
                self.retry.append(int(value))
                continue
            assert name not in self._fields, f"{name} twice in one event"
            self._fields[name] = value
        return events

    def _dispatch(self) -> SseEvent:
        fields, self._fields = self._fields, {}
        assert "event" in fields and "data" in fields, f"incomplete event {fields}"
        return SseEvent(fields["event"], fields["data"], fields.get("id"))

    def close(self) -> None:
        """The stream ended: nothing may be left half-written."""
        assert not self.buffer and not self._fields, "the stream ended inside an event"


@dataclass
class Stream:
    """What one event stream delivered (checked against the gateway's stream rules)."""

    events: list[SseEvent] = field(default_factory=list)
    parser: SseParser = field(default_factory=SseParser)
    ended: bool = False  # the server closed it (rather than the reader stopping)

    @property
    def episodes(self) -> list[episode_pb2.Episode]:
        return [
            json_format.Parse(e.data, episode_pb2.Episode())
            for e in self.events
            if e.event == "episode"
        ]

    @property
    def numbers(self) -> list[int]:
        return [int(e.id or 0) for e in self.events if e.event == "episode"]

    @property
    def kinds(self) -> list[str]:
        return [e.event for e in self.events]

    @property
    def finished(self) -> dict[str, Any] | None:
        done = [json.loads(e.data) for e in self.events if e.event == "finished"]
        return done[0] if done else None

    def check(self) -> None:
        """Stream rules: ids are the episodes' numbers; caught_up at most once; nothing after
        finished; a stream the server ended ends with finished (or was cut)."""
        for event in self.events:
            assert event.event in ("episode", "caught_up", "finished"), event
            if event.event == "episode":
                assert event.id == json.loads(event.data)["episode"], event
            else:
                assert event.id is None, event
        assert self.kinds.count("caught_up") <= 1
        if "finished" in self.kinds:
            assert self.kinds[-1] == "finished"


async def read_stream(
    session: Any,
    url: str,
    headers: dict[str, str] | None = None,
    until: Any = None,
    timeout: float = TIMEOUT,
    stream: Stream | None = None,
) -> Stream:
    """Reads an event stream until the server ends it or ``until(stream)`` is true (into
    ``stream`` when given, so a test can watch it grow)."""
    stream = stream if stream is not None else Stream()
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/event-stream"
        try:
            async for chunk in r.content.iter_any():
                stream.events.extend(stream.parser.feed(chunk))
                if until is not None and until(stream):
                    break
            else:
                stream.ended = True
        except aiohttp.ClientPayloadError:
            stream.ended = True  # the server cut the stream (a restart)
        if stream.ended and not stream.parser.buffer:
            stream.parser.close()
    stream.check()
    return stream
