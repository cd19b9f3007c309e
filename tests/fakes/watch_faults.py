"""A fault-injecting gRPC proxy in front of a real gateway, and a thread to serve aio servers from.

``FaultProxy`` forwards every ``GatewayService`` call to an upstream gateway as raw bytes (so it
knows nothing of the gateway's behaviour and cannot drift from it) and misbehaves on the
``WatchRun`` streams it is told to (``WatchFault``): abort ``UNAVAILABLE`` after N episodes, hang
(stop forwarding, keepalives included, and never close), close OK without ``finished``, or answer
``NOT_FOUND``. A batch that crosses the fault's episode is cut there, so faults land mid-batch
too. Clients then resume over a real transport against the real gateway.

``ThreadedServer`` runs aio servers on a private event loop in a daemon thread, so synchronous
code (``GatewayClient``, the CLI) can call them from the test thread.

This module imports grpc and the client package only: the client-version tests run it in fresh
venvs that hold no gateway.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from tests.fakes.waiting import TIMEOUT
from trainwire.v1 import gateway_service_pb2

T = TypeVar("T")
SERVICE = "/trainwire.v1.GatewayService/"


@dataclass
class WatchFault:
    """Misbehaviour of one watch stream (the n-th ``WatchRun`` call through the proxy, 0-based).

    Attributes:
        connection: Which ``WatchRun`` call (0 = the first) misbehaves.
        after: Episodes forwarded on that stream before the fault.
        action: ``unavailable`` (abort UNAVAILABLE), ``hang`` (forward nothing more, never
            close), ``close`` (end the stream OK without ``finished``) or ``not_found``.
    """

    connection: int
    after: int
    action: str = "unavailable"


class FaultProxy:
    """A ``GatewayService`` proxy on 127.0.0.1:0 with scripted watch faults.

    Attributes:
        watch_requests: Every ``WatchRun`` request that came through, in order.
        calls: The method name of every call that came through, in order.
        active_watchers: ``WatchRun`` calls open right now.
    """

    def __init__(self, upstream: str, faults: list[WatchFault] | None = None) -> None:
        self.upstream = upstream
        self.faults = list(faults or [])
        self.watch_requests: list[gateway_service_pb2.WatchRunRequest] = []
        self.calls: list[str] = []
        self.active_watchers = 0
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> tuple[grpc.aio.Server, int]:
        """Serves on 127.0.0.1:0; returns the server and its port."""
        self._channel = grpc.aio.insecure_channel(self.upstream)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_Handler(self),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return server, self.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
        if self._channel is not None:
            await self._channel.close()

    def _fault(self, connection: int) -> WatchFault | None:
        for fault in self.faults:
            if fault.connection == connection:
                return fault
        return None

    async def unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert self._channel is not None
        self.calls.append(method)
        call = self._channel.unary_unary(SERVICE + method)
        try:
            reply: bytes = await call(
                request, timeout=context.time_remaining(), metadata=context.invocation_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata())
        return reply

    async def watch(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        assert self._channel is not None
        self.calls.append("WatchRun")
        parsed = gateway_service_pb2.WatchRunRequest.FromString(request)
        connection = len(self.watch_requests)
        self.watch_requests.append(parsed)
        fault = self._fault(connection)
        call = self._channel.unary_stream(SERVICE + "WatchRun")(
            request, timeout=context.time_remaining(), metadata=context.invocation_metadata()
        )
        self.active_watchers += 1
        sent = 0
        try:
            async for raw in _responses(call, context):
                if fault is None:
                    yield raw
                    continue
                message = gateway_service_pb2.WatchRunResponse.FromString(raw)
                kind = message.WhichOneof("event")
                episodes = (
                    [message.episode]
                    if kind == "episode"
                    else list(message.batch.episodes)
                    if kind == "batch"
                    else []
                )
                room = fault.after - sent
                if len(episodes) <= room:
                    sent += len(episodes)
                    yield raw
                    if sent < fault.after:
                        continue
                    if not episodes:
                        continue
                elif room > 0:  # cut the batch at the fault
                    cut = gateway_service_pb2.WatchRunResponse()
                    cut.batch.episodes.extend(episodes[:room])
                    sent += room
                    yield cut.SerializeToString()
                call.cancel()
                async for item in self._misbehave(fault, parsed.run_id, context):
                    yield item
                return
        finally:
            call.cancel()
            self.active_watchers -= 1

    async def _misbehave(
        self, fault: WatchFault, run_id: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if fault.action == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the proxy dropped the stream")
        elif fault.action == "not_found":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run {run_id!r} not found")
        elif fault.action == "hang":
            while True:  # until the client cancels
                await asyncio.sleep(3600)
        elif fault.action != "close":
            raise ValueError(f"unknown fault action {fault.action!r}")
        return
        yield b""  # an async generator


async def _responses(
    call: grpc.aio.UnaryStreamCall[bytes, bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    """The upstream stream's messages; its error is passed on as it came."""
    try:
        async for raw in call:
            yield raw
    except grpc.aio.AioRpcError as exc:
        await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata())


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if not method.startswith(SERVICE):
            return None
        name = method.removeprefix(SERVICE)
        if name == "WatchRun":
            return grpc.unary_stream_rpc_method_handler(self._proxy.watch)
        proxy = self._proxy

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await proxy.unary(name, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)


class ThreadedServer:
    """Runs aio servers on a private event loop in a daemon thread.

    Args:
        start: A coroutine factory returning ``(server, port)``, run on the private loop.
        stop: A coroutine factory run on exit instead of ``server.stop(None)`` (e.g. the real
            ``Gateway.stop``, which also shuts its core down).
    """

    def __init__(
        self,
        start: Callable[[], Awaitable[tuple[grpc.aio.Server | None, int]]],
        stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._start = start
        self._stop = stop
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT) -> T:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()

        async def start() -> tuple[grpc.aio.Server | None, int]:
            return await self._start()

        self.server, self.port = self.call(start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        server = self.server
        if self._stop is not None:
            stop = self._stop

            async def custom_stop() -> None:
                await stop()

            self.call(custom_stop())
        elif server is not None:
            self.call(server.stop(grace=None))

        async def cancel_pending() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()

        self.call(cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
