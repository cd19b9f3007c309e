"""The live hyperparameters of a GRPO job, as the trainer sees them: what a job starts with and
which changes it can take. The ranks apply a change (``LazyGRPOTrainer.set_hyperparameters``,
:mod:`.build`) at the step boundary where the trainer sends it (``HYPER``, :mod:`.wire`).

A full fine-tuning job started with beta 0 has no reference model (TRL builds none), so its beta
stays 0. A LoRA job always has one: its base model, the adapters disabled (TRL's reference for a
new adapter), so its beta may go above 0 at any step.

This module imports neither torch nor trl: the trainer process answers ``SetHyperparameters``
without the training stack.
"""

from __future__ import annotations

from trainer_service.providers.defaults import GRPO
from trainwire import contract
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

# The values and why each is what it is: trainer_service.providers.defaults.
#: Learning rate when the task leaves it at 0.
DEFAULT_LEARNING_RATE = GRPO.learning_rate
#: Learning rate of a LoRA task that leaves it at 0.
DEFAULT_LORA_LEARNING_RATE = GRPO.lora.learning_rate
#: KL coefficient of a LoRA task that leaves beta unset.
DEFAULT_LORA_BETA = GRPO.lora.beta
#: Sampling temperature when the task leaves it at 0.
DEFAULT_TEMPERATURE = GRPO.temperature


def default_learning_rate(task: episode_pb2.GrpoTask) -> float:
    """The learning rate of ``task`` when it leaves it at 0 (LoRA or full fine-tuning)."""
    return DEFAULT_LORA_LEARNING_RATE if task.HasField("lora") else DEFAULT_LEARNING_RATE


def has_reference_model(task: episode_pb2.GrpoTask) -> bool:
    """Whether a job of ``task`` can weigh a KL term: it starts with beta above 0, or trains
    LoRA adapters (the reference is the base model, adapters disabled)."""
    return initial_beta(task) > 0 or task.HasField("lora")


def initial_beta(task: episode_pb2.GrpoTask) -> float:
    """The KL coefficient a job of ``task`` starts with (unset: 0, no reference model, for full
    fine-tuning; :data:`DEFAULT_LORA_BETA` for LoRA)."""
    if task.HasField("beta"):
        return task.beta
    return DEFAULT_LORA_BETA if task.HasField("lora") else GRPO.beta


def hyperparameters(task: episode_pb2.TrainTask) -> Hyperparameters:
    """The live hyperparameters a job of ``task`` starts with, defaults applied."""
    grpo = task.grpo
    return Hyperparameters(
        learning_rate=grpo.learning_rate or default_learning_rate(grpo),
        temperature=grpo.temperature or DEFAULT_TEMPERATURE,
        beta=initial_beta(grpo),
    )


def check_hyperparameters(
    task: episode_pb2.TrainTask, change: Hyperparameters
) -> list[contract.FieldViolation]:
    """What a job of ``task`` cannot take of ``change`` beyond the contract's ranges: beta
    above 0 without a reference model (:func:`has_reference_model`)."""
    return change.violations("grpo", reference_model=has_reference_model(task.grpo))
