"""Records the RPC metrics (``trainwire_ops.rpc_metrics``) on a sync ``grpc.server``.

The trainer's interceptor; ``trainwire_ops.rpc_metrics_aio`` is its ``grpc.aio`` twin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
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


class MetricsServerInterceptor(grpc.ServerInterceptor):
    """Records :class:`RpcMetrics` for every RPC of a sync ``grpc.server``.

    A unary handler's code is read from the context when it returns or raises. A streaming
    handler's response iterator is wrapped: its code is known only when the iterator ends
    (normally, by an exception or an abort), or when grpc abandons it because the RPC was
    cancelled; the latency runs to that point. Handlers using grpc's experimental non-blocking
    streaming (health ``Watch``) are passed through unmeasured: their end is invisible here.
    """

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Wraps the method's handler in one that records its metrics."""
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None
        behavior = handler_behavior(handler)
        if getattr(behavior, "experimental_non_blocking", False):
            return handler
        labels = rpc_labels(handler_call_details.method, handler)
        if handler.response_streaming:
            return clone_handler(handler, self._streaming(behavior, labels))
        return clone_handler(handler, self._unary(behavior, labels))

    def _unary(self, behavior: Callable[..., Any], labels: RpcLabels) -> Callable[..., Any]:
        metrics = self._metrics

        def observed(request: Any, context: grpc.ServicerContext) -> Any:
            metrics.started(labels)
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                response = behavior(request, context)
                if response is not None:
                    metrics.sent_counter(labels).inc()
                return response
            except BaseException as exc:
                error = exc
                raise
            finally:
                _record(metrics, labels, context, start, error=error)

        return observed

    def _streaming(self, behavior: Callable[..., Any], labels: RpcLabels) -> Callable[..., Any]:
        metrics = self._metrics

        def observed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            metrics.started(labels)
            start = time.perf_counter()
            try:
                responses = behavior(request, context)
            except BaseException as exc:
                _record(metrics, labels, context, start, error=exc)
                raise
            return _observed_stream(responses, context, metrics, labels, start)

        return observed


def _observed_stream(
    responses: Iterable[Any],
    context: grpc.ServicerContext,
    metrics: RpcMetrics,
    labels: RpcLabels,
    start: float,
) -> Iterator[Any]:
    """Yields ``responses`` and records the RPC's code and latency once they end."""
    error: BaseException | None = None
    abandoned = False
    sent = metrics.sent_counter(labels)
    iterator = iter(responses)
    try:
        for response in iterator:
            yield response
            sent.inc()  # grpc asked for the next one: this one went out
    except GeneratorExit:
        # grpc stopped asking for responses: the RPC was cancelled (client, deadline, shutdown).
        abandoned = True
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # the handler's generator cleans up when grpc abandons ours
        _record(metrics, labels, context, start, error=error, abandoned=abandoned)


def _record(
    metrics: RpcMetrics,
    labels: RpcLabels,
    context: grpc.ServicerContext,
    start: float,
    *,
    error: BaseException | None = None,
    abandoned: bool = False,
) -> None:
    """Records an RPC whose handler has just ended (returned, raised or was abandoned)."""
    # Once the client has gone, it saw CANCELLED or DEADLINE_EXCEEDED whatever we set.
    gone = not context.is_active()
    code = final_code(
        context.code(),
        error=error,
        cancelled=abandoned or gone,
        deadline_passed=deadline_passed(context.time_remaining()),
    )
    metrics.handled(labels, code, time.perf_counter() - start)
