"""A fault-injecting TCP proxy, for chaos drills and tests: put one between a gateway and a
trainer and break the network between them on purpose.

``FaultProxy`` listens on ``127.0.0.1`` and forwards every connection to its upstream. Its
``fault`` says what the network does now:

- ``Fault.NONE``: bytes pass as they come.
- ``Fault.DELAY``: every chunk is held ``delay_s`` before it is passed on (in order, both ways).
- ``Fault.DROP``: every open connection is closed (FIN) and new ones are closed once accepted.
- ``Fault.RESET``: every open connection is reset (RST, both ends) and new ones are reset once
  accepted.
- ``Fault.BLACKHOLE``: a partition: connections stay open and new ones are accepted, but no byte
  passes; what was sent meanwhile is held and delivered once the fault ends, as TCP's
  retransmissions would.

Invariants: bytes are never reordered, duplicated or altered; a connection is only ever ended by
a fault or by one of its ends. Outside a black hole, the proxy's address refuses connections
whenever its upstream does (a killed process): a connection the upstream refused is reset and
the listener closed until the upstream accepts again, then reopened on the same port, so
whoever connects through the proxy sees what it would see without it.

``ProxyThread`` runs proxies on an event loop of their own, in a thread, for a caller whose own
loop (or none) must not carry the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

_LOGGER = logging.getLogger(__name__)

#: Seconds between two connection attempts to an upstream that refused one.
UPSTREAM_POLL_S = 0.1
_CHUNK = 65536
_T = TypeVar("_T")


class Fault(enum.Enum):
    """What the network between the proxy's ends does (see the module docstring)."""

    NONE = "none"
    DELAY = "delay"
    DROP = "drop"
    RESET = "reset"
    BLACKHOLE = "blackhole"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Ends a connection with RST (linger 0) instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pipe:
    """One direction of a connection: chunks read, held while due or black-holed, written."""

    def __init__(
        self, proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._proxy = proxy
        self._reader = reader
        self._writer = writer
        self._queue: deque[tuple[float, bytes]] = deque()  # (due, chunk); b"" = end of stream
        self._arrived = asyncio.Event()

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                chunk = await self._reader.read(_CHUNK)
                self._queue.append((loop.time() + self._proxy.delay_now(), chunk))
                self._arrived.set()
                if not chunk:
                    return
        except (ConnectionError, OSError):
            self._queue.append((loop.time(), b""))
            self._arrived.set()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            due, chunk = self._queue[0]
            await self._proxy.passable()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # the fault may have changed meanwhile
            self._queue.popleft()
            if not chunk:
                with contextlib.suppress(OSError, RuntimeError):
                    if self._writer.can_write_eof():
                        self._writer.write_eof()
                return
            self._writer.write(chunk)
            await self._writer.drain()


class _Connection:
    """A client connection and its upstream connection."""

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.client = client
        self.upstream = upstream

    def writers(self) -> tuple[asyncio.StreamWriter, asyncio.StreamWriter]:
        return self.client[1], self.upstream[1]


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream`` with a fault (see the module docstring).

    Args:
        upstream_host: Where to forward to.
        upstream_port: Its port.
        port: The port to listen on (0: a free one, kept for the proxy's life).
    """

    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port
        self.fault = Fault.NONE
        self.delay_s = 0.0
        self.connections_total = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._passable = asyncio.Event()
        self._passable.set()
        self._closing = False
        self._reopening: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``: where clients connect."""
        return f"127.0.0.1:{self.port}"

    @property
    def listening(self) -> bool:
        """Whether the proxy accepts connections now (not while its upstream refuses)."""
        return self._server is not None

    async def start(self) -> int:
        """Starts listening; returns the port."""
        await self._listen()
        return self.port

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def delay_now(self) -> float:
        """How long a chunk read now is held."""
        return self.delay_s if self.fault is Fault.DELAY else 0.0

    async def passable(self) -> None:
        """Waits while the proxy is a black hole."""
        await self._passable.wait()

    def set_fault(self, fault: Fault, delay_s: float = 0.0) -> None:
        """Changes what the network does, at once (``delay_s``: for ``Fault.DELAY``)."""
        self.fault = fault
        self.delay_s = delay_s
        if fault is Fault.BLACKHOLE:
            self._passable.clear()
        else:
            self._passable.set()
        if fault in (Fault.DROP, Fault.RESET):
            for conn in list(self._conns):
                self._end(conn, reset=fault is Fault.RESET)

    def _end(self, conn: _Connection, reset: bool) -> None:
        self._conns.discard(conn)
        for writer in conn.writers():
            if reset:
                _reset(writer)
            else:
                writer.transport.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_total += 1
        if self.fault is Fault.DROP:
            writer.transport.close()
            return
        if self.fault is Fault.RESET or self._closing:
            _reset(writer)
            return
        try:
            upstream = await asyncio.open_connection(*self.upstream)
        except ConnectionRefusedError:
            _reset(writer)
            if self.fault is not Fault.BLACKHOLE:
                self._refused()
            return
        except OSError:
            _reset(writer)
            return
        conn = _Connection((reader, writer), upstream)
        self._conns.add(conn)
        loop = asyncio.get_running_loop()
        pipes = [
            loop.create_task(self._run_pipe(_Pipe(self, reader, upstream[1]))),
            loop.create_task(self._run_pipe(_Pipe(self, upstream[0], writer))),
        ]
        try:
            # One end gone (closed, reset, killed): the whole connection goes, as gRPC never
            # half-closes a connection.
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._conns.discard(conn)
            for end in conn.writers():
                end.transport.close()

    async def _run_pipe(self, pipe: _Pipe) -> None:
        reading = asyncio.get_running_loop().create_task(pipe.read())
        try:
            await pipe.write()
        except (ConnectionError, OSError, RuntimeError):
            pass
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    def _refused(self) -> None:
        """The upstream refused a connection: refuse too until it accepts again."""
        if self._server is None or self._reopening is not None:
            return
        server, self._server = self._server, None
        server.close()
        _LOGGER.info("proxy %s: upstream %s:%d refuses; refusing too", self.port, *self.upstream)
        self._reopening = asyncio.get_running_loop().create_task(self._reopen())

    async def _reopen(self) -> None:
        try:
            while not self._closing:
                await asyncio.sleep(UPSTREAM_POLL_S)
                try:
                    _, probe = await asyncio.open_connection(*self.upstream)
                except OSError:
                    continue
                probe.transport.close()
                for _ in range(50):  # the port may be held a moment by a closing socket
                    try:
                        await self._listen()
                        break
                    except OSError:
                        await asyncio.sleep(UPSTREAM_POLL_S)
                _LOGGER.info("proxy %s: upstream accepts again", self.port)
                return
        finally:
            self._reopening = None

    async def close(self) -> None:
        """Stops listening and ends every connection."""
        self._closing = True
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._reopening is not None:
            self._reopening.cancel()
        for conn in list(self._conns):
            self._end(conn, reset=False)
        self._passable.set()
        for task in list(self._tasks):
            task.cancel()


class ProxyThread:
    """An event loop in a daemon thread that runs ``FaultProxy`` s; every method is called from
    other threads and waits for the loop's answer."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._thread.daemon = True
        self._thread.start()
        self.proxies: list[FaultProxy] = []

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def add(self, upstream_host: str, upstream_port: int, port: int = 0) -> FaultProxy:
        """A new proxy to ``upstream``, listening once this returns."""

        async def make() -> FaultProxy:
            proxy = FaultProxy(upstream_host, upstream_port, port)
            await proxy.start()
            return proxy

        proxy = self._call(make())
        self.proxies.append(proxy)
        return proxy

    def set_fault(self, proxy: FaultProxy, fault: Fault, delay_s: float = 0.0) -> None:
        """``proxy.set_fault`` on the proxies' loop."""

        async def apply() -> None:
            proxy.set_fault(fault, delay_s)

        self._call(apply())

    def close(self) -> None:
        """Closes every proxy and stops the loop."""

        async def close_all() -> None:
            for proxy in self.proxies:
                await proxy.close()

        with contextlib.suppress(Exception):
            self._call(close_all())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
