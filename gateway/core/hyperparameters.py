"""Live hyperparameters of a run (``SetRunHyperparameters``): a change, checked against the run's
task kind and written into its task, which always holds the values in effect (the job placed
after a park or a restart trains with them). The values are
:class:`trainwire.hyperparameters.Hyperparameters`."""

from __future__ import annotations

from gateway.core.errors import InvalidRequest
from trainwire.contract import describe_violations, task_kind
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2


def check_change(
    change: Hyperparameters, run_id: str, task: episode_pb2.TrainTask, reference_model: bool = True
) -> None:
    """Checks ``change`` against the run's task kind and the ranges of the contract;
    ``reference_model`` False refuses beta above 0 (a grpo job started with beta 0).

    Raises:
        InvalidRequest: naming the field and the run.
    """
    violations = change.violations(task_kind(task), reference_model=reference_model)
    if violations:
        raise InvalidRequest(
            f"cannot change the hyperparameters of run {run_id!r}: "
            f"{describe_violations(violations)}",
            violations,
            run_id,
        )


def applied_to(change: Hyperparameters, task: episode_pb2.TrainTask) -> episode_pb2.TrainTask:
    """A copy of ``task`` with ``change`` (a run's task is shared by its snapshots, so it is
    replaced, never changed in place)."""
    changed = episode_pb2.TrainTask()
    changed.CopyFrom(task)
    kind = changed.WhichOneof("kind")
    target = changed.imitation if kind == "imitation" else changed.grpo
    for name, value in change.as_dict().items():
        setattr(target, name, value)
    return changed


def has_reference_model(
    task: episode_pb2.TrainTask, defaults: trainer_service_pb2.ProviderDefaults | None = None
) -> bool:
    """Whether a new job of ``task`` has a reference model (a grpo job that starts with beta
    above 0, or one that trains LoRA adapters: its base model, adapters disabled; other kinds
    have no beta to check). A task that leaves beta unset starts with the default beta of its
    trainer's grpo provider (``defaults``, as the trainer advertised them); without them, with
    the contract's documented full fine-tuning default, 0 (what a trainer older than
    ``provider_defaults`` does)."""
    if task.WhichOneof("kind") != "grpo":
        return True
    grpo = task.grpo
    if grpo.HasField("lora"):
        return True
    if grpo.HasField("beta"):
        return grpo.beta > 0
    return defaults is not None and defaults.grpo.beta > 0
