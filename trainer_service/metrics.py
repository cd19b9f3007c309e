"""Prometheus metrics for the trainer: RPCs, job slots, jobs, episodes, heartbeats, violations,
checkpoints.

Each :class:`TrainerMetrics` owns a ``CollectorRegistry`` (never the process-global default), so
several in-process servers in one test run do not collide. ``--metrics-port`` exposes it over
HTTP through :class:`MetricsEndpoint`.

Metric names. The RPC metrics follow go-grpc-prometheus (so stock dashboards work) and are the
same on the gateway; the service-specific ones carry a ``trainwire_trainer_`` prefix:

| metric | type | labels |
| --- | --- | --- |
| ``grpc_server_started_total`` | counter | grpc_type, grpc_service, grpc_method |
| ``grpc_server_handled_total`` | counter | grpc_type, grpc_service, grpc_method, grpc_code |
| ``grpc_server_handling_seconds`` | histogram | grpc_type, grpc_service, grpc_method, grpc_code |
| ``trainwire_trainer_slots`` | gauge | |
| ``trainwire_trainer_slots_busy`` | gauge | |
| ``trainwire_trainer_jobs_started_total`` | counter | kind |
| ``trainwire_trainer_jobs_ended_total`` | counter | kind, outcome |
| ``trainwire_trainer_episodes_sent_total`` | counter | kind |
| ``trainwire_trainer_heartbeats_sent_total`` | counter | kind |
| ``trainwire_trainer_contract_violations_total`` | counter | kind, rule |
| ``trainwire_trainer_checkpoints_written_total`` | counter | kind |
| ``trainwire_trainer_checkpoint_seconds`` | histogram | kind |
| ``trainwire_trainer_checkpoint_bytes_total`` | counter | kind |
| ``trainwire_trainer_checkpoints_failed_total`` | counter | kind |

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``;
``grpc_code`` a ``grpc.StatusCode`` name (``OK``, ``CANCELLED``, ...); ``kind`` the task kind
(``imitation``, ``grpo``); ``outcome`` a ``JobOutcome`` value (``ok``, ``error``, ``crash``,
``contract_violation``, ``cancelled``, ``shutdown``). Slot gauges are read from the
``SlotPool`` at scrape time, so they cannot drift.

The RPC metrics (``trainwire_ops.rpc_metrics``), their ``grpc.aio`` interceptor
(``rpc_metrics_aio``) and :class:`MetricsEndpoint` (``metrics_endpoint``) live in
``trainwire_ops`` (shared with the gateway) and are re-exported here. This module imports
neither torch nor the trainer's core.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trainwire_ops.metrics_endpoint import MetricsEndpoint
from trainwire_ops.rpc_metrics import (
    DEADLINE_SLACK_S,
    RPC_LABELS,
    RPC_LATENCY_BUCKETS,
    RpcLabels,
    RpcMetrics,
    clone_handler,
    code_name,
    deadline_passed,
    final_code,
    handler_behavior,
    rpc_labels,
    rpc_type,
    service_registry,
)
from trainwire_ops.rpc_metrics_aio import AioMetricsServerInterceptor

if TYPE_CHECKING:
    from trainer_service.core.observe import JobOutcome
    from trainer_service.core.slots import SlotPool

__all__ = [
    "DEADLINE_SLACK_S",
    "RPC_LABELS",
    "RPC_LATENCY_BUCKETS",
    "AioMetricsServerInterceptor",
    "JobMetrics",
    "MetricsEndpoint",
    "RpcLabels",
    "RpcMetrics",
    "TrainerMetrics",
    "clone_handler",
    "code_name",
    "deadline_passed",
    "final_code",
    "handler_behavior",
    "rpc_labels",
    "rpc_type",
]


# -- trainer-specific metrics ------------------------------------------------------------------


class JobMetrics:
    """Job, episode, heartbeat and contract-violation counters; the runner's ``JobObserver``.

    Pass it as ``JobRunner(observer=metrics.jobs)``. Every method is a counter increment.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs_started = Counter(
            "trainwire_trainer_jobs_started",
            "Training jobs that took a slot and started.",
            ("kind",),
            registry=registry,
        )
        self.jobs_ended = Counter(
            "trainwire_trainer_jobs_ended",
            "Training jobs that ended, by outcome.",
            ("kind", "outcome"),
            registry=registry,
        )
        self.episodes_sent = Counter(
            "trainwire_trainer_episodes_sent",
            "Episodes written to Train streams (counted once the stream asks for more).",
            ("kind",),
            registry=registry,
        )
        self.heartbeats_sent = Counter(
            "trainwire_trainer_heartbeats_sent",
            "Heartbeats written to Train streams (counted once the stream asks for more).",
            ("kind",),
            registry=registry,
        )
        self.contract_violations = Counter(
            "trainwire_trainer_contract_violations",
            "Episode streams that broke the stream contract, by rule.",
            ("kind", "rule"),
            registry=registry,
        )

        self.checkpoints_written = Counter(
            "trainwire_trainer_checkpoints_written",
            "Checkpoints committed to the checkpoint store.",
            ("kind",),
            registry=registry,
        )
        self.checkpoint_seconds = Histogram(
            "trainwire_trainer_checkpoint_seconds",
            "Seconds a checkpoint's commit (upload and marker) took.",
            ("kind",),
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300),
            registry=registry,
        )
        self.checkpoint_bytes = Counter(
            "trainwire_trainer_checkpoint_bytes",
            "Bytes of committed checkpoints (their canonical tar).",
            ("kind",),
            registry=registry,
        )
        self.checkpoints_failed = Counter(
            "trainwire_trainer_checkpoints_failed",
            "Checkpoints that could not be written (training went on).",
            ("kind",),
            registry=registry,
        )

    def job_started(self, run_id: str, kind: str) -> None:
        """Counts a started job."""
        del run_id  # a label per run would grow without bound
        self.jobs_started.labels(kind).inc()

    def job_ended(self, run_id: str, kind: str, outcome: JobOutcome) -> None:
        """Counts an ended job by its outcome."""
        del run_id
        self.jobs_ended.labels(kind, str(outcome)).inc()

    def episode_sent(self, kind: str) -> None:
        """Counts an episode sent."""
        self.episodes_sent.labels(kind).inc()

    def heartbeat_sent(self, kind: str) -> None:
        """Counts a heartbeat sent."""
        self.heartbeats_sent.labels(kind).inc()

    def contract_violation(self, kind: str, rule: str) -> None:
        """Counts a contract violation."""
        self.contract_violations.labels(kind, rule).inc()

    def checkpoint_written(self, kind: str, seconds: float, size_bytes: int) -> None:
        """Counts a committed checkpoint, its time and size."""
        self.checkpoints_written.labels(kind).inc()
        self.checkpoint_seconds.labels(kind).observe(seconds)
        self.checkpoint_bytes.labels(kind).inc(size_bytes)

    def checkpoint_failed(self, kind: str) -> None:
        """Counts a checkpoint that could not be written."""
        self.checkpoints_failed.labels(kind).inc()


