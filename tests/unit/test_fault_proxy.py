"""The fault-injecting TCP proxy against a real echo server on 127.0.0.1: bytes pass in order,
a delay holds them, a drop closes, a reset resets, a black hole holds bytes until it ends, and
the proxy refuses connections while its upstream does, then listens again on the same port."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from trainwire_ops.fault_proxy import Fault, FaultProxy

WAIT_S = 10.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _echo_server(port: int = 0) -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", port, reuse_address=True)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _proxy(upstream: int) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy("127.0.0.1", upstream)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def _roundtrip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), WAIT_S)
    finally:
        writer.close()


async def test_bytes_pass_in_order_and_a_delay_holds_them() -> None:
    async with _echo_server() as upstream, _proxy(upstream) as proxy:
        payload = bytes(range(256)) * 100
        assert await _roundtrip(proxy.port, payload) == payload
        proxy.set_fault(Fault.DELAY, delay_s=0.3)
        started = time.monotonic()
        assert await _roundtrip(proxy.port, b"late") == b"late"
        assert time.monotonic() - started >= 0.5  # held each way


@pytest.mark.parametrize(
    ("fault", "error"),
    [(Fault.DROP, asyncio.IncompleteReadError), (Fault.RESET, ConnectionResetError)],
)
async def test_a_drop_closes_and_a_reset_resets_open_and_new_connections(
    fault: Fault, error: type[Exception]
) -> None:
    async with _echo_server() as upstream, _proxy(upstream) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"x")
        assert await asyncio.wait_for(reader.readexactly(1), WAIT_S) == b"x"
        proxy.set_fault(fault)
        with pytest.raises(error):
            await asyncio.wait_for(reader.readexactly(1), WAIT_S)
        writer.close()
        with pytest.raises((error, ConnectionError, asyncio.IncompleteReadError)):
            await _roundtrip(proxy.port, b"y")
        proxy.set_fault(Fault.NONE)
        assert await _roundtrip(proxy.port, b"z") == b"z"


async def test_a_black_hole_holds_bytes_until_it_ends() -> None:
    async with _echo_server() as upstream, _proxy(upstream) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.set_fault(Fault.BLACKHOLE)
        writer.write(b"held")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.5)
        proxy.set_fault(Fault.NONE)
        assert await asyncio.wait_for(reader.readexactly(4), WAIT_S) == b"held"
        writer.close()


async def test_the_proxy_refuses_while_its_upstream_refuses_then_listens_again() -> None:
    async with _echo_server() as upstream:
        pass  # the upstream is gone: its port refuses
    async with _proxy(upstream) as proxy:
        port = proxy.port
        # The first connection is accepted, then reset: the upstream refused it.
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _roundtrip(port, b"a")

        async def refused() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return True
            writer.close()
            return False

        deadline = time.monotonic() + WAIT_S
        while not await refused():
            assert time.monotonic() < deadline, "the proxy never refused"
            await asyncio.sleep(0.05)
        assert not proxy.listening
        async with _echo_server(upstream):  # back on the same port
            deadline = time.monotonic() + WAIT_S
            while not proxy.listening:
                assert time.monotonic() < deadline, "the proxy never listened again"
                await asyncio.sleep(0.05)
            assert proxy.port == port
            assert await _roundtrip(port, b"back") == b"back"
