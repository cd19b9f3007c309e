"""Bad input gets one clear error each: sizes, names, ids, tokens, bytes, speeds, the pending
limit and the list view. A real in-process gateway (port 0) with the scripted fake trainer."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import Client, create_request, running_gateway
from tests.fakes.waiting import TIMEOUT
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State


@pytest.fixture
async def client(fake: FakeTrainer) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,)) as c:
        yield c


def bad_fields(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


def custom_task(angles: int) -> episode_pb2.TrainTask:
    rig = episode_pb2.Rig(
        name="pole",
        bones=[
            episode_pb2.Bone(name="base", parent=-1, length=1.0),
            episode_pb2.Bone(name="tip", parent=0, length=0.5),
        ],
    )
    frames = max(1, angles // 2)
    clip = episode_pb2.Clip(
        name="sway",
        fps=30,
        frame_count=frames,
        joint_count=2,
        angles=[1.5 + 0.1 * math.sin(i) for i in range(angles)],
    )
    return episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(rig=rig, clip=clip))


async def test_a_request_over_one_mib_is_invalid_argument_naming_size_and_limit(
    client: Client,
) -> None:
    request = pb.CreateRunRequest(
        task=custom_task(1_100_000), config=episode_pb2.TrainConfig(max_episodes=5)
    )
    assert request.ByteSize() > 4_000_000
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.CreateRun(request, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert f"{request.ByteSize():,} bytes" in details and "1,048,576 bytes (1 MiB)" in details


@pytest.mark.parametrize(
    "run_id", ["x" * 3000, "run\nERROR forged log line", "a b", "../etc", ""], ids=repr
)
async def test_bad_run_ids_are_invalid_argument_with_a_short_message(
    client: Client, run_id: str
) -> None:
    for call in (
        client.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=TIMEOUT),
        client.stub.StopRun(pb.StopRunRequest(run_id=run_id), timeout=TIMEOUT),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_fields(info.value) == ["run_id"]
        assert len(info.value.details() or "") < 200
        assert "\n" not in (info.value.details() or "")


async def test_page_tokens_beyond_the_range_and_garbage_bytes(client: Client) -> None:
    import base64

    token = base64.urlsafe_b64encode(b"runs/v1/" + str(2**63).encode()).decode()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.ListRuns(pb.ListRunsRequest(page_token=token), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    raw = client.channel.unary_unary("/trainwire.v1.GatewayService/CreateRun")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw(b"\xff\xff\xff\xff garbage", timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the request is not a valid trainwire.v1.CreateRunRequest"
    watch = client.channel.unary_stream("/trainwire.v1.GatewayService/WatchRun")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in watch(b"\x0a\xff", timeout=TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the request is not a valid trainwire.v1.WatchRunRequest"


async def test_speed_is_one_rule_everywhere(client: Client, fake: FakeTrainer) -> None:
    fake.push(Script(hold_at=2), Script(hold_at=2), Script(hold_at=2))
    unset = await client.create(max_episodes=5, speed=0)
    negative = await client.create(max_episodes=5, speed=-5)
    huge = await client.create(max_episodes=5, speed=1e9)
    assert (unset.speed, negative.speed, huge.speed) == (1.0, 0.1, 20.0)
    await collect_until_running(client, unset.id)
    reply = await client.stub.SetRunSpeed(
        pb.SetRunSpeedRequest(run_id=unset.id, speed=0), timeout=TIMEOUT
    )
    assert reply.run.speed == 0.1
    for bad in (math.nan, math.inf):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.stub.SetRunSpeed(
                pb.SetRunSpeedRequest(run_id=unset.id, speed=bad), timeout=TIMEOUT
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.stub.CreateRun(create_request(speed=bad), timeout=TIMEOUT)
        assert bad_fields(info.value) == ["speed"]
    for run in (unset, negative, huge):
        await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)


async def collect_until_running(client: Client, run_id: str) -> None:
    from tests.fakes.gateway_harness import published

    await published(client.stub, run_id, 1)


async def test_physical_ranges_are_checked_at_the_gateway(client: Client) -> None:
    for rate, ok in ((1e-300, False), (0.01, True), (20_000, False)):
        call = client.stub.CreateRun(
            create_request(max_episodes=3, episodes_per_second=rate), timeout=TIMEOUT
        )
        if ok:
            run = (await call).run
            assert run.episodes_per_second == rate
            await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
            continue
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert bad_fields(info.value) == ["episodes_per_second"]
    task = custom_task(4)
    task.imitation.rig.bones[0].length = 1e-300
    task.imitation.clip.angles[0] = 3e38
    request = pb.CreateRunRequest(task=task, config=episode_pb2.TrainConfig(max_episodes=3))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.CreateRun(request, timeout=TIMEOUT)
    assert bad_fields(info.value) == [
        "task.imitation.rig.bones[0].length",
        "task.imitation.clip.angles",
    ]


async def test_the_pending_limit_is_resource_exhausted_and_says_so() -> None:
    async with running_gateway(("127.0.0.1:9",), max_pending=2) as client:
        await client.create(max_episodes=3)
        await client.create(max_episodes=3)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.create(max_episodes=3)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 runs waiting" in (info.value.details() or "")
        assert "--max-pending 2" in (info.value.details() or "")


async def test_listing_leaves_out_rig_and_clip_payloads_unless_asked(client: Client) -> None:
    task = custom_task(240)
    created = (
        await client.stub.CreateRun(
            pb.CreateRunRequest(
                task=task, config=episode_pb2.TrainConfig(max_episodes=3), episodes_per_second=-1
            ),
            timeout=TIMEOUT,
        )
    ).run
    await client.finished(created.id)
    basic = (await client.stub.ListRuns(pb.ListRunsRequest(), timeout=TIMEOUT)).runs[0]
    assert basic.id == created.id
    assert basic.task.imitation.rig.name == "pole" and not basic.task.imitation.rig.bones
    clip = basic.task.imitation.clip
    assert (clip.name, clip.frame_count, clip.joint_count, len(clip.angles)) == ("sway", 120, 2, 0)
    full = (
        await client.stub.ListRuns(pb.ListRunsRequest(view=pb.RUN_VIEW_FULL), timeout=TIMEOUT)
    ).runs[0]
    assert full.task == task
    got = await client.get(created.id)
    assert got.task == task  # GetRun is FULL
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.ListRuns(pb.ListRunsRequest(view=7), timeout=TIMEOUT)  # type: ignore[arg-type]
    assert bad_fields(info.value) == ["view"]
