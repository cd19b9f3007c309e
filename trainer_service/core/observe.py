"""How a job's life is reported: its outcome kinds and the observer the runner calls (the metrics
hang off it; the core knows nothing of how they are recorded)."""

from __future__ import annotations

import enum
from typing import Protocol


class JobOutcome(enum.StrEnum):
    """How a job ended."""

    OK = "ok"  #: the done episode was produced
    ERROR = "error"  #: the provider failed with a message for users (``ProviderError``)
    CRASH = "crash"  #: the provider raised something unexpected
    CONTRACT_VIOLATION = "contract_violation"  #: the stream broke the contract
    CANCELLED = "cancelled"  #: cancelled (``CancelJob``, or detached past the grace period)
    SHUTDOWN = "shutdown"  #: the trainer shut down under it


class JobObserver(Protocol):
    """Hears what the runner does; implementations must be cheap and must not raise.

    ``episode_sent`` and ``heartbeat_sent`` run on the streaming hot path, once per message.
    ``kind`` is the task kind (``imitation``, ``grpo``).
    """

    def job_started(self, run_id: str, kind: str) -> None:  # pragma: no cover - protocol
        """A job took a slot and its thread started."""
        ...

    def job_ended(
        self, run_id: str, kind: str, outcome: JobOutcome
    ) -> None:  # pragma: no cover - protocol
        """A job's outcome was decided (called exactly once per started job)."""
        ...

    def episode_sent(self, kind: str) -> None:  # pragma: no cover - protocol
        """An episode was written to the RPC (its handler asked for the next event)."""
        ...

    def heartbeat_sent(self, kind: str) -> None:  # pragma: no cover - protocol
        """A heartbeat was written to the RPC."""
        ...

    def contract_violation(self, kind: str, rule: str) -> None:  # pragma: no cover - protocol
        """The stream broke contract rule ``rule``."""
        ...

    def checkpoint_written(
        self, kind: str, seconds: float, size_bytes: int
    ) -> None:  # pragma: no cover - protocol
        """A checkpoint is in the store; ``seconds``: how long its commit took."""
        ...

    def checkpoint_failed(self, kind: str) -> None:  # pragma: no cover - protocol
        """A checkpoint could not be written."""
        ...


class NullJobObserver:
    """The observer that ignores everything (the default)."""

    def job_started(self, run_id: str, kind: str) -> None:
        """Ignored."""

    def job_ended(self, run_id: str, kind: str, outcome: JobOutcome) -> None:
        """Ignored."""

    def episode_sent(self, kind: str) -> None:
        """Ignored."""

    def heartbeat_sent(self, kind: str) -> None:
        """Ignored."""

    def contract_violation(self, kind: str, rule: str) -> None:
        """Ignored."""

    def checkpoint_written(self, kind: str, seconds: float, size_bytes: int) -> None:
        """Ignored."""

    def checkpoint_failed(self, kind: str) -> None:
        """Ignored."""
