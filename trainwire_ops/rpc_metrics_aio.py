"""Records the RPC metrics (``trainwire_ops.rpc_metrics``) on a ``grpc.aio`` server (the
gateway's and the trainer's)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from trainwire_ops.rpc_metrics import (
    RpcLabels,
    RpcMetrics,
    clone_handler,
    deadline_passed,
    final_code,
    handler_behavior,
    rpc_labels,
)


class AioMetricsServerInterceptor(grpc.aio.ServerInterceptor):
    """Records :class:`RpcMetrics` for every RPC of a ``grpc.aio`` server.

    Each behavior is wrapped in a coroutine that runs it to its end, so code and latency are
    recorded when the handler ends: normally, by an exception or an abort, or by cancellation
    (the client cancelled or left, the deadline passed, the server stopped: a
    ``CancelledError``). A streaming behavior's responses (an async generator) are written with
    ``context.write`` from that coroutine, the way grpc's own loop writes them: no extra
    generator layer per message, so a busy watch stream pays nothing per message for being
    measured. Sync behaviors (aio runs them in a thread pool) pass through unmeasured.
    """

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics
        # method -> (the handler grpc returned, its wrapped twin): a method's handler is one
        # object for the server's life, so it is wrapped once, not on every call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Wraps the method's handler in one that records its metrics."""
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler_behavior(handler)
        labels = rpc_labels(method, handler)
        if inspect.isasyncgenfunction(behavior):
            return clone_handler(handler, self._generator(behavior, labels))
        if inspect.iscoroutinefunction(behavior):
            return clone_handler(handler, self._coroutine(behavior, labels))
        return handler

    def _coroutine(
        self, behavior: Callable[..., Awaitable[Any]], labels: RpcLabels
    ) -> Callable[..., Awaitable[Any]]:
        """A unary response, or a stream written by the behavior itself (``context.write``)."""
        metrics = self._metrics

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            metrics.started(labels)
            start = time.perf_counter()
            error: BaseException | None = None
            cancelled = False
            try:
                response = await behavior(request, context)
                if response is not None:
                    metrics.sent_counter(labels).inc()
                return response
            except asyncio.CancelledError:
                cancelled = True
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                _record_aio(metrics, labels, context, start, error, cancelled)

        return observed

    def _generator(
        self, behavior: Callable[..., AsyncIterator[Any]], labels: RpcLabels
    ) -> Callable[..., Awaitable[None]]:
        """A stream of responses yielded by the behavior (an async generator)."""
        metrics = self._metrics

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> None:
            metrics.started(labels)
            start = time.perf_counter()
            error: BaseException | None = None
            cancelled = False
            responses = behavior(request, context)
            sent = metrics.sent_counter(labels)
            try:
                async for response in responses:
                    await context.write(response)
                    sent.inc()
            except asyncio.CancelledError:
                cancelled = True
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                try:
                    # A cancellation that hit our write leaves the behavior suspended at its
                    # yield: close it now, so its cleanup runs before the RPC is counted done.
                    await responses.aclose()  # type: ignore[attr-defined]
                finally:
                    _record_aio(metrics, labels, context, start, error, cancelled)

        return observed


def _record_aio(
    metrics: RpcMetrics,
    labels: RpcLabels,
    context: grpc.aio.ServicerContext,
    start: float,
    error: BaseException | None,
    cancelled: bool,
) -> None:
    """Records an aio RPC whose handler has just ended (returned, raised or was cancelled)."""
    code = final_code(
        context.code(),
        error=error,
        cancelled=cancelled,
        deadline_passed=deadline_passed(context.time_remaining()),
    )
    metrics.handled(labels, code, time.perf_counter() - start)
