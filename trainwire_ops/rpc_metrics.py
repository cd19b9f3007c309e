"""Prometheus RPC metrics for gRPC servers, sync and ``grpc.aio``, and the ``/metrics`` endpoint.

Both services record the same RPC metrics, named after go-grpc-prometheus so stock dashboards
work:

| metric | type | labels |
| --- | --- | --- |
| ``grpc_server_started_total`` | counter | grpc_type, grpc_service, grpc_method |
| ``grpc_server_handled_total`` | counter | grpc_type, grpc_service, grpc_method, grpc_code |
| ``grpc_server_handling_seconds`` | histogram | grpc_type, grpc_service, grpc_method, grpc_code |

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``;
``grpc_code`` a ``grpc.StatusCode`` name (``OK``, ``CANCELLED``, ...).

:class:`MetricsServerInterceptor` records them on a sync ``grpc.server`` (the trainer),
:class:`AioMetricsServerInterceptor` on a ``grpc.aio`` server (the gateway); the naming, status
code and handler helpers below are shared by both. :class:`MetricsEndpoint` serves a
``CollectorRegistry`` over HTTP. Each service keeps its metrics in its own registry (never the
process-global default), so several in-process servers in one test run do not collide.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

from trainwire_ops.addresses import host_port

# No ``*_created`` series: one timestamp gauge per counter and histogram child doubles what a
# scrape carries and no dashboard reads it.
prometheus_client.disable_created_metrics()

_LOGGER = logging.getLogger(__name__)

#: Label names of every RPC metric, in order (``grpc_code`` follows on handled/latency).
RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
#: Latency buckets in seconds: unary calls take milliseconds, training streams minutes to hours.
RPC_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    float("inf"),
)

#: A client's deadline fires a little before the server's (the timeout travels with the
#: request and starts on arrival), so a cancellation this close to the server's deadline is
#: taken for the deadline passing.
DEADLINE_SLACK_S = 0.05

_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


# -- naming and codes, shared by the sync and the aio interceptor --------------------------


@dataclass(frozen=True)
class RpcLabels:
    """The labels that identify one RPC method in the RPC metrics."""

    grpc_type: str
    grpc_service: str
    grpc_method: str

    def values(self) -> tuple[str, str, str]:
        """The label values in :data:`RPC_LABELS` order."""
        return (self.grpc_type, self.grpc_service, self.grpc_method)


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``."""
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def rpc_labels(full_method: str, handler: grpc.RpcMethodHandler) -> RpcLabels:
    """Labels for ``/package.Service/Method`` served by ``handler``."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return RpcLabels(rpc_type(handler), service or "unknown", method or "unknown")


def code_name(code: grpc.StatusCode | int | None) -> str | None:
    """A status code's name; ``None`` for ``None``. Accepts raw integer codes too."""
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    found = _CODES_BY_VALUE.get(int(code))
    return found.name if found is not None else "UNKNOWN"


def deadline_passed(time_remaining: float | None) -> bool:
    """Whether ``context.time_remaining()`` says the deadline has (about) passed.

    ``None`` (no deadline, as an aio context may say) is False.
    """
    return time_remaining is not None and time_remaining <= DEADLINE_SLACK_S


def final_code(
    context_code: grpc.StatusCode | int | None,
    *,
    error: BaseException | None = None,
    cancelled: bool = False,
    deadline_passed: bool = False,
) -> str:
    """The status code the client received, as grpc's server decides it.

    Args:
        context_code: ``context.code()`` once the handler finished: what it set with
            ``set_code`` or ``abort`` (``None`` when it set nothing).
        error: What the handler (or its response iterator) raised, if anything. grpc answers an
            exception with the code set on the context, else ``UNKNOWN``.
        cancelled: The RPC ended before the handler did: the client cancelled or disconnected,
            the deadline passed, or the server shut down (a sync stream abandoned mid-way, a
            ``CancelledError`` in aio). Wins over everything else.
        deadline_passed: With ``cancelled``: the deadline had passed, so the client saw
            ``DEADLINE_EXCEEDED`` rather than ``CANCELLED`` (see :func:`deadline_passed`).

    Returns:
        A ``grpc.StatusCode`` name.
    """
    if cancelled:
        return "DEADLINE_EXCEEDED" if deadline_passed else "CANCELLED"
    name = code_name(context_code)
    if name is not None:
        return name
    return "UNKNOWN" if error is not None else "OK"


