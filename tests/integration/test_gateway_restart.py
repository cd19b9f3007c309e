"""The gateway as a process with the fake trainer (which keeps no detached jobs, so re-attaches
fail): SIGTERM is graceful: watches end UNAVAILABLE, the process exits 0, the trainer stream is
cancelled, and the next gateway asks to re-attach after the last published episode. kill -9 mid-run
and the restart that continues a run are tested with the real trainer in
``test_control_reaches_training``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gateway.core.runs import INTERRUPTED_MESSAGE
from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import WatchResult, absorb, collect, create_request
from tests.fakes.gateway_harness import gateway_process as spawn_gateway
from tests.fakes.waiting import TIMEOUT
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc

State = gateway_service_pb2.Run.State
pb = gateway_service_pb2


@pytest.fixture
def fake(make_fake: Callable[..., FakeTrainer]) -> FakeTrainer:
    """The suite's fake trainer, streaming an episode every 10 ms."""
    return make_fake(slots=4, default=Script(interval=0.01))


def gateway_process(
    trainer: str, db: Path, log: Path
) -> contextlib.AbstractAsyncContextManager[tuple[asyncio.subprocess.Process, str]]:
    """``python -m gateway`` on port 0 with a file store and short timeouts."""
    return spawn_gateway(
        trainer, log, "--db", str(db), "--keepalive", "0.2", "--heartbeat-timeout", "2"
    )


async def test_sigterm_is_graceful(fake: FakeTrainer, tmp_path: Path) -> None:
    db, log = tmp_path / "gw.sqlite3", tmp_path / "gateway.log"
    fake.push(Script(hold_at=6))
    async with (
        gateway_process(fake.address, db, log) as (proc, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        run_id = (await stub.CreateRun(create_request(max_episodes=50), timeout=TIMEOUT)).run.id
        await asyncio.to_thread(fake.wait_sent, 5)
        call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=TIMEOUT)
        got = WatchResult()
        async for message in call:
            absorb(got, message)
            if len(got.episodes) == 5:
                break
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for message in call:
                absorb(got, message)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    await asyncio.to_thread(fake.wait_idle)  # the trainer stream was cancelled
    assert fake.cancelled == 1
    async with (
        gateway_process(fake.address, db, log) as (_, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        final = await collect(stub, run_id, after_episode=5)
        run = final.finished
        assert run is not None
        assert run.state == State.STATE_ERROR and run.error_message == INTERRUPTED_MESSAGE
        assert run.episode == 5 and got.numbers == [1, 2, 3, 4, 5]
    assert fake.requests[-1].attach_after_episode == 5
    assert "Traceback" not in log.read_text()
