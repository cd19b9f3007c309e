"""Watching runs end to end: many watchers, late joiners, resume, pause, speed, keepalives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import (
    TIMEOUT,
    Client,
    WatchResult,
    absorb,
    collect,
    published,
    running_gateway,
    to_thread,
)
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
        call = stubs[i % 4].WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=60)
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
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
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


async def test_late_joiner_and_resume_see_the_same_history(
    client: Client, fake: FakeTrainer
) -> None:
    script = Script(hold_at=41)
    fake.push(script)
    run = await client.create(max_episodes=60)
    await published(client.stub, run.id, 40)
    # The late joiner attaches after 40 episodes were published: they come first, in batches.
    late = client.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
    early_part = WatchResult()
    async for message in late:
        absorb(early_part, message)
        if message.WhichOneof("event") == "caught_up":
            break
    assert early_part.numbers == list(range(1, 41))
    assert early_part.caught_up == 40
    assert "batch" in early_part.kinds and "episode" not in early_part.kinds
    script.release.set()
    async for message in late:
        absorb(early_part, message)
    assert early_part.numbers == list(range(1, 61))
    full = await collect(client.stub, run.id)
    assert canonical(full.episodes) == canonical(early_part.episodes)
    # Resume after episode 25 of the finished run: exactly 26..60, then caught_up and finished.
    resumed = await collect(client.stub, run.id, after_episode=25)
    assert resumed.numbers == list(range(26, 61))
    assert canonical(resumed.episodes) == canonical(full.episodes[25:])
    assert resumed.caught_up == 60
    assert all(size <= 256 for size in resumed.batch_sizes)
    # Past the end: nothing but caught_up and finished.
    beyond = await collect(client.stub, run.id, after_episode=999)
    assert beyond.episodes == [] and beyond.kinds == ["caught_up", "finished"]


async def test_resume_mid_run_on_a_live_run(client: Client, fake: FakeTrainer) -> None:
    script = Script(hold_at=21)
    fake.push(script)
    run = await client.create(max_episodes=30)
    await to_thread(fake.wait_sent, 20)
    watch = asyncio.create_task(collect(client.stub, run.id, after_episode=12))
    await asyncio.sleep(0)
    script.release.set()
    result = await watch
    assert result.numbers == list(range(13, 31))


async def test_replay_of_a_long_finished_run_is_batched(client: Client) -> None:
    run = await client.create(max_episodes=700)
    await client.finished(run.id)
    result = await collect(client.stub, run.id)
    assert result.numbers == list(range(1, 701))
    assert result.kinds.count("batch") == len(result.batch_sizes) >= 3
    assert max(result.batch_sizes) <= 256
    assert result.kinds[-2:] == ["caught_up", "finished"]


async def test_pause_stops_publication_keepalives_continue_and_resume_finishes(
    client: Client,
) -> None:
    run = await client.create(max_episodes=40, episodes_per_second=50)
    result = WatchResult()
    call = client.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
    messages = call.__aiter__()
    while len(result.episodes) < 5:
        absorb(result, await messages.__anext__())
    paused = await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
    at_pause = paused.run.episode
    # While paused: only keepalives (state PAUSED, last episode frozen) for 3 intervals.
    while True:
        message = await messages.__anext__()
        kind = message.WhichOneof("event")
        absorb(result, message)
        if kind == "keepalive" and message.keepalive.state == State.STATE_PAUSED:
            break
    frozen = len(result.episodes)
    assert frozen == at_pause
    for _ in range(3):
        message = await messages.__anext__()
        assert message.WhichOneof("event") == "keepalive", message
        assert message.keepalive.state == State.STATE_PAUSED
        assert message.keepalive.last_episode == at_pause
    assert (await client.get(run.id)).episode == at_pause
    await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
    async for message in messages:
        absorb(result, message)
    assert result.numbers == list(range(1, 41))
    assert result.finished is not None and result.finished.state == State.STATE_DONE


async def _seconds_for(messages: AsyncIterator[pb.WatchRunResponse], episodes: int) -> float:
    start = time.perf_counter()
    seen = 0
    while seen < episodes:
        message = await messages.__anext__()
        kind = message.WhichOneof("event")
        seen += 1 if kind == "episode" else len(message.batch.episodes) if kind == "batch" else 0
    return time.perf_counter() - start


async def test_speed_changes_the_publication_rate(client: Client) -> None:
    # 20 episodes/s x speed 0.1 = 0.5 s per episode; x 20 = 2.5 ms per episode. The bounds are
    # wide (4 slow episodes take at least 1.6 s; 20 fast ones must beat that, nominally 50 ms)
    # so they hold on a loaded machine; the pacer's exact arithmetic is unit-tested.
    run = await client.create(max_episodes=200, episodes_per_second=20, speed=0.1)
    call = client.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
    messages = call.__aiter__()
    await _seconds_for(messages, 1)
    slow = await _seconds_for(messages, 4)
    assert slow >= 4 * 0.5 * 0.8
    reply = await client.stub.SetRunSpeed(
        pb.SetRunSpeedRequest(run_id=run.id, speed=20), timeout=TIMEOUT
    )
    assert reply.run.speed == 20
    await _seconds_for(messages, 2)
    fast = await _seconds_for(messages, 20)
    assert fast < slow
    call.cancel()
    await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)


async def test_keepalive_on_an_idle_pending_run(fake: FakeTrainer) -> None:
    fake.slots = 0
    async with running_gateway((fake.address,), keepalive_s=0.05) as c:
        run = await c.create(max_episodes=3)
        call = c.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
        kinds = []
        async for message in call:
            kinds.append(message.WhichOneof("event"))
            if len(kinds) == 4:
                break
        assert kinds == ["caught_up", "keepalive", "keepalive", "keepalive"]
        call.cancel()
        await c.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)


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
    for _ in range(200):  # the server sees the cancellations asynchronously
        if log.watchers == 0 and log.waiter_count == 0:
            break
        await asyncio.sleep(0.01)
    assert log.watchers == 0 and log.waiter_count == 0
    script.release.set()
    assert (await client.finished(run.id)).state == State.STATE_DONE


async def test_deleted_run_is_not_found_for_watchers(client: Client) -> None:
    run = await client.create(max_episodes=3)
    await client.finished(run.id)
    await client.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(client.stub, run.id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
