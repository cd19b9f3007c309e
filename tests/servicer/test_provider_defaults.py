"""A trainer's providers' defaults (``GetCapabilitiesResponse.provider_defaults``), asked of a real
trainer on port 0 with the real providers: what it advertises is what its jobs apply; the client
package's copy of the few its request checks need without a trainer equals what it advertises
(so the two cannot drift apart); and the tests' in-memory trainer advertises the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.memory_trainer import MemoryTrainer
from tests.fakes.trainer_harness import running_trainer
from tests.fakes.waiting import TIMEOUT
from trainer_service.providers import grpo, imitation
from trainer_service.providers.grpo import process, rewards
from trainer_service.providers.grpo.settings import LoraSettings, Settings
from trainer_service.testing import FakeProvider
from trainwire import _contract_base, contract
from trainwire.v1 import episode_pb2, trainer_service_pb2

Advertised = dict[str, trainer_service_pb2.ProviderDefaults]


@pytest.fixture(scope="module")
def advertised() -> Iterator[Advertised]:
    """What a trainer with both real providers (and a fake one that says no defaults) answers."""
    providers = {
        "imitation": "trainer_service.providers.imitation",
        "grpo": "trainer_service.providers.grpo",
        "plain": FakeProvider(),
    }
    with running_trainer(providers) as trainer:
        reply = trainer.stub.GetCapabilities(
            trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
        )
    assert list(reply.providers) == ["imitation", "grpo", "plain"]
    yield dict(reply.provider_defaults)


def test_each_provider_that_has_defaults_advertises_them(advertised: Advertised) -> None:
    # A provider without defaults() is offered and advertises none (an older provider).
    assert sorted(advertised) == ["grpo", "imitation"]
    assert advertised["imitation"].WhichOneof("task") == "imitation"
    assert advertised["grpo"].WhichOneof("task") == "grpo"
    assert advertised["imitation"] == imitation.defaults()
    assert advertised["grpo"] == grpo.defaults()
    # The values TrainConfig, ImitationTask and GrpoTask document.
    assert (advertised["imitation"].checkpoint_every, advertised["grpo"].checkpoint_every) == (
        500,
        50,
    )
    values = advertised["grpo"].grpo
    assert list(values.reward_functions) == ["exact_match", "format"]
    assert (values.num_generations, values.max_completion_length) == (8, 16)
    assert (values.learning_rate, values.beta, values.temperature) == (3e-3, 0.0, 1.0)
    assert (values.lora.rank, values.lora.alpha_per_rank) == (16, 2.0)
    assert (values.lora.learning_rate, values.lora.beta) == (1e-2, 0.04)


def test_what_a_trainer_advertises_is_what_its_jobs_apply(advertised: Advertised) -> None:
    # imitation
    said = advertised["imitation"]
    assert said.checkpoint_every == imitation.DEFAULT_CHECKPOINT_EVERY
    bare = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(clip_name="wave"))
    assert imitation.hyperparameters(bare).learning_rate == said.imitation.learning_rate
    assert said.imitation.group_size == imitation.DEFAULT_GROUP_SIZE

    # grpo, full fine-tuning
    said = advertised["grpo"]
    values = said.grpo
    assert said.checkpoint_every == grpo.DEFAULT_CHECKPOINT_EVERY
    task = episode_pb2.GrpoTask(model_path="model", dataset_path="data.jsonl")
    settings = Settings.from_task(task)
    assert settings.num_generations == values.num_generations
    assert settings.batch_size == values.prompts_per_step * values.num_generations
    assert settings.max_completion_length == values.max_completion_length
    assert settings.learning_rate == values.learning_rate
    assert settings.beta == values.beta
    assert settings.temperature == values.temperature
    assert settings.gradient_accumulation_steps == values.gradient_accumulation_steps
    assert settings.num_workers == values.dataloader_num_workers
    assert settings.lora is None
    assert tuple(values.reward_functions) == rewards.DEFAULT_REWARDS
    whole = episode_pb2.TrainTask(grpo=task)
    assert grpo.slots_needed(whole) == process.processes_of(whole) == values.num_processes
    live = grpo.hyperparameters(whole)
    assert (live.learning_rate, live.temperature, live.beta) == (
        values.learning_rate,
        values.temperature,
        values.beta,
    )

    # grpo, LoRA
    task.lora.SetInParent()
    lora = Settings.from_task(task)
    assert lora.learning_rate == values.lora.learning_rate
    assert lora.beta == values.lora.beta
    assert lora.lora == LoraSettings(
        rank=values.lora.rank,
        alpha=values.lora.alpha_per_rank * values.lora.rank,
        dropout=0.0,
        target_modules=(),
    )


def test_the_client_packages_copy_equals_what_a_trainer_advertises(
    advertised: Advertised,
) -> None:
    values = advertised["grpo"].grpo
    assert values.num_generations == contract.DEFAULT_GRPO_GENERATIONS
    assert tuple(values.reward_functions) == contract.DEFAULT_REWARD_FUNCTIONS
    assert values.num_processes == contract.DEFAULT_GRPO_PROCESSES
    assert values.max_completion_length == _contract_base.DEFAULT_GRPO_MAX_COMPLETION_LENGTH
    assert (
        values.gradient_accumulation_steps
        == _contract_base.DEFAULT_GRPO_GRADIENT_ACCUMULATION_STEPS
    )
    assert values.lora.rank == _contract_base.DEFAULT_LORA_RANK
    assert values.lora.alpha_per_rank == _contract_base.DEFAULT_LORA_ALPHA_PER_RANK


def test_the_client_checks_fill_in_what_a_trainer_advertises(advertised: Advertised) -> None:
    """The checks that use the client's copy, run against the advertised values: a task that
    spells out the defaults is the task that leaves them at 0."""
    values = advertised["grpo"].grpo
    implicit = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d", lora=episode_pb2.LoraConfig())
    )
    explicit = episode_pb2.TrainTask()
    explicit.CopyFrom(implicit)
    explicit.grpo.reward_functions.extend(values.reward_functions)
    explicit.grpo.max_completion_length = values.max_completion_length
    explicit.grpo.gradient_accumulation_steps = values.gradient_accumulation_steps
    explicit.grpo.num_processes = values.num_processes
    explicit.grpo.lora.rank = values.lora.rank
    explicit.grpo.lora.alpha = values.lora.alpha_per_rank * values.lora.rank
    assert contract.fork_differences(implicit, explicit) == []
    assert contract.fork_differences(explicit, implicit) == []

    config = episode_pb2.TrainConfig(max_episodes=10)
    # A batch must be a multiple of the default num_generations; the weights one per default
    # reward function.
    implicit.grpo.batch_size = values.num_generations * 3
    implicit.grpo.reward_weights.extend([1.0] * len(values.reward_functions))
    assert contract.check_task(implicit, config) == []
    implicit.grpo.batch_size = values.num_generations + 1
    implicit.grpo.reward_weights.append(1.0)
    assert {v.field for v in contract.check_task(implicit, config)} == {
        "task.grpo.batch_size",
        "task.grpo.reward_weights",
    }


def test_the_in_memory_trainer_advertises_what_a_trainer_does(advertised: Advertised) -> None:
    both = MemoryTrainer("memory:1", providers=("imitation", "grpo")).capabilities()
    assert dict(both.provider_defaults) == advertised
    # Only for the providers it offers.
    alone = MemoryTrainer("memory:2", providers=("grpo",)).capabilities()
    assert dict(alone.provider_defaults) == {"grpo": advertised["grpo"]}
