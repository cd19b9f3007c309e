"""Live hyperparameters in the gateway core, in virtual time: a change reaches the run's job,
shows in the metrics of the episodes trained after it (and in no episode before), in the run's
task and in the store; a parked run takes it in its task and the job placed on resume trains
with it; what is refused (bad values, a kind without the field, beta without a reference
model, a run that is PENDING, finished or trained out) and an unreachable trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gateway.core.catalog import RunSpec
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    RunNotFound,
    TrainerUnavailable,
)
from gateway.core.runs import RunState, TrainingRun
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import HyperparametersCall, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

pytestmark = VIRTUAL_TIME


def reporting_trainer(address: str = "t1", **kwargs: object) -> MemoryTrainer:
    """A trainer whose episodes carry their hyperparameters, as the real providers' do."""
    return MemoryTrainer(address, hyperparameter_metrics=True, **kwargs)  # type: ignore[arg-type]


async def create_grpo(core: Core, beta: float | None, max_episodes: int = 60) -> TrainingRun:
    grpo = episode_pb2.GrpoTask(model_path="models/m", dataset_path="data/d.jsonl")
    if beta is not None:
        grpo.beta = beta
    spec = RunSpec(
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=7),
        speed=0.0,
        episodes_per_second=10.0,
    )
    return await core.registry.create(spec)


def change_point(episodes: list[episode_pb2.Episode], metric: str) -> list[tuple[int, float]]:
    """Each episode where ``metric`` takes a new value, and the value: the history of changes."""
    points: list[tuple[int, float]] = []
    for episode in episodes:
        value = episode.metrics[metric]
        if not points or points[-1][1] != value:
            points.append((episode.episode, value))
    return points


async def test_a_learning_rate_change_shows_from_the_first_episode_trained_after_it() -> None:
    async with running_core(reporting_trainer()) as core:
        run = await core.create(max_episodes=60, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 10)

        changed = await core.registry.set_hyperparameters(
            run.id, Hyperparameters(learning_rate=0.005)
        )

        assert changed.task.imitation.learning_rate == 0.005
        assert changed.task.imitation.clip_name == "wave"  # the rest of the task as it was
        [call] = core.connector.hyperparameter_calls(run.id)
        assert call == HyperparametersCall("t1", run.id, Hyperparameters(0.005), call.at)
        # The job took it after the lead it had trained beyond the published episode.
        [(trained_before, values)] = core.connector.job(run.id).hyperparameter_changes
        assert values == {"learning_rate": 0.005}
        await watch.ended()
        episodes = watch.episodes()
        assert [e.episode for e in episodes] == list(range(1, 61))  # each once
        assert trained_before > 10
        assert change_point(episodes, "learning_rate") == [(1, 0.03), (trained_before + 1, 0.005)]
        done = await core.run(run.id)
        assert done.state is RunState.DONE and done.task.imitation.learning_rate == 0.005
        stored = await core.store.get_run(run.id)
        assert stored is not None and stored.task.imitation.learning_rate == 0.005


async def test_grpo_temperature_and_beta_change_on_a_paused_run() -> None:
    async with running_core(reporting_trainer(providers=("grpo",))) as core:
        run = await create_grpo(core, beta=0.04)
        await core.wait_episode(run.id, 5)
        paused = await core.registry.pause(run.id)

        changed = await core.registry.set_hyperparameters(
            run.id, Hyperparameters(temperature=0.7, beta=0.0)
        )
        assert changed.state is RunState.PAUSED
        assert (changed.task.grpo.temperature, changed.task.grpo.beta) == (0.7, 0.0)
        assert changed.task.grpo.HasField("beta")
        # Beta back above 0: the job was started with a reference model.
        await core.registry.set_hyperparameters(run.id, Hyperparameters(beta=0.1))
        # Paused: the job holds at its grant, so both changes come after the same episode.
        [(held, _), (held_too, _)] = core.connector.job(run.id).hyperparameter_changes
        assert held == held_too > paused.episode

        watch = core.watch(run.id, after_episode=paused.episode)
        await core.registry.resume(run.id)
        await watch.ended()
        episodes = watch.episodes()
        assert change_point(episodes, "temperature") == [
            (paused.episode + 1, 1.0),
            (held + 1, 0.7),
        ]
        assert change_point(episodes, "beta") == [(paused.episode + 1, 0.04), (held + 1, 0.1)]
        assert change_point(episodes, "learning_rate") == [(paused.episode + 1, 3e-3)]


