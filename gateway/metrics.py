"""Prometheus metrics for the gateway: RPCs, runs, episodes, watchers, trainers, the store.

:class:`GatewayMetrics` is the core's ``Observer`` and owns a ``CollectorRegistry`` of its own
(never the process-global default), so several in-process gateways in one test run do not
collide. ``--metrics-port`` exposes it over HTTP through ``MetricsEndpoint``.

Metric names. The RPC metrics (``trainwire_ops.rpc_metrics``) are the trainer's, recorded by the
grpc.aio interceptor; the gateway's own carry a ``trainwire_gateway_`` prefix:

| metric | type | labels |
| --- | --- | --- |
| ``grpc_server_started_total`` | counter | grpc_type, grpc_service, grpc_method |
| ``grpc_server_handled_total`` | counter | grpc_type, grpc_service, grpc_method, grpc_code |
| ``grpc_server_handling_seconds`` | histogram | grpc_type, grpc_service, grpc_method, grpc_code |
| ``trainwire_gateway_runs`` | gauge | state |
| ``trainwire_gateway_runs_created_total`` | counter | |
| ``trainwire_gateway_runs_ended_total`` | counter | state |
| ``trainwire_gateway_episodes_received_total`` | counter | |
| ``trainwire_gateway_heartbeats_received_total`` | counter | |
| ``trainwire_gateway_episodes_published_total`` | counter | |
| ``trainwire_gateway_episodes_sent_total`` | counter | |
| ``trainwire_gateway_watchers`` | gauge | |
| ``trainwire_gateway_contract_violations_total`` | counter | rule |
| ``trainwire_gateway_trainer_failures_total`` | counter | kind |
| ``trainwire_gateway_trainer_up`` | gauge | trainer |
| ``trainwire_gateway_trainer_slots`` | gauge | trainer |
| ``trainwire_gateway_trainer_slots_busy`` | gauge | trainer |
| ``trainwire_gateway_store_commits_total`` | counter | |
| ``trainwire_gateway_store_operations_total`` | counter | |
| ``trainwire_gateway_store_commit_seconds`` | histogram | |

``trainwire_gateway_runs`` counts the runs in the store by ``RunState`` name (``PENDING`` ...
``ERROR``; every state is always present): loaded from the store at start-up, then kept by the
state changes and deletes the core reports. Episodes are *received* from a trainer, *published*
once durable (visible to watchers), and *sent* when handed to one watch stream (so a run with
three watchers sends each episode three times). Trainer gauges are the last
``GetCapabilities`` answer of each configured trainer; the gateway asks while runs wait for a
slot (every ``--schedule-poll`` s), so between runs they show the last answer, not the present.

Costs: the hooks on the episode and watch paths (received, heartbeats, published, sent,
watchers) run on the event loop only, so they add to plain ints (no lock) that a
collector reads at scrape time; the rest increment pre-resolved prometheus_client children. The
per-episode hooks run once per episode (received, published) or once per watch *message*
(sent: a batch counts with one call), never once per episode per watcher.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.observer import Observer
from gateway.core.runs import RunState
from gateway.core.trainers import Capabilities
from trainwire_ops.rpc_metrics import RpcMetrics, service_registry
from trainwire_ops.rpc_metrics_aio import AioMetricsServerInterceptor

#: Group commits take microseconds in memory and milliseconds on a disk.
COMMIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)

_STATES = tuple(s for s in RunState if s is not RunState.UNSPECIFIED)
_FINISHED_NAMES = frozenset(s.name for s in _STATES if s.finished)


class _LoopCounts(Collector):
    """Counts kept as plain ints by event-loop hooks, exposed at scrape time.

    Only the event loop writes them; a scrape (another thread) reads each int atomically.
    """

    def __init__(self) -> None:
        self.received = 0
        self.heartbeats = 0
        self.published = 0
        self.sent = 0
        self.watchers = 0

    def collect(self) -> Iterator[Metric]:
        for name, help_text, value in (
            ("episodes_received", "Episodes read from trainer streams.", self.received),
            ("heartbeats_received", "Heartbeats read from trainer streams.", self.heartbeats),
            ("episodes_published", "Episodes stored and made visible to watchers.", self.published),
            (
                "episodes_sent",
                "Episodes handed to watch streams (each watcher counts), replayed or live.",
                self.sent,
            ),
        ):
            yield CounterMetricFamily(f"trainwire_gateway_{name}", help_text, value)
        yield GaugeMetricFamily(
            "trainwire_gateway_watchers", "Open WatchRun streams.", self.watchers
        )


class GatewayMetrics(Observer):
    """All of one gateway's metrics in their own registry; the core's observer.

    Wire it as ``Gateway(config, metrics=GatewayMetrics())`` (the default): the gateway passes
    it to the core and puts :meth:`interceptor` on its server.

    Attributes:
        registry: The registry every metric here is in.
        rpc: RPC counters and latencies.
    """

    def __init__(self) -> None:
        self.registry = registry = service_registry()
        self.rpc = RpcMetrics(registry)
        runs = Gauge(
            "trainwire_gateway_runs", "Runs in the store, by state.", ("state",), registry=registry
        )
        self._runs = {s.name: runs.labels(s.name) for s in _STATES}
        self._runs_created = Counter(
            "trainwire_gateway_runs_created", "Runs created.", registry=registry
        )
        self._runs_ended = Counter(
            "trainwire_gateway_runs_ended",
            "Runs that ended, by final state (DONE, STOPPED, ERROR).",
            ("state",),
            registry=registry,
        )
        self._loop = _LoopCounts()
        registry.register(self._loop)
        self._violations = Counter(
            "trainwire_gateway_contract_violations",
            "Trainer streams that broke the stream contract, by rule.",
            ("rule",),
            registry=registry,
        )
        self._failures = Counter(
            "trainwire_gateway_trainer_failures",
            "Trainer streams that failed: failed, lost, crashed, or busy (run re-queued).",
            ("kind",),
            registry=registry,
        )
        self._trainer_up = Gauge(
            "trainwire_gateway_trainer_up",
            "1 if the trainer answered the gateway's last GetCapabilities, else 0.",
            ("trainer",),
            registry=registry,
        )
        self._trainer_slots = Gauge(
            "trainwire_gateway_trainer_slots",
            "Job slots of the trainer, as of its last GetCapabilities answer.",
            ("trainer",),
            registry=registry,
        )
        self._trainer_busy = Gauge(
            "trainwire_gateway_trainer_slots_busy",
            "Busy job slots of the trainer, as of its last GetCapabilities answer.",
            ("trainer",),
            registry=registry,
        )
        self._commits = Counter(
            "trainwire_gateway_store_commits", "Store group commits.", registry=registry
        )
        self._operations = Counter(
            "trainwire_gateway_store_operations",
            "Store operations (episode appends, run updates, ...) committed.",
            registry=registry,
        )
        self._commit_seconds = Histogram(
            "trainwire_gateway_store_commit_seconds",
            "Duration of a store group commit.",
            buckets=COMMIT_BUCKETS,
            registry=registry,
        )
        # The state of each active run as last counted (event loop only): a state change
        # moves the run from one gauge to another, so the previous state must be known.
        self._states: dict[str, str] = {}

    def interceptor(self) -> AioMetricsServerInterceptor:
        """The server interceptor that records :attr:`rpc`."""
        return AioMetricsServerInterceptor(self.rpc)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (``None`` if absent), e.g. for tests."""
        return self.registry.get_sample_value(name, labels or {})

    # -- Observer ----------------------------------------------------------------------------

    def runs_loaded(self, counts: Mapping[str, int]) -> None:
        """Sets the run gauges from the store's counts."""
        for name, gauge in self._runs.items():
            gauge.set(counts.get(name, 0))

    def run_created(self, run_id: str) -> None:
        """Counts a created run."""
        self._runs_created.inc()

    def run_recovered(self, run_id: str, state: str) -> None:
        """Tracks an active run left by a previous gateway (counted by ``runs_loaded``)."""
        self._states[run_id] = state

    def run_state_changed(self, run_id: str, state: str) -> None:
        """Moves the run from its previous state's gauge to ``state``'s."""
        previous = self._states.get(run_id)
        if previous == state:
            return  # a speed change
        if previous is None and state != RunState.PENDING.name:
            return  # not a run this observer saw created (reported twice): already counted
        if previous is not None:
            self._runs[previous].dec()
        self._runs[state].inc()
        if state in _FINISHED_NAMES:
            del self._states[run_id]
            self._runs_ended.labels(state).inc()
        else:
            self._states[run_id] = state

    def run_deleted(self, run_id: str, state: str) -> None:
        """Takes a deleted run off its state's gauge."""
        self._runs[state].dec()

    def episode_received(self, run_id: str) -> None:
        """Counts an episode from a trainer."""
        self._loop.received += 1

    def heartbeat_received(self, run_id: str) -> None:
        """Counts a heartbeat from a trainer."""
        self._loop.heartbeats += 1

    def episodes_published(self, run_id: str, count: int) -> None:
        """Counts published episodes."""
        self._loop.published += count

    def episodes_sent(self, run_id: str, count: int) -> None:
        """Counts episodes handed to one watch stream."""
        self._loop.sent += count

    def store_commit(self, operations: int, seconds: float) -> None:
        """Counts a group commit (on the store thread: prometheus_client is thread-safe)."""
        self._commits.inc()
        self._operations.inc(operations)
        self._commit_seconds.observe(seconds)

    def contract_violation(self, run_id: str, rule: str) -> None:
        """Counts a contract violation by rule."""
        self._violations.labels(rule).inc()

    def trainer_failure(self, run_id: str, kind: str) -> None:
        """Counts a failed trainer stream by kind."""
        self._failures.labels(kind).inc()

    def trainer_probed(self, address: str, capabilities: Capabilities | None) -> None:
        """Records a trainer's GetCapabilities answer (or that it gave none)."""
        if capabilities is None:
            self._trainer_up.labels(address).set(0)
            return
        self._trainer_up.labels(address).set(1)
        self._trainer_slots.labels(address).set(capabilities.slots_total)
        self._trainer_busy.labels(address).set(
            max(0, capabilities.slots_total - capabilities.slots_free)
        )

    def watcher_attached(self, run_id: str) -> None:
        """One more open watch stream."""
        self._loop.watchers += 1

    def watcher_detached(self, run_id: str) -> None:
        """One fewer open watch stream."""
        self._loop.watchers -= 1
