"""Helpers for gateway tests: an in-process gateway on port 0, watch-stream collectors, a wait
for a run's state, and the real services as processes (``gateway_process``,
``trainer_process``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.core.trainers import TrainerConnector
from gateway.server import Gateway
from tests.fakes.waiting import TIMEOUT, until
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def imitation_task() -> episode_pb2.TrainTask:
    """A valid imitation task (built-in rig and clip)."""
    return episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
    )


def create_request(
    max_episodes: int = 20, episodes_per_second: float = -1.0, **kwargs: Any
) -> gateway_service_pb2.CreateRunRequest:
    """A valid CreateRunRequest (unpaced unless told otherwise)."""
    return gateway_service_pb2.CreateRunRequest(
        task=imitation_task(),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=7),
        episodes_per_second=episodes_per_second,
        **kwargs,
    )


@dataclass
class Client:
    """A gateway under test and a stub to it."""

    gateway: Gateway
    channel: grpc.aio.Channel
    stub: gateway_service_pb2_grpc.GatewayServiceStub
    address: str

    async def create(self, **kwargs: Any) -> gateway_service_pb2.Run:
        reply = await self.stub.CreateRun(create_request(**kwargs), timeout=TIMEOUT)
        return reply.run

    async def get(self, run_id: str) -> gateway_service_pb2.Run:
        return await get_run(self.stub, run_id)

    async def finished(self, run_id: str) -> gateway_service_pb2.Run:
        """Waits for the run to finish (a watch from its end) and returns the final run."""
        result = await collect(self.stub, run_id, after_episode=5000)
        assert result.finished is not None
        return result.finished


async def get_run(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, run_id: str
) -> gateway_service_pb2.Run:
    """The run now (``GetRun``)."""
    return (
        await stub.GetRun(gateway_service_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT)
    ).run


async def wait_state(
    stub: gateway_service_pb2_grpc.GatewayServiceStub,
    run_id: str,
    *states: int,
    timeout: float = TIMEOUT,
) -> gateway_service_pb2.Run:
    """Waits (``until``) until the run is in one of ``states``; returns it."""

    async def reached() -> gateway_service_pb2.Run | None:
        run = await get_run(stub, run_id)
        return run if run.state in states else None

    names = "/".join(gateway_service_pb2.Run.State.Name(s) for s in states)
    return await until(reached, f"run {run_id} {names}", timeout)


@contextlib.asynccontextmanager
async def running_gateway(
    trainers: tuple[str, ...], connector: TrainerConnector | None = None, **overrides: Any
) -> AsyncIterator[Client]:
    """A gateway on 127.0.0.1:0 (in-memory store unless ``db`` is given), stopped on exit;
    ``connector`` reaches its trainers (gRPC by default; ``MemoryConnector`` for trainers on
    the gateway's own loop)."""
    settings: dict[str, Any] = {
        "port": 0,
        "trainers": trainers,
        "db": ":memory:",
        "keepalive_s": 0.2,
        # Seconds, not one: a starved test process must not lose a healthy trainer. Tests of
        # the timeout itself set a short one.
        "heartbeat_timeout_s": 10.0,
        "schedule_poll_s": 0.05,
        "shutdown_grace_s": 0.5,
        "trainer_call_timeout_s": 2.0,
    }
    settings.update(overrides)
    gateway = Gateway(GatewayConfig(**settings), connector=connector)
    port = await gateway.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield Client(
            gateway, channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), address
        )
    finally:
        await channel.close()
        await gateway.stop()


@dataclass
class WatchResult:
    """Everything one watch stream delivered."""

    episodes: list[episode_pb2.Episode] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    caught_up: int | None = None
    keepalives: list[gateway_service_pb2.Keepalive] = field(default_factory=list)
    finished: gateway_service_pb2.Run | None = None
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def numbers(self) -> list[int]:
        return [e.episode for e in self.episodes]


def absorb(result: WatchResult, message: gateway_service_pb2.WatchRunResponse) -> None:
    """Adds one watch message to a result."""
    kind = message.WhichOneof("event")
    assert kind is not None
    result.kinds.append(kind)
    if kind == "episode":
        result.episodes.append(message.episode)
    elif kind == "batch":
        result.batch_sizes.append(len(message.batch.episodes))
        result.episodes.extend(message.batch.episodes)
    elif kind == "caught_up":
        assert result.caught_up is None, "caught_up sent twice"
        result.caught_up = message.caught_up.last_episode
    elif kind == "keepalive":
        result.keepalives.append(message.keepalive)
    else:
        assert result.finished is None
        result.finished = message.finished


