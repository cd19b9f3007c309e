"""The gateway as a process with the fake trainer (which keeps no detached jobs, so re-attaches
fail): kill -9 mid-run loses nothing a watcher saw; SIGTERM is graceful. The restart that
continues a run is tested with the real trainer in ``test_pacing_and_reattach``."""

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
from tests.fakes.gateway_harness import (
    TIMEOUT,
    WatchResult,
    absorb,
    collect,
    create_request,
)
from tests.fakes.gateway_harness import gateway_process as spawn_gateway
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


async def test_kill_9_mid_run_loses_nothing_a_watcher_saw(
    fake: FakeTrainer, tmp_path: Path
) -> None:
    db, log = tmp_path / "gw.sqlite3", tmp_path / "gateway.log"
    seen = WatchResult()
    async with (
        gateway_process(fake.address, db, log) as (proc, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        reply = await stub.CreateRun(
            create_request(max_episodes=1000, episodes_per_second=100), timeout=TIMEOUT
        )
        run_id = reply.run.id
        call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for message in call:
                absorb(seen, message)
                if len(seen.episodes) >= 40 and proc.returncode is None:
                    proc.send_signal(signal.SIGKILL)  # no chance to flush anything
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # (The exit status is not asserted: asyncio's child watcher may report 255 for a SIGKILLed
    # child; the broken stream above is the proof that the process died.)
    assert seen.numbers == list(range(1, len(seen.numbers) + 1))
    # The fake takes a re-attach over while the dead gateway's stream is still open at its end
    # (as the real trainer does), and on a loaded machine it may not have seen the reset yet:
    # wait until it has, so that this restart meets a trainer without the job.
    await asyncio.to_thread(fake.wait_idle)
    async with (
        gateway_process(fake.address, db, log) as (_, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        # The re-attach runs after the gateway starts serving: watch to the run's end first.
        replay = await collect(stub, run_id)
        run = (await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=TIMEOUT)).run
        assert run.state == State.STATE_ERROR
        assert run.error_message == INTERRUPTED_MESSAGE
        assert run.episode >= len(seen.episodes)
        assert replay.numbers == list(range(1, run.episode + 1))
        seen_bytes = [e.SerializeToString(deterministic=True) for e in seen.episodes]
        replay_bytes = [e.SerializeToString(deterministic=True) for e in replay.episodes]
        assert replay_bytes[: len(seen_bytes)] == seen_bytes
        assert replay.finished == run
    # Never started twice: the restarted gateway asked to re-attach, and the fake had no job.
    assert [r.run_id for r in fake.requests] == [run_id, run_id]
    assert not fake.requests[0].HasField("attach_after_episode")
    assert fake.requests[1].attach_after_episode == run.episode


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
