"""``SetRunHyperparameters`` on a real in-process gateway over a scripted fake trainer: the change
reaches the trainer and the run's task, and every trainer answer maps to the status users get
(a refused field named in ``BadRequest``, a job with no step left, an unreachable trainer)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import Client, published, running_gateway, to_thread
from tests.fakes.waiting import TIMEOUT
from trainwire.contract import FieldViolation
from trainwire.reasons import ErrorReason
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire_ops.rich_status import rich_status

State = pb.Run.State


@pytest.fixture
async def client(fake: FakeTrainer) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,)) as c:
        yield c


async def held_run(client: Client, fake: FakeTrainer) -> tuple[pb.Run, Script]:
    """A run whose trainer holds it at episode 3 (two published)."""
    hold = Script(hold_at=3)
    fake.push(hold)
    run = await client.create(max_episodes=10)
    await published(client.stub, run.id, 2)
    return run, hold


async def set_hyperparameters(client: Client, **fields: object) -> pb.Run:
    request = pb.SetRunHyperparametersRequest(**fields)  # type: ignore[arg-type]
    return (await client.stub.SetRunHyperparameters(request, timeout=TIMEOUT)).run


async def refused(client: Client, **fields: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await set_hyperparameters(client, **fields)
    return info.value


def bad_fields(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return [v.field for v in bad.field_violations]
    return []


async def test_a_change_reaches_the_trainer_and_the_runs_task(
    client: Client, fake: FakeTrainer
) -> None:
    run, hold = await held_run(client, fake)
    changed = await set_hyperparameters(client, run_id=run.id, learning_rate=0.01)
    assert changed.task.imitation.learning_rate == 0.01
    assert changed.state == State.STATE_RUNNING
    [request] = fake.hyperparameter_requests
    assert request.run_id == run.id and request.learning_rate == 0.01
    assert not request.HasField("temperature") and not request.HasField("beta")
    assert (await client.get(run.id)).task.imitation.learning_rate == 0.01
    hold.release.set()
    final = await client.finished(run.id)
    assert final.state == State.STATE_DONE and final.task.imitation.learning_rate == 0.01


async def test_the_trainers_answers_become_statuses_naming_the_run(
    client: Client, fake: FakeTrainer
) -> None:
    run, hold = await held_run(client, fake)
    fake.hyperparameters_status = rich_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "run x: invalid request",
        ErrorReason.INVALID_REQUEST,
        violations=[FieldViolation("learning_rate", "the trainer says no")],
        localized="The hyperparameters cannot be changed: learning_rate: the trainer says no",
    )
    error = await refused(client, run_id=run.id, learning_rate=0.5)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert run.id in (error.details() or "") and "the trainer says no" in (error.details() or "")
    assert bad_fields(error) == ["learning_rate"]

    fake.hyperparameters_status = rich_status(
        grpc.StatusCode.FAILED_PRECONDITION, "run x: no step left", ErrorReason.JOB_FINISHED
    )
    error = await refused(client, run_id=run.id, learning_rate=0.5)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert run.id in (error.details() or "") and "last episode" in (error.details() or "")

    fake.hyperparameters_status = rich_status(
        grpc.StatusCode.UNAVAILABLE, "shutting down", ErrorReason.SHUTTING_DOWN
    )
    error = await refused(client, run_id=run.id, learning_rate=0.5)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and run.id in (error.details() or "")
    assert (await client.get(run.id)).task.imitation.learning_rate == 0  # nothing changed
    hold.release.set()


async def test_bad_requests_and_runs_that_cannot_change(client: Client, fake: FakeTrainer) -> None:
    run, hold = await held_run(client, fake)
    for fields, field in (
        ({}, "(request)"),
        ({"learning_rate": float("inf")}, "learning_rate"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"temperature": 1.0}, "temperature"),
    ):
        error = await refused(client, run_id=run.id, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert bad_fields(error) == [field] and run.id in (error.details() or "")
    error = await refused(client, run_id="no-such-run", learning_rate=0.1)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = await refused(client, run_id="", learning_rate=0.1)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.hyperparameter_requests == []

    await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
    await to_thread(fake.wait_idle)
    error = await refused(client, run_id=run.id, learning_rate=0.1)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "STOPPED" in (error.details() or "") and run.id in (error.details() or "")
    hold.release.set()
