"""Watching runs over gRPC at scale: 200 watchers on real sockets each get every episode once,
and watchers that disconnect leave nothing behind in the gateway. What a watch delivers (late
joiners, resume, batches, keepalives, pause and speed, deleted runs) is tested in virtual time in
``tests/core/test_watch.py`` and ``tests/core/test_controls.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import Client, WatchResult, absorb, running_gateway, to_thread
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc

State = gateway_service_pb2.Run.State
pb = gateway_service_pb2


def canonical(episodes: list[episode_pb2.Episode]) -> list[bytes]:
    return [e.SerializeToString(deterministic=True) for e in episodes]


@pytest.fixture
async def client(fake: FakeTrainer) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,)) as c:
        yield c


async def test_200_watchers_each_get_every_episode_exactly_once(
    client: Client, fake: FakeTrainer
) -> None:
    total = 300
    fake.push(Script(hold_at=1))  # nothing is produced until every watcher is attached
    script = fake.scripts[0]
    run = await client.create(max_episodes=total, episodes_per_second=2000)
    channels = [grpc.aio.insecure_channel(client.address) for _ in range(4)]
    stubs = [gateway_service_pb2_grpc.GatewayServiceStub(ch) for ch in channels]
    attached = 0
    all_attached = asyncio.Event()

    async def watch(i: int) -> WatchResult:
        nonlocal attached
        result = WatchResult()
        call = stubs[i % 4].WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=JOB_TIMEOUT)
        async for message in call:
            absorb(result, message)
            if message.WhichOneof("event") == "caught_up":
                attached += 1
                if attached == 200:
                    all_attached.set()
        return result

    tasks = [asyncio.create_task(watch(i)) for i in range(200)]
    await asyncio.wait_for(all_attached.wait(), TIMEOUT)
    script.release.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), JOB_TIMEOUT)
    reference = canonical(results[0].episodes)
    for result in results:
        assert result.numbers == list(range(1, total + 1))
        assert canonical(result.episodes) == reference
        assert result.caught_up == 0
        assert result.finished is not None and result.finished.state == State.STATE_DONE
        assert result.kinds[-1] == "finished"
    for ch in channels:
        await ch.close()
    # Every watcher is gone: nothing is left parked on the (finished) run.
    assert client.gateway.core is not None
    assert len(client.gateway.core.table) == 0


async def test_disconnected_watchers_leave_nothing_behind(
    client: Client, fake: FakeTrainer
) -> None:
    script = Script(hold_at=3)
    fake.push(script)
    run = await client.create(max_episodes=5)
    await to_thread(fake.wait_sent, 2)
    calls = []
    for _ in range(20):
        call = client.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
        async for message in call:
            if message.WhichOneof("event") == "caught_up":
                break
        calls.append(call)
    core = client.gateway.core
    assert core is not None
    log = core.table.get(run.id).log  # type: ignore[union-attr]
    assert log.watchers == 20
    for call in calls:
        call.cancel()
    # The server sees the cancellations asynchronously.
    await until(lambda: log.watchers == 0 and log.waiter_count == 0, "every watcher gone")
    script.release.set()
    assert (await client.finished(run.id)).state == State.STATE_DONE
