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

from trainwire import contract
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

#: Learning rate when the task leaves it at 0 (see :mod:`.settings`).
DEFAULT_LEARNING_RATE = 3e-3
#: Learning rate of a LoRA task that leaves it at 0: adapters start at zero and move the model
#: through a low-rank product, so they take a larger step than full weights; of 5e-3, 1e-2,
#: 2e-2, 3e-2 and 5e-2 on the tiny VLM, 1e-2 learned best (``bench/grpo_lora.py``).
DEFAULT_LORA_LEARNING_RATE = 1e-2
#: KL coefficient of a LoRA task that leaves beta unset. A LoRA job's reference is free (its
#: base model with the adapters disabled), and without a KL term a low-rank policy collapses onto
#: one answer for every image and stops learning: on the tiny LLaVA, LoRA at beta 0 settled at
#: chance (0.23-0.26 last-10 at learning rates 3e-4..1e-2), at 0.04 it reached 0.95-0.96
#: (``bench/grpo_lora.py``). TRL's own default is 0.
DEFAULT_LORA_BETA = 0.04
#: Sampling temperature when the task leaves it at 0.
DEFAULT_TEMPERATURE = 1.0


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
    return DEFAULT_LORA_BETA if task.HasField("lora") else 0.0


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
