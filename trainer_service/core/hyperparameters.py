"""Live hyperparameters of a job: the values its provider trains with, changed while it runs.

``SetHyperparameters`` asks a live job for new values from any thread
(:meth:`LiveHyperparameters.request`); its provider takes the change in its own thread just
before its next optimizer step (:meth:`LiveHyperparameters.take`) and applies it there, so a
step always trains with one set of values, and each episode reports the values its step used.

A provider describes its hyperparameters with two optional module functions:
``hyperparameters(task) -> Hyperparameters`` (what a job of the task starts with, defaults
applied) and ``check_hyperparameters(task, change) -> list[FieldViolation]`` (changes its jobs
cannot take, beyond the contract's ranges). The values are
:class:`trainwire.hyperparameters.Hyperparameters`, the one value type the gateway shares.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import threading
from typing import Any

from trainer_service.core.errors import InvalidRequest
from trainwire import contract
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

__all__ = ["LiveHyperparameters", "check_change", "same_but_hyperparameters"]


def check_change(
    run_id: str, provider: Any, kind: str, task: episode_pb2.TrainTask, change: Hyperparameters
) -> None:
    """Refuses a change a live job of ``task`` cannot take: none set, a value out of range or
    one the job's kind does not have (the contract's rules), else what its provider's
    ``check_hyperparameters`` refuses (beta for a GRPO job without a reference model).

    Raises:
        InvalidRequest: The change, every violation of the first check that found one.
    """
    violations = change.violations(kind)
    check = getattr(provider, "check_hyperparameters", None)
    if not violations and callable(check):
        violations = list(check(task, change))
    if violations:
        raise InvalidRequest(
            run_id,
            violations,
            "The hyperparameters cannot be changed: " + contract.describe_violations(violations),
        )


class LiveHyperparameters:
    """The hyperparameters of one job: thread-safe requests, taken by its provider.

    Args:
        initial: What the job starts with (defaults applied).
    """

    def __init__(self, initial: Hyperparameters | None = None) -> None:
        self._lock = threading.Lock()
        self._current = initial or Hyperparameters()
        self._pending: Hyperparameters | None = None

    @property
    def current(self) -> Hyperparameters:
        """The values the job's next optimizer step trains with."""
        with self._lock:
            return self._current

    def request(self, change: Hyperparameters) -> Hyperparameters:
        """Asks for ``change`` from the next optimizer step on (merged with any change not yet
        taken); returns the values that step trains with."""
        with self._lock:
            self._pending = change if self._pending is None else self._pending.merged(change)
            self._current = self._current.merged(change)
            return self._current

    def take(self) -> Hyperparameters | None:
        """The change asked for since the last ``take`` (None: none); called by the provider
        right before an optimizer step."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending


def _without_hyperparameters(task: episode_pb2.TrainTask) -> episode_pb2.TrainTask:
    copy = episode_pb2.TrainTask()
    copy.CopyFrom(task)
    if copy.HasField("imitation"):
        copy.imitation.ClearField("learning_rate")
    if copy.HasField("grpo"):
        for name in ("learning_rate", "temperature", "beta"):
            copy.grpo.ClearField(name)
    return copy


def same_but_hyperparameters(a: episode_pb2.TrainTask, b: episode_pb2.TrainTask) -> bool:
    """Whether two tasks are the same but for their live hyperparameters (a gateway
    re-attaching to a job sends the run's task, whose values it may have changed since)."""
    return _without_hyperparameters(a) == _without_hyperparameters(b)
