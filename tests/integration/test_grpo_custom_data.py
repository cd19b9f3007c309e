"""Data in the formats people have and reward functions of their own, against the real services
(issue 38, items 4 and 5): one trainer process started with ``--reward-module FILE.py`` and the
gateway in-process.

- The trainer's ``GetCapabilities`` lists the built-in rewards, then the module's.
- A run on a Parquet file of Hugging Face ``Image()`` values, its columns renamed by the task,
  scored by a custom reward and a built-in one with weights, trains to DONE; the rewards saw the
  row's other columns, and the episodes' rewards are the weighted sums.
- A run on a ``save_to_disk`` directory trains to DONE.
- ``CreateRun`` naming a reward no trainer offers is INVALID_ARGUMENT naming the field.
- A reward that raises fails the run with a message naming the function and the step.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.fakes.gateway_harness import collect, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.grpo_fixtures import tiny_grpo_task, tiny_vlm
from tests.grpo_tables import PARQUET_COLUMNS, write_parquet, write_saved
from trainer_service.tools import make_demo_dataset
from trainwire.contract import REWARD_FUNCTIONS
from trainwire.errors import InvalidRequest, error_from_rpc
from trainwire.v1 import episode_pb2, gateway_service_pb2, trainer_service_pb2
from trainwire.v1 import trainer_service_pb2_grpc as trainer_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

State = gateway_service_pb2.Run.State
MODULE = "tw_it_rewards"
REWARDS = '''
"""Rewards of the custom-data test: they check what TRL hands them."""


def constant(prompts, completions, colour, shape, solution, trainer_state, **kwargs):
    # The row's other columns arrive, the renamed solution among them.
    assert len(prompts) == len(completions) == len(colour) == len(shape) == len(solution)
    assert all(solution) and all(colour) and trainer_state.global_step >= 0
    return [0.25] * len(completions)


def boom(completions, trainer_state, **kwargs):
    if trainer_state.global_step >= 1:
        raise ValueError("no colour in sight")
    return [0.0] * len(completions)


def _helper():
    return None
'''
STEPS = 2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A trainer process with the test's reward module; its address."""
    root = tmp_path_factory.mktemp("custom-data")
    tiny_vlm(tmp_path_factory, root / "models" / "tiny-vlm")
    jsonl = make_demo_dataset.build(root / "datasets" / "demo", rows=4)
    write_parquet(jsonl, root / "datasets" / "tables" / "train.parquet", rows_per_group=2)
    write_saved(jsonl, root / "datasets" / "saved")
    module = tmp_path_factory.mktemp("modules") / f"{MODULE}.py"
    module.write_text(textwrap.dedent(REWARDS))
    log = root / "trainer.log"
    flags = ("--data-root", str(root), "--reward-module", str(module), "--heartbeat", "1")
    with trainer_process(log, *flags, slots=1) as (proc, address):
        yield address
        assert proc.poll() is None, log.read_text()[-3000:]


def _request(dataset: str, *rewards: str, **fields: Any) -> gateway_service_pb2.CreateRunRequest:
    task = tiny_grpo_task(dataset_path=dataset, reward_functions=rewards, **fields)
    return gateway_service_pb2.CreateRunRequest(
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=STEPS, seed=3),
        episodes_per_second=-1,
    )


def test_capabilities_list_the_modules_rewards(trainer: str) -> None:
    with grpc.insecure_channel(trainer) as channel:
        caps = trainer_grpc.TrainerServiceStub(channel).GetCapabilities(
            trainer_service_pb2.GetCapabilitiesRequest(), timeout=JOB_TIMEOUT
        )
    assert list(caps.reward_functions) == [
        *REWARD_FUNCTIONS,
        f"{MODULE}:constant",  # in definition order
        f"{MODULE}:boom",
    ]


async def test_a_parquet_run_with_weighted_custom_rewards(trainer: str) -> None:
    request = _request(
        "datasets/tables/train.parquet",
        "exact_match",
        f"{MODULE}:constant",
        workers=1,  # the rows' image bytes are decoded in a DataLoader worker
        reward_weights=[1.0, 2.0],
        columns=episode_pb2.DatasetColumns(**PARQUET_COLUMNS),
    )
    async with running_gateway((trainer,)) as client:
        run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
        watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
    done = watched.finished
    assert done is not None
    assert done.state == State.STATE_DONE, done.error_message
    assert [e.episode for e in watched.episodes] == list(range(1, STEPS + 1))
    for episode in watched.episodes:
        metrics = episode.metrics
        assert metrics[f"rewards/{MODULE}:constant/mean"] == pytest.approx(0.25)
        exact = metrics["rewards/exact_match/mean"]
        # The episode's reward is TRL's weighted sum: 1 x exact_match + 2 x 0.25.
        assert episode.reward == pytest.approx(exact + 0.5, abs=1e-5)


async def test_a_save_to_disk_run(trainer: str) -> None:
    request = _request("datasets/saved", "exact_match", "format", workers=0)
    async with running_gateway((trainer,)) as client:
        run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
        watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
    done = watched.finished
    assert done is not None
    assert done.state == State.STATE_DONE, done.error_message
    assert len(watched.episodes) == STEPS
    assert {"rewards/exact_match/mean", "rewards/format/mean"} <= set(watched.episodes[-1].metrics)


async def test_a_reward_no_trainer_offers_is_refused(trainer: str) -> None:
    async with running_gateway((trainer,)) as client:
        assert client.gateway.core is not None
        known = client.gateway.core.scheduler.trainers[trainer]
        await until(lambda: known.known_rewards, "the gateway asked the trainer", JOB_TIMEOUT)
        request = _request("datasets/saved", "format", f"{MODULE}:nope")
        with pytest.raises(grpc.RpcError) as info:
            await client.stub.CreateRun(request, timeout=TIMEOUT)
    error = error_from_rpc(info.value)
    assert isinstance(error, InvalidRequest) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    fields = [v.field for v in error.field_violations]
    assert fields == ["task.grpo.reward_functions[1]"], error


async def test_a_reward_that_raises_fails_the_run_naming_it_and_the_step(trainer: str) -> None:
    request = _request("datasets/saved", f"{MODULE}:boom", workers=0)
    request.config.max_episodes = 3
    async with running_gateway((trainer,)) as client:
        run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
        watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
    failed = watched.finished
    assert failed is not None and failed.state == State.STATE_ERROR, failed
    assert failed.error_message == (
        f"Reward function {MODULE}:boom failed at step 2: ValueError: no colour in sight"
    )
    assert [e.episode for e in watched.episodes] == [1]
