"""Prometheus RPC metrics for gRPC servers: their names, labels, status codes and registry.

Both services record the same RPC metrics, named after go-grpc-prometheus so stock dashboards
work:

| metric | type | labels |
| --- | --- | --- |
| ``grpc_server_started_total`` | counter | grpc_type, grpc_service, grpc_method |
| ``grpc_server_handled_total`` | counter | grpc_type, grpc_service, grpc_method, grpc_code |
| ``grpc_server_handling_seconds`` | histogram | grpc_type, grpc_service, grpc_method, grpc_code |

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``;
``grpc_code`` a ``grpc.StatusCode`` name (``OK``, ``CANCELLED``, ...).

This module holds :class:`RpcMetrics` and the naming, status code and handler helpers of the
interceptor that records them on a ``grpc.aio`` server (``trainwire_ops.rpc_metrics_aio``, on
both services). ``trainwire_ops.metrics_endpoint`` serves a ``CollectorRegistry`` over HTTP.
Each service keeps its metrics in its own registry (never the process-global default, see
:func:`service_registry`), so several in-process servers in one test run do not collide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

# No ``*_created`` series: one timestamp gauge per counter and histogram child doubles what a
# scrape carries and no dashboard reads it.
prometheus_client.disable_created_metrics()

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


# -- naming and codes -----------------------------------------------------------------------


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
            the deadline passed, or the server shut down (a ``CancelledError`` in the handler).
            Wins over everything else.
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
    """A handler of the same kind and (de)serializers as ``handler`` running ``behavior``."""
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
