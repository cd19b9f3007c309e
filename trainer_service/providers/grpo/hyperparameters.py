"""The live hyperparameters of a GRPO job, as the trainer sees them: what a job starts with and
which changes it can take. The ranks apply a change (``LazyGRPOTrainer.set_hyperparameters``,
:mod:`.build`) at the step boundary where the trainer sends it (``HYPER``, :mod:`.wire`).

A job started with beta 0 has no reference model (TRL builds none), so its beta stays 0.

This module imports neither torch nor trl: the trainer process answers ``SetHyperparameters``
without the training stack.
"""

from __future__ import annotations

from trainer_service.core.hyperparameters import Hyperparameters
from trainwire import contract
from trainwire.v1 import episode_pb2

#: Learning rate when the task leaves it at 0 (see :mod:`.settings`).
DEFAULT_LEARNING_RATE = 3e-3
#: Sampling temperature when the task leaves it at 0.
DEFAULT_TEMPERATURE = 1.0


def initial_beta(task: episode_pb2.GrpoTask) -> float:
    """The KL coefficient a job of ``task`` starts with (unset: 0, no reference model)."""
    return task.beta if task.HasField("beta") else 0.0


def hyperparameters(task: episode_pb2.TrainTask) -> Hyperparameters:
    """The live hyperparameters a job of ``task`` starts with, defaults applied."""
    grpo = task.grpo
    return Hyperparameters(
        learning_rate=grpo.learning_rate or DEFAULT_LEARNING_RATE,
        temperature=grpo.temperature or DEFAULT_TEMPERATURE,
        beta=initial_beta(grpo),
    )


def check_hyperparameters(
    task: episode_pb2.TrainTask, change: Hyperparameters
) -> list[contract.FieldViolation]:
    """What a job of ``task`` cannot take of ``change`` beyond the contract's ranges: beta
    above 0 without a reference model."""
    return contract.check_hyperparameters(
        "grpo",
        change.learning_rate,
        change.temperature,
        change.beta,
        reference_model=initial_beta(task.grpo) > 0,
    )