class _SlotCollector(Collector):
    """Reads the slot pool at scrape time."""

    def __init__(self, slots: SlotPool) -> None:
        self._slots = slots

    def collect(self) -> Iterator[Metric]:
        total = self._slots.total
        yield GaugeMetricFamily("trainwire_trainer_slots", "Job slots on this trainer.", total)
        yield GaugeMetricFamily(
            "trainwire_trainer_slots_busy",
            "Job slots running a job now.",
            total - self._slots.free,
        )


class TrainerMetrics:
    """All of one trainer's metrics in their own registry.

    Wire it as::

        metrics = TrainerMetrics()
        runner = JobRunner(registry, slots, settings, observer=metrics.jobs)
        server, port = build_server(config, runner, metrics)  # adds the RPC interceptor and slots

    Attributes:
        registry: The registry every metric here is in.
        rpc: RPC counters and latencies.
        jobs: Job counters; the runner's observer.
    """

    def __init__(self) -> None:
        self.registry = service_registry()
        self.rpc = RpcMetrics(self.registry)
        self.jobs = JobMetrics(self.registry)
        self._slots: SlotPool | None = None

    def track_slots(self, slots: SlotPool) -> None:
        """Exposes ``slots`` as the slot gauges (once per registry)."""
        if self._slots is slots:
            return
        if self._slots is not None:
            raise RuntimeError("these metrics already track another slot pool")
        self._slots = slots
        self.registry.register(_SlotCollector(slots))

    def interceptor(self) -> AioMetricsServerInterceptor:
        """The ``grpc.aio`` server interceptor that records :attr:`rpc`."""
        return AioMetricsServerInterceptor(self.rpc)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (``None`` if absent), e.g. for tests and health probes."""
        return self.registry.get_sample_value(name, labels or {})
