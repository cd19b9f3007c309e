"""The live hyperparameters of a run (``SetRunHyperparameters``, ``SetHyperparameters``): one
value type for the values in effect and for a change of them, shared by the gateway, the
trainer and the fakes of the tests.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainwire.contract import FieldViolation, check_hyperparameters

__all__ = ["Hyperparameters"]


@dataclass(frozen=True)
class Hyperparameters:
    """Values of the live hyperparameters; ``None`` means unset (left as it is by a change, or
    one the task kind does not have)."""

    learning_rate: float | None = None
    temperature: float | None = None
    beta: float | None = None

    def merged(self, newer: Hyperparameters) -> Hyperparameters:
        """These values with those ``newer`` sets."""
        return Hyperparameters(
            **{
                field.name: (
                    getattr(newer, field.name)
                    if getattr(newer, field.name) is not None
                    else getattr(self, field.name)
                )
                for field in dataclasses.fields(self)
            }
        )

    def as_dict(self) -> dict[str, float]:
        """The values that are set, by name (the names of the episode metrics)."""
        return {
            field.name: float(value)
            for field in dataclasses.fields(self)
            if (value := getattr(self, field.name)) is not None
        }

    def describe(self) -> str:
        """``learning_rate=0.01, beta=0`` (for logs)."""
        return ", ".join(f"{name}={value:g}" for name, value in self.as_dict().items())

    def violations(self, kind: str, reference_model: bool = True) -> list[FieldViolation]:
        """What a run of task ``kind`` refuses in this change (see
        :func:`trainwire.contract.check_hyperparameters`): none set, a value out of its range or
        one the kind does not have, beta above 0 without a ``reference_model``."""
        return check_hyperparameters(
            kind, self.learning_rate, self.temperature, self.beta, reference_model=reference_model
        )
