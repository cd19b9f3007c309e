"""Whether a ``TrainRequest`` may become a job: its fields, its provider and the slots it needs.

:func:`admit` runs the checks in order (the request's fields, every bad one at once; the task's
provider is available on this trainer; the provider's own ``validate``; the slots the job needs)
and raises the first failure; the runner (``trainer_service.core.jobs``) then takes the slots
under its lock. A re-attach checks the fields alone (:func:`check_request`).

A job takes as many slots as its provider's ``slots_needed(task)`` says (one per process it
runs; 1 by default), all of them or none: a job that needs more than the trainer could ever
give it is ``INVALID_ARGUMENT``, one that waits for slots is ``SLOTS_BUSY``. A trainer's share
of a job that spans trainers (``placement``, checked by
``trainer_service.core.placement.check_placement``) takes the share's ``processes`` slots
instead. Its ``TrainJob`` names the device of each slot it holds. Those two rules are pure
functions (:func:`slots_needed`, :func:`too_many_slots`), so the tests' in-memory trainer
applies them too.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainer_service.core.errors import InvalidRequest
from trainer_service.core.placement import Placement, check_placement, placement_of
from trainer_service.core.provider import ProviderError
from trainer_service.core.slots import SlotPool
from trainwire import contract
from trainwire.v1 import episode_pb2, trainer_service_pb2


class ProviderLookup(Protocol):
    """What the runner needs of a provider registry."""

    def get(self, name: str) -> Any | None:  # pragma: no cover - protocol
        """The provider module for ``name``, or ``None``."""
        ...

    def unavailable_reason(self, name: str) -> str:  # pragma: no cover - protocol
        """Why ``name`` is not available."""
        ...

    def available(self) -> list[str]:  # pragma: no cover - protocol
        """Names of the importable providers."""
        ...


@dataclass(frozen=True)
class Admission:
    """A request that may become a job.

    Attributes:
        kind: The task kind (``imitation``, ``grpo``).
        provider: The provider module that runs it.
        slots_needed: Slots the job takes, all at once.
    """

    kind: str
    provider: Any
    slots_needed: int


def check_request(request: trainer_service_pb2.TrainRequest) -> list[contract.FieldViolation]:
    """Every bad field of a ``Train`` request (empty when there is none)."""
    violations = contract.check_train_request(request)
    violations.extend(check_placement(request))
    if request.grant_through_episode < 0:
        violations.append(
            contract.FieldViolation(
                "grant_through_episode",
                f"{request.grant_through_episode}; need >= 0 (0: no limit)",
            )
        )
    return violations


def admit(
    request: trainer_service_pb2.TrainRequest,
    registry: ProviderLookup,
    slots: SlotPool,
    data_roots: Sequence[pathlib.Path],
    reward_modules: Sequence[str] = (),
) -> Admission:
    """Checks that ``request`` may start a job on this trainer (takes no slot).

    ``data_roots`` and ``reward_modules`` are the trainer's, for the provider's ``validate``.

    Raises:
        InvalidRequest: Bad fields (every one of them), or more slots than the trainer could
            ever give one job.
        ProviderError: The task's provider is not available on this trainer.
    """
    run_id = request.run_id
    violations = check_request(request)
    if violations:
        raise InvalidRequest(run_id, violations)
    kind = contract.task_kind(request.task)
    provider = registry.get(kind)
    if provider is None:
        raise ProviderError(
            f"This trainer cannot run {kind} training.",
            detail=f"run {run_id}: provider {kind!r} unavailable: "
            f"{registry.unavailable_reason(kind)}",
            reason="PROVIDER_UNAVAILABLE",
        )
    validate = getattr(provider, "validate", None)
    if validate is not None:
        violations = validate(request.task, data_roots, reward_modules)
        if violations:
            raise InvalidRequest(run_id, violations)
    return Admission(kind, provider, _slots_needed(run_id, provider, kind, request, slots))


def slots_needed(
    provider: Any, kind: str, task: episode_pb2.TrainTask, placement: Placement | None
) -> tuple[int, str]:
    """Slots a job takes, and the request field that says so: a share of a job that spans
    trainers its own ``processes`` (``placement.processes``), else as many as its provider's
    ``slots_needed(task)`` says (at least 1; ``task.<kind>``), else 1."""
    if placement is not None:
        return placement.processes, "placement.processes"
    count = getattr(provider, "slots_needed", None)
    return (max(1, int(count(task))) if count is not None else 1), f"task.{kind}"


def too_many_slots(field: str, needed: int, most: int) -> contract.FieldViolation | None:
    """Why a job that takes ``needed`` slots can never run on a trainer that gives one job at
    most ``most`` (None: it can): it is refused (``INVALID_ARGUMENT``), never busy."""
    if needed <= most:
        return None
    return contract.FieldViolation(
        field,
        f"needs {needed} slots (one per process, each on its own GPU when "
        f"there are GPUs); this trainer can give one job at most {most}",
    )


def _slots_needed(
    run_id: str,
    provider: Any,
    kind: str,
    request: trainer_service_pb2.TrainRequest,
    slots: SlotPool,
) -> int:
    """Slots the job takes (a share of a job that spans trainers: its own processes); a job
    that could never get them is an invalid request."""
    needed, field = slots_needed(provider, kind, request.task, placement_of(request))
    violation = too_many_slots(field, needed, slots.most_per_job())
    if violation is not None:
        raise InvalidRequest(run_id, [violation])
    return needed
