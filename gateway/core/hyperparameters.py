"""Live hyperparameters of a run (``SetRunHyperparameters``): a change, checked against the run's
task kind and written into its task, which always holds the values in effect (the job placed
after a park or a restart trains with them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.core.errors import InvalidRequest
from trainwire.contract import check_hyperparameters, describe_violations, task_kind
from trainwire.v1 import episode_pb2


@dataclass(frozen=True)
class HyperparameterChange:
    """New values of a run's live hyperparameters; ``None`` leaves one as it is."""

    learning_rate: float | None = None
    temperature: float | None = None
    beta: float | None = None

    def as_dict(self) -> dict[str, float]:
        """The values it sets, by name."""
        return {
            field.name: value
            for field in dataclasses.fields(self)
            if (value := getattr(self, field.name)) is not None
        }

    def describe(self) -> str:
        """``learning_rate=0.01, beta=0`` (for logs)."""
        return ", ".join(f"{name}={value:g}" for name, value in self.as_dict().items())

    def check(self, run_id: str, task: episode_pb2.TrainTask, reference_model: bool = True) -> None:
        """Checks the change against the run's task kind and the ranges of the contract;
        ``reference_model`` False refuses beta above 0 (a grpo job started with beta 0).

        Raises:
            InvalidRequest: naming the field and the run.
        """
        violations = check_hyperparameters(
            task_kind(task),
            self.learning_rate,
            self.temperature,
            self.beta,
            reference_model=reference_model,
        )
        if violations:
            raise InvalidRequest(
                f"cannot change the hyperparameters of run {run_id!r}: "
                f"{describe_violations(violations)}",
                violations,
                run_id,
            )

    def applied_to(self, task: episode_pb2.TrainTask) -> episode_pb2.TrainTask:
        """A copy of ``task`` with the change (a run's task is shared by its snapshots, so it
        is replaced, never changed in place)."""
        changed = episode_pb2.TrainTask()
        changed.CopyFrom(task)
        kind = changed.WhichOneof("kind")
        target = changed.imitation if kind == "imitation" else changed.grpo
        for name, value in self.as_dict().items():
            setattr(target, name, value)
        return changed


def has_reference_model(task: episode_pb2.TrainTask) -> bool:
    """Whether a new job of ``task`` has a reference model (a grpo job with beta above 0, or
    one that trains LoRA adapters: its base model, adapters disabled; other kinds have no beta
    to check)."""
    if task.WhichOneof("kind") != "grpo":
        return True
    return (task.grpo.HasField("beta") and task.grpo.beta > 0) or task.grpo.HasField("lora")