async def collect(
    stub: gateway_service_pb2_grpc.GatewayServiceStub,
    run_id: str,
    after_episode: int = 0,
    timeout: float = TIMEOUT,
) -> WatchResult:
    """Watches a run to its end; asserts that finished is the last message."""
    result = WatchResult()
    call = stub.WatchRun(
        gateway_service_pb2.WatchRunRequest(run_id=run_id, after_episode=after_episode),
        timeout=timeout,
    )
    async for message in call:
        assert result.finished is None, "a message after finished"
        absorb(result, message)
    assert result.finished is not None, "the stream ended without finished"
    return result


def best_so_far(episodes: list[episode_pb2.Episode]) -> float:
    """The running maximum of the episodes' rewards."""
    return max((e.reward for e in episodes), default=-math.inf)


async def to_thread(fn: Any, *args: Any) -> Any:
    """Runs a blocking helper (the fake trainer's waits) off the event loop."""
    return await asyncio.to_thread(fn, *args)


async def published(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, run_id: str, count: int
) -> WatchResult:
    """Watches a run until ``count`` episodes arrived (they are then published and durable)."""
    result = WatchResult()
    call = stub.WatchRun(gateway_service_pb2.WatchRunRequest(run_id=run_id), timeout=TIMEOUT)
    async for message in call:
        absorb(result, message)
        if len(result.episodes) >= count:
            call.cancel()
            break
    assert len(result.episodes) >= count, f"the stream ended after {len(result.episodes)}"
    return result


@contextlib.asynccontextmanager
async def gateway_process(
    trainer: str, log: Path, *flags: str, command: tuple[str, ...] = ("-m", "gateway")
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``python -m gateway --port 0 --trainer TRAINER --http-port 0 FLAGS...`` with stderr
    appended to ``log``.

    Yields the process, once it printed its ``gateway listening on`` line, and its address; the
    rest of its stdout is left for the caller. A process still running on exit is killed.
    ``command`` replaces ``-m gateway`` (a benchmark's variant of the gateway's entry point).
    """
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *command,
            "--port",
            "0",
            "--trainer",
            trainer,
            "--http-port",  # a free port: never the default 8080, which may be taken
            "0",
            *flags,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode()
        match = re.fullmatch(r"gateway listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, f"unexpected first line {line!r}; log: {log.read_text()[-2000:]}"
        yield proc, f"127.0.0.1:{match.group(1)}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


#: Sets RLIMIT_FSIZE to argv[1] bytes, then becomes the command argv[2:] (``trainer_process``).
_FILE_SIZE_LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


# The trainer's main with its slots on CUDA devices 0..N-1 of no real GPU (its device resolution
# answers so): what it reports of its GPUs can be tested on a CPU. No job may run there.
_ON_FAKE_CUDA = (
    "import sys; from trainer_service.providers import _device; n = int(sys.argv[1]); "
    "_device.resolve_device = lambda spec: ('cuda:0', 'cuda:0 (no real GPU)'); "
    "_device.slot_devices = lambda *a: (tuple(f'cuda:{i}' for i in range(n)), f'{n} fake GPUs'); "
    "from trainer_service.__main__ import main; sys.exit(main(sys.argv[2:]))"
)


@contextlib.contextmanager
def trainer_process(
    log: Path,
    *flags: str,
    slots: int = 2,
    file_size_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    fake_cuda_devices: int = 0,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``python -m trainer_service --port 0 --device cpu`` (imitation and grpo providers) with
    stderr appended to ``log``; yields the process, once it printed its address, and the
    address. A process still running on exit is killed. ``file_size_limit``: the most bytes it
    may write to one file (RLIMIT_FSIZE; a larger write fails with EFBIG, as on a full disk);
    ``env`` adds to its environment; ``fake_cuda_devices``: its slots are ``cuda:0`` .. ``cuda:N-1``
    instead, of no real GPU (for what it reports of GPUs; no job can run).

    The limit is set by a small Python that then execs the trainer, not by a ``preexec_fn``:
    that would fork this test process, whose other threads may be inside gRPC, and gRPC's fork
    handlers can kill such a child before it execs (seen: no ready line, an ``epoll_wait``
    error in its log)."""
    command = [
        sys.executable,
        "-m",
        "trainer_service",
        "--port",
        "0",
        "--device",
        "cpu",
        "--slots",
        str(slots),
        *flags,
    ]
    if fake_cuda_devices:
        command = [sys.executable, "-c", _ON_FAKE_CUDA, str(fake_cuda_devices), *command[3:]]
    if file_size_limit is not None:
        command = [sys.executable, "-c", _FILE_SIZE_LIMITED, str(file_size_limit), *command]
    with log.open("ab") as err:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "CUDA_VISIBLE_DEVICES": "",
                **(env or {}),
            },
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        match = re.fullmatch(r"trainer listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, f"unexpected first line {line!r}; log: {log.read_text()[-2000:]}"
        yield proc, f"127.0.0.1:{match.group(1)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
