"""Hooks for metrics: the core reports what happens; an observer counts it.

The default observer does nothing. A metrics exporter (Prometheus) subclasses ``Observer`` and
is passed to ``RunRegistry``; every hook is cheap and must not raise or block.
"""

from __future__ import annotations


class Observer:
    """No-op base; override what you count."""

    def run_created(self, run_id: str) -> None:
        """A run was created."""

    def run_state_changed(self, run_id: str, state: str) -> None:
        """A run entered ``state`` (the ``RunState`` name)."""

    def episodes_published(self, run_id: str, count: int) -> None:
        """``count`` episodes became visible to watchers."""

    def store_commit(self, operations: int, seconds: float) -> None:
        """A group commit of ``operations`` took ``seconds`` (called on the store thread)."""

    def contract_violation(self, run_id: str, rule: str) -> None:
        """A trainer broke the stream contract."""

    def trainer_failure(self, run_id: str, kind: str) -> None:
        """A trainer stream failed: ``failed``, ``lost``, ``crashed`` or ``busy``."""

    def watcher_attached(self, run_id: str) -> None:
        """A watch stream started."""

    def watcher_detached(self, run_id: str) -> None:
        """A watch stream ended (any way)."""
