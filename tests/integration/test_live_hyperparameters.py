"""A live learning-rate change through the real services: the trainer as a process (imitation on
the CPU), the gateway in-process. The run's history shows the change exactly once, at the first
episode the trainer trained after it: every episode before carries the old ``learning_rate``,
every one from there the new, and the run's task says so."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from tests.fakes.gateway_harness import (
    collect,
    published,
    running_gateway,
    trainer_process,
    wait_state,
)
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = pytest.mark.slow

State = pb.Run.State


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    with trainer_process(log, "--heartbeat", "0.5", slots=1) as (_, address):
        yield address


async def trained(address: str, run_id: str) -> int:
    """The trainer's own word on how far the run's job trained (a Grant that moves nothing)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        reply = await stub.Grant(
            trainer_service_pb2.GrantRequest(run_id=run_id, through_episode=0), timeout=TIMEOUT
        )
    return reply.last_episode


async def test_a_live_learning_rate_change_shows_in_the_metrics_where_it_happened(
    trainer: str,
) -> None:
    async with running_gateway((trainer,)) as client:
        run = await client.create(max_episodes=150, episodes_per_second=50.0)
        await published(client.stub, run.id, 20)
        await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
        # Paused: the job trains to its grant (the lead) and waits there; a grant sent just
        # before the pause may still arrive, so "there" is where it stays for half a second.
        loop = asyncio.get_running_loop()
        seen = {"episode": -1, "since": loop.time()}

        async def settled() -> int | None:
            now = await trained(trainer, run.id)
            if now != seen["episode"]:
                seen.update(episode=now, since=loop.time())
            return now if loop.time() - seen["since"] >= 0.5 else None

        held = await until(settled, "the job holds at its grant")
        changed = await client.stub.SetRunHyperparameters(
            pb.SetRunHyperparametersRequest(run_id=run.id, learning_rate=0.002), timeout=TIMEOUT
        )
        assert changed.run.task.imitation.learning_rate == 0.002
        assert changed.run.state == State.STATE_PAUSED
        await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)

        result = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
        assert [e.episode for e in result.episodes] == list(range(1, 151))
        rates = [e.metrics["learning_rate"] for e in result.episodes]
        assert 20 <= held < 150
        assert rates == [0.03] * held + [0.002] * (150 - held)
        final = await wait_state(client.stub, run.id, State.STATE_DONE)
        assert final.task.imitation.learning_rate == 0.002