async def test_a_parked_run_takes_the_change_in_its_task_and_resumes_with_it(
    tmp_path: Path,
) -> None:
    trainer = reporting_trainer(slots_total=1)
    async with running_core(trainer, db=str(tmp_path / "runs.db"), park_after_s=5.0) as core:
        run = await core.create(
            max_episodes=40, checkpoint_every=4, keep_checkpoints=20, episodes_per_second=10.0
        )
        await core.wait_episode(run.id, 9)
        paused = await core.registry.pause(run.id)

        await core.wait_parked(run.id)
        changed = await core.registry.set_hyperparameters(
            run.id, Hyperparameters(learning_rate=0.2)
        )
        assert changed.parked and changed.task.imitation.learning_rate == 0.2
        assert core.connector.hyperparameter_calls(run.id) == []  # no job to tell

        await core.restart()  # the change is in the store
        assert (await core.run(run.id)).task.imitation.learning_rate == 0.2
        watch = core.watch(run.id)
        await core.registry.resume(run.id)
        await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        placed = core.connector.trains(run.id)[-1]
        restored = placed.resume_from[0]
        assert core.connector.job(run.id).task.imitation.learning_rate == 0.2
        # The new job trained again from its checkpoint with the new rate; the episodes the
        # run had (through the paused one) stay as they were trained.
        assert restored < paused.episode
        assert change_point(watch.episodes(), "learning_rate") == [
            (1, 0.03),
            (paused.episode + 1, 0.2),
        ]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (Hyperparameters(), "(request)"),
        (Hyperparameters(learning_rate=math.nan), "learning_rate"),
        (Hyperparameters(learning_rate=0.0), "learning_rate"),
        (Hyperparameters(learning_rate=1.5), "learning_rate"),
        (Hyperparameters(temperature=0.5), "temperature"),  # imitation has none
        (Hyperparameters(beta=0.1), "beta"),
    ],
)
async def test_bad_values_are_refused_naming_the_field_and_the_run(
    change: Hyperparameters, field: str
) -> None:
    async with running_core(reporting_trainer()) as core:
        run = await core.create(max_episodes=30, episodes_per_second=10.0)
        await core.wait_episode(run.id, 2)
        with pytest.raises(InvalidRequest) as refused:
            await core.registry.set_hyperparameters(run.id, change)
        assert [v.field for v in refused.value.violations] == [field]
        assert run.id in str(refused.value)
        assert core.connector.hyperparameter_calls(run.id) == []
        assert (await core.run(run.id)).task.imitation.learning_rate == 0.0  # unchanged


async def test_grpo_ranges_and_beta_without_a_reference_model() -> None:
    async with running_core(reporting_trainer(providers=("grpo",))) as core:
        run = await create_grpo(core, beta=None)
        await core.wait_episode(run.id, 2)
        for change, field in (
            (Hyperparameters(temperature=0.0), "temperature"),
            (Hyperparameters(temperature=10.5), "temperature"),
            (Hyperparameters(beta=-0.1), "beta"),
            (Hyperparameters(beta=math.inf), "beta"),
        ):
            with pytest.raises(InvalidRequest) as refused:
                await core.registry.set_hyperparameters(run.id, change)
            assert [v.field for v in refused.value.violations] == [field]
        # Started with beta 0: its job has no reference model, and the trainer says so.
        with pytest.raises(InvalidRequest) as refused:
            await core.registry.set_hyperparameters(run.id, Hyperparameters(beta=0.05))
        assert [v.field for v in refused.value.violations] == ["beta"]
        assert "reference model" in str(refused.value) and run.id in str(refused.value)
        assert not (await core.run(run.id)).task.grpo.HasField("beta")
        # Temperature 10 is in range.
        changed = await core.registry.set_hyperparameters(run.id, Hyperparameters(temperature=10.0))
        assert changed.task.grpo.temperature == 10.0


async def test_pending_finished_trained_out_and_unknown_runs_are_refused() -> None:
    trainer = reporting_trainer(slots_total=1)
    async with running_core(trainer) as core:
        first = await core.create(max_episodes=10, episodes_per_second=2.0)
        waiting = await core.create(max_episodes=10)
        await core.wait_state(first.id, RunState.RUNNING)
        with pytest.raises(IllegalTransition, match="PENDING"):
            await core.registry.set_hyperparameters(waiting.id, Hyperparameters(0.01))
        stopped = await core.registry.stop(waiting.id)
        with pytest.raises(IllegalTransition, match="STOPPED"):
            await core.registry.set_hyperparameters(stopped.id, Hyperparameters(0.01))

        # Every episode trained (the lead of 2 s at 2 episodes/s is 4; 10 is granted soon).
        async def trained_out() -> bool:
            return core.connector.job(first.id).done

        await until(trained_out, "all trained", 60.0)
        running = await core.run(first.id)
        assert running.state is RunState.RUNNING and running.episode < 10
        with pytest.raises(IllegalTransition, match="last episode"):
            await core.registry.set_hyperparameters(first.id, Hyperparameters(0.01))

        await core.wait_state(first.id, RunState.DONE, timeout=60.0)
        with pytest.raises(IllegalTransition, match="DONE"):
            await core.registry.set_hyperparameters(first.id, Hyperparameters(0.01))
        with pytest.raises(RunNotFound):
            await core.registry.set_hyperparameters("no-such-run", Hyperparameters(0.01))
        assert core.connector.hyperparameter_calls(first.id) == []


async def test_an_unreachable_trainer_answers_unavailable_and_changes_nothing() -> None:
    trainer = reporting_trainer()
    async with running_core(trainer, heartbeat_timeout_s=30.0) as core:
        run = await core.create(max_episodes=60, episodes_per_second=10.0)
        await core.wait_episode(run.id, 3)
        trainer.kill()
        with pytest.raises(TrainerUnavailable) as unavailable:
            await core.registry.set_hyperparameters(run.id, Hyperparameters(0.01))
        assert run.id in str(unavailable.value) and "try again" in str(unavailable.value)
        assert (await core.run(run.id)).task.imitation.learning_rate == 0.0
