"""Placement by reward functions, in virtual time: a GRPO run that names a reward of a trainer's
``--reward-module`` goes only to trainers that offer it, waits (without blocking runs that need
less) while they are busy or away, and ``CreateRun`` refuses a reward no trainer has offered."""

from __future__ import annotations

import pytest

from gateway.core.catalog import RunSpec
from gateway.core.errors import InvalidRequest
from gateway.core.runs import RunState, TrainingRun
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until
from trainwire.contract import REWARD_FUNCTIONS
from trainwire.v1 import episode_pb2

pytestmark = VIRTUAL_TIME

CUSTOM = "mymod:score"
LONG = 40


def _plain() -> MemoryTrainer:
    return MemoryTrainer("t-plain", providers=("grpo",), slots_total=1)


def _custom() -> MemoryTrainer:
    return MemoryTrainer(
        "t-custom",
        providers=("grpo",),
        slots_total=1,
        reward_functions=(*REWARD_FUNCTIONS, CUSTOM, "mymod:other"),
    )


async def _create(core: Core, *rewards: str, episodes: int = 5) -> TrainingRun:
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="models/m", dataset_path="data/d.parquet", reward_functions=rewards
        )
    )
    config = episode_pb2.TrainConfig(max_episodes=episodes, seed=7)
    return await core.registry.create(RunSpec(task=task, config=config))


async def test_a_run_goes_to_a_trainer_that_offers_its_rewards() -> None:
    async with running_core(_plain(), _custom()) as core:
        custom = await _create(core, "exact_match", CUSTOM)
        plain = await _create(core, "exact_match", "format")
        for run in (custom, plain):
            await core.wait_state(run.id, RunState.DONE)
        assert (await core.run(custom.id)).trainer == "t-custom"
        assert (await core.run(plain.id)).trainer == "t-plain"  # first in configured order


async def test_a_run_waits_for_its_rewards_without_blocking_runs_that_need_less() -> None:
    async with running_core(_custom(), _plain()) as core:
        first = await _create(core, CUSTOM, episodes=LONG)
        await core.wait_state(first.id, RunState.RUNNING)
        second = await _create(core, CUSTOM)
        plain = await _create(core)  # needs only the built-in rewards: t-plain is free
        await core.wait_state(plain.id, RunState.DONE)
        waiting = await core.run(second.id)
        assert waiting.state is RunState.PENDING
        assert waiting.state_detail == "waiting for a free slot: t-custom has 1/1 busy"
        await core.registry.stop(first.id)
        await core.wait_state(second.id, RunState.DONE)
        assert (await core.run(second.id)).trainer == "t-custom"


async def test_a_reward_no_trainer_offered_is_refused_naming_the_field() -> None:
    custom = _custom()
    async with running_core(_plain(), custom) as core:
        await until(lambda: custom.probes >= 1, "t-custom answered")
        with pytest.raises(InvalidRequest) as info:
            await _create(core, "format", CUSTOM, "mymod:nope", "other:f")
        assert [v.field for v in info.value.violations] == [
            "task.grpo.reward_functions[2]",
            "task.grpo.reward_functions[3]",
        ]
        assert "no trainer offers 'mymod:nope'" in info.value.violations[0].description
        assert info.value.violations[0].description.endswith(f"rewards: mymod:other, {CUSTOM}")
        assert str(info.value).startswith(
            "cannot create the run: no trainer offers the reward function 'mymod:nope' "
            "(task.grpo.reward_functions[2])"
        )
        # A trainer that offered it and went away is still known: the run waits for it.
        custom.kill()
        gone = core.registry.scheduler.trainers["t-custom"]
        await until(lambda: gone.caps is None, "the gateway saw t-custom go")
        waiting = await _create(core, CUSTOM)
        why = (
            f"no reachable trainer offers the reward functions {CUSTOM} "
            "(reward modules: t-plain has none)"
        )

        async def says_why() -> bool:
            return (await core.run(waiting.id)).state_detail == why

        await until(says_why, "the waiting run says why")
        assert (await core.run(waiting.id)).state is RunState.PENDING
