"""Forks with the real imitation trainer: a trainer process (imitation on the CPU) writing to a
checkpoint directory, the gateway in-process reading it.

Fork continuity: a fork's first episode is the one after its fork episode, and its reward is
the parent's there (the restored policy samples its first motions as the parent did, so a fork
with nothing changed continues the parent bit for bit); a fork with a lower learning rate goes
on from the parent's state and trains on. Invalid forks are refused over gRPC, naming the
field. The logic (numbering, replay, curves, restarts) is tested in virtual time in
``tests/core/test_forks.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.fakes.gateway_harness import Client, collect, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State
GATEWAY = {"heartbeat_timeout_s": 3.0, "schedule_poll_s": 0.2}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def trainer(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("trainer") / "t.log"
    flags = ("--heartbeat", "0.5", "--checkpoint-store", str(store))
    with trainer_process(log, *flags, slots=1) as (_, address):
        yield address


def _task(learning_rate: float = 0.0, clip: str = "wave") -> episode_pb2.TrainTask:
    return episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(
            rig_name="stickman", clip_name=clip, learning_rate=learning_rate
        )
    )


def _request(
    max_episodes: int,
    task: episode_pb2.TrainTask | None = None,
    fork: tuple[str, int] | None = None,
) -> pb.CreateRunRequest:
    request = pb.CreateRunRequest(
        task=task or _task(),
        config=episode_pb2.TrainConfig(
            max_episodes=max_episodes, seed=3, checkpoint_every=50, keep_checkpoints=10
        ),
        episodes_per_second=-1.0,
    )
    if fork is not None:
        request.fork_from.run_id, request.fork_from.episode = fork
    return request


async def _trained(client: Client, request: pb.CreateRunRequest) -> tuple[pb.Run, list]:  # type: ignore[type-arg]
    run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
    watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
    assert watched.finished is not None and watched.finished.state == State.STATE_DONE, (
        watched.finished
    )
    return run, watched.episodes


def _bad_fields(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


async def test_a_fork_continues_its_parent_and_trains_on_with_a_lower_learning_rate(
    trainer: str, store: Path
) -> None:
    async with running_gateway((trainer,), checkpoint_store=str(store), **GATEWAY) as client:
        parent, lineage = await _trained(client, _request(200))
        rewards = {e.episode: e.reward for e in lineage}
        best = {e.episode: e.best_reward for e in lineage}

        # Nothing changed: it goes on exactly as the parent did after its checkpoint.
        same, episodes = await _trained(client, _request(200, fork=(parent.id, 100)))
        assert (same.fork_from.run_id, same.fork_from.episode) == (parent.id, 100)
        assert (same.episode, same.best_reward) == (100, best[100])
        assert [e.episode for e in episodes] == list(range(101, 201))
        assert [e.reward for e in episodes] == pytest.approx(
            [rewards[n] for n in range(101, 201)], rel=1e-6
        )
        assert episodes[0].best_reward == max(best[100], episodes[0].reward)

        # Another seed: its own noise from the fork on.
        reseeded = _request(110, fork=(parent.id, 100))
        reseeded.config.seed = 4
        _, episodes = await _trained(client, reseeded)
        assert episodes[0].reward != pytest.approx(rewards[101], rel=1e-6)
        assert abs(episodes[0].reward - rewards[100]) < 0.05

        # A tenth of the learning rate, and longer: it starts where the parent stood and
        # improves on its own.
        slower, episodes = await _trained(
            client, _request(400, _task(learning_rate=0.003), fork=(parent.id, 100))
        )
        assert [e.episode for e in episodes] == list(range(101, 401))
        first = episodes[0].reward
        assert first == pytest.approx(rewards[101], rel=1e-6)  # the step before any update
        assert abs(first - rewards[100]) < 0.05  # imitation's reward is smooth
        assert episodes[5].reward != pytest.approx(rewards[106], rel=1e-6)  # its own rate
        tail = [e.reward for e in episodes[-20:]]
        assert sum(tail) / len(tail) > first + 0.02
        final = await client.stub.GetRun(pb.GetRunRequest(run_id=slower.id), timeout=TIMEOUT)
        assert final.run.episode == 400
        checkpoints = await client.stub.ListCheckpoints(
            pb.ListCheckpointsRequest(run_id=slower.id), timeout=TIMEOUT
        )
        assert checkpoints.checkpoints[0].episode == 150

        # Refused, naming the field.
        for request, field in (
            (_request(300, _task(clip="walk"), fork=(parent.id, 100)), "task.imitation.clip_name"),
            (_request(300, fork=(parent.id, 75)), "fork_from.episode"),
            (_request(100, fork=(parent.id, 100)), "config.max_episodes"),
            (_request(300, fork=("nosuchrun", 0)), "fork_from.run_id"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.stub.CreateRun(request, timeout=TIMEOUT)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert _bad_fields(refused.value) == [field], refused.value.details()


async def test_a_fork_driven_by_one_replica_is_watched_on_another(
    trainer: str, store: Path, postgres_url: str
) -> None:
    # B follows the fork from the shared database: its history starts after the fork there too.
    replica = {
        "db": postgres_url,
        "lease_s": 3.0,
        "keepalive_s": 0.5,
        "checkpoint_store": str(store),
    }
    async with running_gateway((trainer,), **replica, **GATEWAY) as a:
        parent, _ = await _trained(a, _request(100))
        request = _request(400, fork=(parent.id, 50))
        request.episodes_per_second = 100.0
        fork = (await a.stub.CreateRun(request, timeout=TIMEOUT)).run
        async with running_gateway((trainer,), **replica, **GATEWAY) as b:
            watched = await collect(b.stub, fork.id, timeout=JOB_TIMEOUT)
            assert watched.numbers == list(range(51, 401))
            assert watched.finished is not None and watched.finished.state == State.STATE_DONE
            replay = await collect(b.stub, fork.id, after_episode=10)
            assert replay.numbers == list(range(51, 401))
