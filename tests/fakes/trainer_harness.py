"""The one harness for a real trainer server in tests: ``running_trainer`` builds a ``JobRunner``
over the given providers (fakes from ``trainer_service.testing`` or the real ones), serves it on
127.0.0.1:0 with ``build_server`` (metrics, TLS optional), and yields a ``RunningTrainer``
with a stub; on exit it stops the server and checks that every job thread ended.

Every suite that needs an in-process trainer uses it (servicer, integration, security, grpcurl,
end-to-end), so a change to how a trainer is built is made once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import grpc

from tests.fakes.waiting import TIMEOUT, wait_for
from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.metrics import TrainerMetrics
from trainer_service.server import TrainerServer, build_server
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc
from trainwire_ops.checkpoints import CheckpointStore
from trainwire_ops.tls import ServerTls


@dataclasses.dataclass
class RunningTrainer:
    """A started trainer server, its runner and metrics, and a channel and stub to it."""

    server: TrainerServer
    runner: JobRunner
    metrics: TrainerMetrics
    port: int
    channel: grpc.Channel
    stub: trainer_service_pb2_grpc.TrainerServiceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def capabilities(self) -> trainer_service_pb2.GetCapabilitiesResponse:
        return self.stub.GetCapabilities(
            trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
        )

    def value(self, name: str, **labels: str) -> float:
        """A sample from the registry; 0 when the series does not exist yet."""
        return self.metrics.value(name, labels) or 0.0

    def wait_value(self, name: str, expected: float, **labels: str) -> None:
        """Waits until a sample reaches ``expected``.

        The server records an RPC's end after the client may already have seen it (a cancel
        returns on the client at once), and no event marks that moment, so this polls.
        """
        wait_for(lambda: self.value(name, **labels) == expected, f"{name}{labels} == {expected}")


@contextlib.contextmanager
def running_trainer(
    providers: Mapping[str, object] | ProviderRegistry,
    *,
    slots: int = 1,
    tls: ServerTls | None = None,
    warm_up: bool = True,
    wait_idle: bool = True,
    stop_wait: float = TIMEOUT,
    config: Mapping[str, Any] | None = None,
    checkpoint_store: CheckpointStore | None = None,
    **settings: Any,
) -> Iterator[RunningTrainer]:
    """A trainer on 127.0.0.1:0.

    Args:
        providers: Provider name -> module path or fake provider, or a whole registry.
        slots: Slots of the pool.
        tls: Serve TLS (mutual with a client CA).
        warm_up: Import providers in the background first and wait until ready; False serves
            at once (fake providers need no warm-up).
        wait_idle: On exit, assert every job thread ended.
        stop_wait: Seconds to wait for the server to stop and the jobs to end.
        config: More ``TrainerConfig`` fields (``metrics_port``, ...).
        checkpoint_store: Where jobs write checkpoints and find those they resume from (None:
            they write none).
        **settings: ``RunnerSettings`` fields (``heartbeat_s``, ``detach_grace_s``, ``device``,
            ``data_roots``, ...); ``data_root=DIR`` is short for ``data_roots=(DIR,)``.
    """
    if "data_root" in settings:
        settings["data_roots"] = (settings.pop("data_root"),)
    metrics = TrainerMetrics()
    registry = (
        providers if isinstance(providers, ProviderRegistry) else ProviderRegistry(dict(providers))
    )
    runner = JobRunner(
        registry,
        SlotPool(slots),
        RunnerSettings(**settings),
        observer=metrics.jobs,
        checkpoint_store=checkpoint_store,
    )
    fields: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "slots": slots, **(config or {})}
    for name in ("heartbeat_s", "detach_grace_s", "device", "data_roots"):
        if name in settings and name in {f.name for f in dataclasses.fields(TrainerConfig)}:
            fields.setdefault(name, settings[name])
    server, port = build_server(TrainerConfig(**fields), runner, metrics, tls=tls)
    server.start(warm_up=warm_up)
    if warm_up:
        assert server.ready.wait(TIMEOUT), "the trainer never became ready"
    channel = grpc.insecure_channel(f"127.0.0.1:{port}") if tls is None else _no_channel()
    running = RunningTrainer(
        server, runner, metrics, port, channel, trainer_service_pb2_grpc.TrainerServiceStub(channel)
    )
    try:
        yield running
    finally:
        channel.close()
        server.stop(None).wait(stop_wait)
        if wait_idle:
            assert runner.wait_idle(stop_wait), "job threads still running"


def _no_channel() -> grpc.Channel:
    """A TLS trainer's callers bring their own credentials: this channel goes nowhere."""
    return grpc.insecure_channel("127.0.0.1:9")
