"""Placement that cannot wedge: busy means SLOTS_BUSY only, probes in the background, runs of
kinds nobody offers wait alone, several trainers share the load, health follows the trainers.
The gateway runs in-process against scripted fake trainers on real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import TIMEOUT, published, running_gateway
from trainwire.v1 import episode_pb2, gateway_service_pb2

T = TypeVar("T")
State = gateway_service_pb2.Run.State
pb = gateway_service_pb2


async def until(condition: Callable[[], object], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def eventually(get: Callable[[], Awaitable[T]], check: Callable[[T], bool], what: str) -> T:
    """Polls ``get()`` until ``check`` accepts its value; returns that value."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        value = await get()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last: {value!r}"
        await asyncio.sleep(0.02)


@pytest.fixture
def trainers(make_fake: Callable[..., FakeTrainer]) -> Callable[..., FakeTrainer]:
    """Starts fake trainers (the shared ``make_fake``); all are stopped at the end."""
    return make_fake


def start(trainers: Callable[..., FakeTrainer], **kwargs: object) -> FakeTrainer:
    return trainers(**kwargs)


def grpo_request(max_episodes: int = 5) -> pb.CreateRunRequest:
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(
            grpo=episode_pb2.GrpoTask(model_path="models/m", dataset_path="data/d.jsonl")
        ),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes),
        episodes_per_second=-1,
    )


async def test_only_slots_busy_requeues_other_resource_exhausted_fails_the_run(
    trainers: Callable[..., FakeTrainer],
) -> None:
    fake = start(trainers, slots=4)
    fake.push(
        Script(exhausted="This request is too large for the trainer (4.2 MB; limit 4 MB)."),
        Script(busy=True),
    )
    async with running_gateway((fake.address,)) as client:
        too_big = await client.create(max_episodes=5)
        await asyncio.to_thread(fake.wait_calls, 1)  # it takes the first script
        # The busy answer goes to whichever of these two is placed first (a loaded machine
        # may place either first); it puts that run back in the queue, and both finish.
        others = [await client.create(max_episodes=5) for _ in range(2)]
        final = await client.finished(too_big.id)
        assert final.state == State.STATE_ERROR
        assert final.error_message.startswith("This request is too large")
        for run in others:
            assert (await client.finished(run.id)).state == State.STATE_DONE
    ids = [r.run_id for r in fake.requests]
    assert ids.count(too_big.id) == 1  # never re-queued
    assert sorted(ids.count(run.id) for run in others) == [1, 2]  # the busy one asked twice


async def test_a_hung_trainer_does_not_delay_placement_on_a_healthy_one(
    trainers: Callable[..., FakeTrainer],
) -> None:
    hung = start(trainers, slots=4)
    hung.hang_capabilities.set()
    healthy = start(trainers, slots=4)
    async with running_gateway(
        (hung.address, healthy.address), trainer_call_timeout_s=30.0
    ) as client:
        began = time.monotonic()
        run = await client.create(max_episodes=3)
        final = await client.finished(run.id)
        elapsed = time.monotonic() - began
        assert final.state == State.STATE_DONE and final.trainer == healthy.address
        # The hung trainer's probe is still waiting for its 30 s deadline.
        assert elapsed < 20.0
        assert hung.requests == []


async def test_a_kind_nobody_offers_waits_alone_and_says_why(
    trainers: Callable[..., FakeTrainer],
) -> None:
    fake = start(trainers, slots=4, providers=("imitation",))
    async with running_gateway((fake.address,)) as client:
        grpo = (await client.stub.CreateRun(grpo_request(), timeout=TIMEOUT)).run
        later = await client.create(max_episodes=3)
        assert (await client.finished(later.id)).state == State.STATE_DONE
        waiting = await client.get(grpo.id)
        assert waiting.state == State.STATE_PENDING
        assert waiting.state_detail == f"no trainer offers grpo: {fake.address} offers imitation"


async def test_waiting_for_a_slot_says_which_trainer_is_busy(
    trainers: Callable[..., FakeTrainer],
) -> None:
    fake = start(trainers, slots=1, default=Script(hold_at=2))
    async with running_gateway((fake.address,)) as client:
        first = await client.create(max_episodes=5)
        await published(client.stub, first.id, 1)
        second = await client.create(max_episodes=5)
        third = await client.create(max_episodes=5)

        wanted = f"waiting for a free slot: {fake.address} has 1/1 busy"
        await eventually(
            lambda: client.get(second.id), lambda r: r.state_detail == wanted, "the busy detail"
        )
        assert (await client.get(third.id)).state_detail == (
            f"{wanted}; 1 run(s) ahead in the queue"
        )
        running = await client.get(first.id)
        assert running.state == State.STATE_RUNNING
        assert running.state_detail.startswith(f"training on {fake.address}: episode ")