def handler_behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The one behavior a method handler carries (whichever of its four slots is set)."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    if behavior is None:
        raise ValueError("method handler without a behavior")
    return behavior


def clone_handler(
    handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as ``handler`` running ``behavior``.

    Works for sync and aio servers alike: both take the ``grpc.*_rpc_method_handler`` objects.
    """
    serializers: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **serializers)
    return grpc.unary_unary_rpc_method_handler(behavior, **serializers)


def service_registry() -> CollectorRegistry:
    """A service's own registry (never the process-global default, so in-process servers of
    one test run do not collide), with the process and platform collectors (CPU, memory, open
    files, Python version) every Prometheus dashboard expects."""
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    return registry


class RpcMetrics:
    """RPC counters and latency histograms by method and status code, in one registry.

    Args:
        registry: Where the metrics are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.msg_received_total = Counter(
            "grpc_server_msg_received",
            "RPC request messages received on the server.",
            RPC_LABELS,
            registry=registry,
        )
        self.msg_sent_total = Counter(
            "grpc_server_msg_sent",
            "RPC response messages sent by the server (one per message of a stream).",
            RPC_LABELS,
            registry=registry,
        )
        self.started_total = Counter(
            "grpc_server_started",
            "RPCs started on the server.",
            RPC_LABELS,
            registry=registry,
        )
        self.handled_total = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            (*RPC_LABELS, "grpc_code"),
            registry=registry,
        )
        self.handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the handler's start to its end (a stream: to its last message).",
            (*RPC_LABELS, "grpc_code"),
            buckets=RPC_LATENCY_BUCKETS,
            registry=registry,
        )

    def started(self, labels: RpcLabels) -> None:
        """Counts an RPC whose handler starts now, and its (one) request message."""
        values = labels.values()
        self.started_total.labels(*values).inc()
        self.msg_received_total.labels(*values).inc()

    def sent_counter(self, labels: RpcLabels) -> Any:
        """The response-message counter of a method (one ``inc`` per message sent)."""
        return self.msg_sent_total.labels(*labels.values())

    def handled(self, labels: RpcLabels, code: str, seconds: float) -> None:
        """Counts an RPC that ended with ``code`` after ``seconds``."""
        values = (*labels.values(), code)
        self.handled_total.labels(*values).inc()
        self.handling_seconds.labels(*values).observe(seconds)


# -- the sync interceptor ----------------------------------------------------------------------


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


# -- the aio interceptor -----------------------------------------------------------------------


class AioMetricsServerInterceptor(grpc.aio.ServerInterceptor):
    """Records :class:`RpcMetrics` for every RPC of a ``grpc.aio`` server.

    The aio twin of :class:`MetricsServerInterceptor`. Each behavior is wrapped in a coroutine
    that runs it to its end, so code and latency are recorded when the handler ends: normally,
    by an exception or an abort, or by cancellation (the client cancelled or left, the deadline
    passed, the server stopped: a ``CancelledError``). A streaming behavior's responses (an
    async generator) are written with ``context.write`` from that coroutine, the way grpc's own
    loop writes them: no extra generator layer per message, so a busy watch stream pays nothing
    per message for being measured. Sync behaviors (aio runs them in a thread pool) pass
    through unmeasured.
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


# -- the HTTP endpoint -------------------------------------------------------------------------


class MetricsEndpoint:
    """A registry served at ``http://HOST:PORT/metrics`` by prometheus_client in a thread.

    Start it with :meth:`start`; :meth:`stop` closes the socket and joins the thread.
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
        """Serves ``registry`` on ``host:port`` (0 picks a free port).

        Raises:
            OSError: The address could not be bound.
        """
        try:
            httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc}") from exc
        endpoint = cls(httpd, thread, host)
        _LOGGER.info("metrics on %s", endpoint.url)
        return endpoint

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics`` (IPv6 hosts bracketed)."""
        return f"http://{host_port(self.host, self.port)}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        """Stops serving, closes the socket and joins the thread; idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever has left its loop
        self._httpd.server_close()
        self._thread.join(timeout)
