"""GatewayService against a scripted fake TrainerService, both real in-process servers."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    UNEXPECTED_MESSAGE,
)
from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import (
    Client,
    collect,
    create_request,
    published,
    running_gateway,
    to_thread,
)
from tests.fakes.waiting import TIMEOUT
from trainwire.reasons import ErrorReason
from trainwire.v1 import episode_pb2, gateway_service_pb2

State = gateway_service_pb2.Run.State
pb = gateway_service_pb2


@pytest.fixture
async def client(fake: FakeTrainer) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,)) as c:
        yield c


def status_of(info: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return info.value.code()


# -- CreateRun, GetRun, ListRuns ---------------------------------------------------------------


async def test_create_reports_every_bad_field_as_bad_request(client: Client) -> None:
    request = pb.CreateRunRequest(
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(clip_name="moonwalk", group_size=1)
        ),
        config=episode_pb2.TrainConfig(max_episodes=0),
        speed=math.nan,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.CreateRun(request, timeout=TIMEOUT)
    assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    fields = {v.field for v in bad.field_violations}
    assert fields == {
        "task.imitation.clip_name",
        "task.imitation.group_size",
        "config.max_episodes",
        "speed",
    }


async def test_create_get_and_finish(client: Client, fake: FakeTrainer) -> None:
    run = await client.create(max_episodes=15, display_name="first", speed=3)
    assert run.id and run.state in (State.STATE_PENDING, State.STATE_RUNNING)
    assert run.speed == 3 and run.display_name == "first" and run.episodes_per_second == -1
    final = await client.finished(run.id)
    assert final.state == State.STATE_DONE
    assert final.episode == 15 and final.trainer == fake.address
    assert final.HasField("start_time") and final.HasField("end_time")
    got = await client.get(run.id)
    assert got == final
    assert fake.requests[0].run_id == run.id
    assert fake.requests[0].config.max_episodes == 15


async def test_rate_defaults_to_the_gateway_rate(fake: FakeTrainer) -> None:
    async with running_gateway((fake.address,), episode_rate=123.0) as c:
        run = await c.create(episodes_per_second=0, max_episodes=2)
        assert run.episodes_per_second == 123.0 and run.speed == 1.0


async def test_request_id_is_idempotent_even_concurrently(client: Client) -> None:
    requests = [create_request(max_episodes=5, request_id="same-key") for _ in range(10)]
    replies = await asyncio.gather(*(client.stub.CreateRun(r, timeout=TIMEOUT) for r in requests))
    assert len({r.run.id for r in replies}) == 1
    later = await client.create(max_episodes=5, request_id="same-key")
    assert later.id == replies[0].run.id
    listed = await client.stub.ListRuns(pb.ListRunsRequest(), timeout=TIMEOUT)
    assert [r.id for r in listed.runs] == [later.id]
    # The same key with another request is a client bug, not a retry.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.create(max_episodes=9, request_id="same-key")
    assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id 'same-key' was used for a different request" in (info.value.details() or "")
    concurrent = [create_request(max_episodes=n, request_id="racy") for n in (3, 3, 4)]
    outcomes = await asyncio.gather(
        *(client.stub.CreateRun(r, timeout=TIMEOUT) for r in concurrent), return_exceptions=True
    )
    assert sum(isinstance(o, grpc.aio.AioRpcError) for o in outcomes) == 1


async def test_unknown_and_empty_run_ids(client: Client) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.get("no-such-run")
    assert status_of(info) == grpc.StatusCode.NOT_FOUND
    assert "no-such-run" in (info.value.details() or "")
    status = rpc_status.from_call(info.value)
    assert status is not None
    error_info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(error_info) for d in status.details)
    assert error_info.domain == "trainwire" and error_info.metadata["run_id"] == "no-such-run"
    assert error_info.reason == "RUN_NOT_FOUND"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.get("")
    assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
    for call, request in (
        (client.stub.PauseRun, pb.PauseRunRequest(run_id="ghost")),
        (client.stub.ResumeRun, pb.ResumeRunRequest(run_id="ghost")),
        (client.stub.StopRun, pb.StopRunRequest(run_id="ghost")),
        (client.stub.SetRunSpeed, pb.SetRunSpeedRequest(run_id="ghost", speed=1)),
        (client.stub.DeleteRun, pb.DeleteRunRequest(run_id="ghost")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request, timeout=TIMEOUT)
        assert status_of(info) == grpc.StatusCode.NOT_FOUND
        assert "ghost" in (info.value.details() or "")


async def test_list_pages_newest_first_with_state_filter(fake: FakeTrainer) -> None:
    fake.default = Script(silent=True)  # runs stay PENDING/RUNNING... until stopped
    async with running_gateway((fake.address,), heartbeat_timeout_s=30) as c:
        ids = [(await c.create(max_episodes=3)).id for _ in range(5)]
        stopped = await c.stub.StopRun(pb.StopRunRequest(run_id=ids[1]), timeout=TIMEOUT)
        assert stopped.run.state == State.STATE_STOPPED
        seen: list[str] = []
        token = ""
        while True:
            page = await c.stub.ListRuns(
                pb.ListRunsRequest(page_size=2, page_token=token), timeout=TIMEOUT
            )
            assert len(page.runs) <= 2
            seen.extend(r.id for r in page.runs)
            token = page.next_page_token
            if not token:
                break
        assert seen == ids[::-1]
        only = await c.stub.ListRuns(pb.ListRunsRequest(state=State.STATE_STOPPED), timeout=TIMEOUT)
        assert [r.id for r in only.runs] == [ids[1]]
        for bad in (pb.ListRunsRequest(page_token="garbage"), pb.ListRunsRequest(page_size=1001)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.stub.ListRuns(bad, timeout=TIMEOUT)
            assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
        for run_id in ids:
            if run_id != ids[1]:
                await c.stub.StopRun(pb.StopRunRequest(run_id=run_id), timeout=TIMEOUT)


# -- controls ---------------------------------------------------------------------------------


async def test_controls_follow_the_state_machine(client: Client, fake: FakeTrainer) -> None:
    hold = Script(hold_at=3)
    fake.push(hold)
    run = await client.create(max_episodes=10)
    await published(client.stub, run.id, 2)
    paused = (await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)).run
    assert paused.state == State.STATE_PAUSED
    again = (await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)).run
    assert again.state == State.STATE_PAUSED  # no-op
    fast = await client.stub.SetRunSpeed(
        pb.SetRunSpeedRequest(run_id=run.id, speed=99), timeout=TIMEOUT
    )
    assert fast.run.speed == 20
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.SetRunSpeed(
            pb.SetRunSpeedRequest(run_id=run.id, speed=math.inf), timeout=TIMEOUT
        )
    assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
    resumed = await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert resumed.run.state == State.STATE_RUNNING
    resumed = await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert resumed.run.state == State.STATE_RUNNING  # no-op
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert status_of(info) == grpc.StatusCode.FAILED_PRECONDITION
    stopped = await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert stopped.run.state == State.STATE_STOPPED and stopped.run.episode == 2
    await to_thread(fake.wait_idle)
    assert fake.cancelled == 1  # the trainer stream was cancelled
    for call, request in (
        (client.stub.PauseRun, pb.PauseRunRequest(run_id=run.id)),
        (client.stub.ResumeRun, pb.ResumeRunRequest(run_id=run.id)),
        (client.stub.StopRun, pb.StopRunRequest(run_id=run.id)),
        (client.stub.SetRunSpeed, pb.SetRunSpeedRequest(run_id=run.id, speed=2)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request, timeout=TIMEOUT)
        assert status_of(info) == grpc.StatusCode.FAILED_PRECONDITION
        assert run.id in (info.value.details() or "")
    deleted = await client.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert deleted.run.id == run.id
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.get(run.id)
    assert status_of(info) == grpc.StatusCode.NOT_FOUND


# -- trainer failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (
            Script(
                abort_after=3,
                localized="The dataset file is missing.",
                abort_code=grpc.StatusCode.FAILED_PRECONDITION,
            ),
            "The dataset file is missing.",
        ),
        (Script(abort_after=3), UNEXPECTED_MESSAGE),
        # The trainer's own contract check stopped its stream: read as one the gateway caught.
        (Script(abort_after=3, abort_reason=ErrorReason.CONTRACT_VIOLATION), CONTRACT_MESSAGE),
        (Script(abort_after=0, abort_code=grpc.StatusCode.UNKNOWN), UNEXPECTED_MESSAGE),
    ],
    ids=["localized", "plain", "trainer-contract", "plain-at-start"],
)
async def test_trainer_failures_become_user_messages(
    client: Client, fake: FakeTrainer, script: Script, message: str
) -> None:
    # The status a trainer ends its stream with, read from the wire. (Silent and killed
    # trainers, heartbeats and re-attaches: tests/core/test_failures.py.)
    fake.push(script)
    run = await client.create(max_episodes=10)
    final = await client.finished(run.id)
    assert final.state == State.STATE_ERROR
    assert final.error_message == message


async def test_a_stream_that_ends_ok_without_done_fails_the_run_and_logs_it(
    client: Client, fake: FakeTrainer, caplog: pytest.LogCaptureFixture
) -> None:
    # The end of a gRPC stream with status OK before a done episode. (Every rule the gateway
    # checks on the episodes themselves: tests/core/test_failures.py.)
    fake.push(Script(violate="end_without_done", violate_at=3))
    run = await client.create(max_episodes=6)
    with caplog.at_level(logging.ERROR, logger="gateway"):
        final = await client.finished(run.id)
    assert final.state == State.STATE_ERROR
    assert final.error_message == CONTRACT_MESSAGE
    lines = [r.getMessage() for r in caplog.records if "CONTRACT VIOLATION" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(f"CONTRACT VIOLATION run={run.id} rule=done ")
    # What was published stays: every episode before the end, in order.
    result = await collect(client.stub, run.id)
    assert result.numbers == list(range(1, 6))


async def test_gateway_survives_and_serves_after_failures(
    client: Client, fake: FakeTrainer
) -> None:
    fake.push(Script(violate="finite"), Script(abort_after=1))
    bad = [await client.create(max_episodes=5) for _ in range(2)]
    for run in bad:
        assert (await client.finished(run.id)).state == State.STATE_ERROR
    good = await client.create(max_episodes=5)
    assert (await client.finished(good.id)).state == State.STATE_DONE


# -- watch errors, health, reflection, shutdown ----------------------------------------------


async def test_watch_errors(client: Client) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(client.stub, "nobody")
    assert status_of(info) == grpc.StatusCode.NOT_FOUND
    run = await client.create(max_episodes=2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(client.stub, run.id, after_episode=-1)
    assert status_of(info) == grpc.StatusCode.INVALID_ARGUMENT
    assert run.id in (info.value.details() or "")


async def test_health_and_reflection(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "trainwire.v1.GatewayService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
    )
    names = set()
    async for reply in replies:
        names = {s.name for s in reply.list_services_response.service}
    assert {"trainwire.v1.GatewayService", "grpc.health.v1.Health"} <= names


async def test_shutdown_ends_watches_unavailable_and_a_restart_without_the_job_interrupts(
    fake: FakeTrainer, tmp_path: Path
) -> None:
    db = str(tmp_path / "gw.sqlite3")
    fake.push(Script(hold_at=4))
    async with running_gateway((fake.address,), db=db) as c:
        run = await c.create(max_episodes=10)
        await published(c.stub, run.id, 3)
        watch = c.stub.WatchRun(pb.WatchRunRequest(run_id=run.id), timeout=TIMEOUT)
        async for message in watch:
            if message.WhichOneof("event") == "caught_up":
                break
        health = health_pb2_grpc.HealthStub(c.channel)
        stopping = asyncio.create_task(c.gateway.stop())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in watch:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert run.id in (info.value.details() or "")
        await asyncio.wait_for(stopping, TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError):
            await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
    await to_thread(fake.wait_idle)
    # The fake trainer keeps no detached job: the restarted gateway's re-attach finds none.
    async with running_gateway((fake.address,), db=db) as again:
        result = await collect(again.stub, run.id)
        final = result.finished
        assert final is not None
        assert final.state == State.STATE_ERROR and final.error_message == INTERRUPTED_MESSAGE
        assert final.episode == 3
        assert result.numbers == [1, 2, 3]
    assert fake.requests[-1].attach_after_episode == 3