async def test_two_trainers_share_runs_and_one_that_dies_leaves_the_other(
    trainers: Callable[..., FakeTrainer],
) -> None:
    one = start(trainers, slots=1, default=Script(hold_at=2))
    two = start(trainers, slots=1, default=Script(hold_at=2))
    async with running_gateway((one.address, two.address)) as client:
        a = await client.create(max_episodes=5)
        b = await client.create(max_episodes=5)
        await published(client.stub, a.id, 1)
        await published(client.stub, b.id, 1)
        placed = {(await client.get(a.id)).trainer, (await client.get(b.id)).trainer}
        assert placed == {one.address, two.address}
        one.kill()  # its run is lost; new runs go to the other trainer
        lost = a if (await client.get(a.id)).trainer == one.address else b
        kept = b if lost is a else a
        assert (await client.finished(lost.id)).state == State.STATE_ERROR
        two.default.release.set()
        assert (await client.finished(kept.id)).state == State.STATE_DONE
        later = await client.create(max_episodes=3)
        final = await client.finished(later.id)
        assert final.state == State.STATE_DONE and final.trainer == two.address


async def test_health_is_not_serving_while_no_trainer_answers(
    trainers: Callable[..., FakeTrainer],
) -> None:
    fake = start(trainers, slots=1)
    async with running_gateway((fake.address,)) as client:
        health = health_pb2_grpc.HealthStub(client.channel)

        async def status() -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            return reply.status

        assert await status() == health_pb2.HealthCheckResponse.SERVING
        fake.kill()
        await eventually(
            status, lambda s: s == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING"
        )
        run = await client.create(max_episodes=3)
        waiting = await eventually(
            lambda: client.get(run.id),
            lambda r: r.state_detail.startswith("no trainer reachable: "),
            "the waiting detail",
        )
        assert waiting.state == State.STATE_PENDING
        assert fake.address in waiting.state_detail


async def test_stop_cancels_the_trainer_job(trainers: Callable[..., FakeTrainer]) -> None:
    fake = start(trainers, slots=1, default=Script(hold_at=3))
    async with running_gateway((fake.address,)) as client:
        run = await client.create(max_episodes=50)
        await published(client.stub, run.id, 2)
        await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
        await until(lambda: fake.jobs_cancelled == [run.id], "CancelJob")
        await asyncio.to_thread(fake.wait_idle)


async def test_grants_follow_commits_and_stop_while_paused(
    trainers: Callable[..., FakeTrainer],
) -> None:
    fake = start(trainers, slots=1)
    async with running_gateway((fake.address,), lead_s=1.0) as client:
        run = await client.create(max_episodes=400, episodes_per_second=20)
        await until(lambda: fake.requests, "the Train call")
        assert fake.requests[0].grant_through_episode == 20  # 1 s of 20 episodes/s
        await published(client.stub, run.id, 12)
        await until(lambda: fake.granted, "a grant")
        # Grants follow published episodes (through = episode + 20) and each moves the credit
        # forward by at least a quarter of the lead (5): never one Grant per episode.
        previous = 20
        for run_id, through in fake.granted:
            assert run_id == run.id and through >= previous + 5
            previous = through
        await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
        grants = len(fake.granted)
        await asyncio.sleep(1.0)
        assert len(fake.granted) <= grants + 1  # at most one that was in flight
        paused = await client.get(run.id)
        highest = max(t for _, t in fake.granted)
        assert paused.trainer_episode <= highest
        assert paused.trainer_episode - paused.episode <= 20
        assert paused.state_detail.startswith(f"paused at episode {paused.episode}")
        await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)


async def test_pending_runs_are_queued_again_in_creation_order_after_a_restart(
    trainers: Callable[..., FakeTrainer], tmp_path: Path
) -> None:
    db = str(tmp_path / "gw.sqlite3")
    async with running_gateway(("127.0.0.1:9",), db=db) as client:
        pending = [(await client.create(max_episodes=3)).id for _ in range(4)]
    fake = start(trainers, slots=1)
    async with running_gateway((fake.address,), db=db) as client:
        for run_id in pending:
            assert (await client.finished(run_id)).state == State.STATE_DONE
    assert [r.run_id for r in fake.requests] == pending
