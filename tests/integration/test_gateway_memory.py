"""Watchers that stop reading cost the gateway a bounded amount of memory, and still get every
episode exactly once when they read again. A gateway process (its RSS is measured) with the
fake trainer sending the contract's largest motion detail on every episode."""

from __future__ import annotations

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import collect, create_request, gateway_process
from tests.fakes.watch_load import stalled_watchers
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc

pytestmark = pytest.mark.slow

EPISODES = 600  # x 31 KB of motion each: an 18 MB history, inside the 64 MiB page cache
WATCHERS = 200


async def test_two_hundred_stalled_watchers_add_at_most_100_mb(fake: FakeTrainer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake.default = Script(frames=240, joints=32, detail_every=1)
    log = tmp_path / "gateway.log"
    async with (
        gateway_process(fake.address, log, "--db", str(tmp_path / "gw.sqlite3")) as (
            proc,
            address,
        ),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        run = (await stub.CreateRun(create_request(max_episodes=EPISODES), timeout=120)).run
        # Runs to its end and warms the page cache: what follows is the watchers' own cost.
        first = await collect(stub, run.id, timeout=300)
        assert first.finished is not None
        assert first.finished.state == gateway_service_pb2.Run.STATE_DONE
        result = await stalled_watchers(proc.pid, address, run.id, WATCHERS, readers=3)
    print(f"\n{WATCHERS} stalled watchers added {result.added_mb:.1f} MB to the gateway")
    assert result.added_mb <= 100
    assert len(result.received) == 3
    for numbers in result.received:
        assert numbers == list(range(1, EPISODES + 1))
