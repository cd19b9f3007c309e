"""The trainer's domain errors. The servicer maps each to a gRPC status in one table.

``ProviderError`` (a provider's failure, with a message for users) lives in
``trainer_service.core.provider`` next to the interface providers implement;
``trainwire.contract.ContractViolation`` is the contract's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwire.contract import FieldViolation, describe_violations


class TrainerError(Exception):
    """Base of the trainer's domain errors; ``run_id`` names the job."""

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(f"run {run_id or '(none)'}: {message}")
        self.run_id = run_id


class InvalidRequest(TrainerError):
    """The request has bad fields (maps to ``INVALID_ARGUMENT`` + ``google.rpc.BadRequest``)."""

    def __init__(self, run_id: str, violations: Sequence[FieldViolation]) -> None:
        super().__init__(run_id, f"invalid request: {describe_violations(violations)}")
        self.violations = tuple(violations)


class NoFreeSlot(TrainerError):
    """Every slot is busy (maps to ``RESOURCE_EXHAUSTED``)."""

    def __init__(self, run_id: str, slots_total: int) -> None:
        super().__init__(
            run_id,
            f"all {slots_total} trainer slot(s) are busy; try again later or another trainer",
        )
        self.slots_total = slots_total


class ShuttingDown(TrainerError):
    """The trainer is shutting down (maps to ``UNAVAILABLE``)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "the trainer is shutting down; try another trainer")
