"""Every provider's defaults: what a job trains with where its task or config leaves a field at 0
(or unset). This is the one place they are set: the providers apply them (``imitation``, and
grpo's ``settings``, ``hyperparameters`` and ``rewards``, bind their ``DEFAULT_*`` names to these
values) and the trainer advertises them (``GetCapabilitiesResponse.provider_defaults``, through
each provider's ``defaults()``), so what a trainer says is what its jobs do.

The grpo values are the settings that make the offline tiny VLM learn a colour question in under
200 steps on a CPU (``bench/grpo_learning.py``; LoRA: ``bench/grpo_lora.py``): a user who sets
only model, dataset, reward and steps sees learning.

This module imports neither torch nor trl: the trainer answers ``GetCapabilities`` without the
training stack, and the tests' in-memory trainer (``tests/fakes/memory_trainer.py``) advertises
these same values. The client package keeps a copy of the few its request checks need without a
trainer (``trainwire._contract_base``); ``tests/servicer/test_provider_defaults.py`` holds it to
what a trainer advertises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwire.v1 import trainer_service_pb2


@dataclass(frozen=True)
class ImitationDefaults:
    """The imitation provider's defaults (``ImitationTask``)."""

    #: Episodes between checkpoints when the config leaves ``checkpoint_every`` at 0.
    checkpoint_every: int = 500
    #: Motions sampled per episode when the task leaves ``group_size`` at 0.
    group_size: int = 16
    #: Adam learning rate when the task leaves ``learning_rate`` at 0.
    learning_rate: float = 0.03


@dataclass(frozen=True)
class LoraDefaults:
    """A LoRA grpo task's defaults where they differ from full fine-tuning's."""

    #: Adapter rank when ``LoraConfig.rank`` is 0.
    rank: int = 16
    #: ``LoraConfig.alpha`` 0 means this many times the rank.
    alpha_per_rank: float = 2.0
    #: Learning rate when the task leaves it at 0: adapters start at zero and move the model
    #: through a low-rank product, so they take a larger step than full weights; of 5e-3, 1e-2,
    #: 2e-2, 3e-2 and 5e-2 on the tiny VLM, 1e-2 learned best (``bench/grpo_lora.py``).
    learning_rate: float = 1e-2
    #: KL coefficient when the task leaves beta unset. A LoRA job's reference is free (its base
    #: model with the adapters disabled), and without a KL term a low-rank policy collapses onto
    #: one answer for every image and stops learning: on the tiny LLaVA, LoRA at beta 0 settled
    #: at chance (0.23-0.26 last-10 at learning rates 3e-4..1e-2), at 0.04 it reached 0.95-0.96
    #: (``bench/grpo_lora.py``). TRL's own default is 0.
    beta: float = 0.04


@dataclass(frozen=True)
class GrpoDefaults:
    """The grpo provider's defaults (``GrpoTask``) for full fine-tuning; ``lora`` holds a LoRA
    task's where they differ."""

    #: Optimizer steps between checkpoints when the config leaves ``checkpoint_every`` at 0:
    #: often enough to lose little on a restart, rare enough that writing checkpoints (model,
    #: processor, Adam state, RNG) stays well inside a 5 % share of training time, even on a
    #: slow store.
    checkpoint_every: int = 50
    #: The reward functions of a task that names none.
    reward_functions: tuple[str, ...] = ("exact_match", "format")
    #: Completions sampled per prompt when ``num_generations`` is 0.
    num_generations: int = 8
    #: Prompts per optimizer step when ``batch_size`` is 0 (batch = this x num_generations).
    prompts_per_step: int = 16
    #: Longest completion in tokens when ``max_completion_length`` is 0.
    max_completion_length: int = 16
    #: Learning rate when the task leaves it at 0.
    learning_rate: float = 3e-3
    #: KL coefficient when the task leaves beta unset: 0, so a full fine-tuning job builds no
    #: reference model.
    beta: float = 0.0
    #: Sampling temperature when the task leaves it at 0.
    temperature: float = 1.0
    #: Gradient accumulation steps when the task leaves them at 0.
    gradient_accumulation_steps: int = 1
    #: DataLoader worker processes that decode images when the task leaves it unset.
    dataloader_num_workers: int = 2
    #: Processes (and slots) a job trains on when ``num_processes`` is 0.
    num_processes: int = 1
    lora: LoraDefaults = field(default_factory=LoraDefaults)


IMITATION = ImitationDefaults()
GRPO = GrpoDefaults()


def imitation_proto(values: ImitationDefaults = IMITATION) -> trainer_service_pb2.ProviderDefaults:
    """The imitation provider's defaults as ``GetCapabilities`` advertises them."""
    return trainer_service_pb2.ProviderDefaults(
        checkpoint_every=values.checkpoint_every,
        imitation=trainer_service_pb2.ImitationDefaults(
            group_size=values.group_size, learning_rate=values.learning_rate
        ),
    )


def grpo_proto(values: GrpoDefaults = GRPO) -> trainer_service_pb2.ProviderDefaults:
    """The grpo provider's defaults as ``GetCapabilities`` advertises them."""
    lora = values.lora
    return trainer_service_pb2.ProviderDefaults(
        checkpoint_every=values.checkpoint_every,
        grpo=trainer_service_pb2.GrpoDefaults(
            reward_functions=values.reward_functions,
            num_generations=values.num_generations,
            prompts_per_step=values.prompts_per_step,
            max_completion_length=values.max_completion_length,
            learning_rate=values.learning_rate,
            beta=values.beta,
            temperature=values.temperature,
            gradient_accumulation_steps=values.gradient_accumulation_steps,
            dataloader_num_workers=values.dataloader_num_workers,
            num_processes=values.num_processes,
            lora=trainer_service_pb2.LoraDefaults(
                rank=lora.rank,
                alpha_per_rank=lora.alpha_per_rank,
                learning_rate=lora.learning_rate,
                beta=lora.beta,
            ),
        ),
    )


#: Each provider's advertisement, by provider name (what a trainer that offers it says).
BY_PROVIDER = {"imitation": imitation_proto, "grpo": grpo_proto}
