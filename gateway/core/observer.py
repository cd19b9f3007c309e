"""Hooks for metrics: the core reports what happens; an observer counts it.

The default observer does nothing. ``gateway.metrics.GatewayMetrics`` (Prometheus) subclasses
``Observer`` and is passed to ``RunRegistry``. Every hook is cheap and must not raise or block:
the per-episode ones (``episode_received``, ``episodes_published``, ``episodes_sent``) run on
the publication and watch paths. All hooks run on the event loop except ``store_commit``.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.trainers import Capabilities


class Observer:
    """No-op base; override what you count."""

    def runs_loaded(self, counts: Mapping[str, int]) -> None:
        """At start-up: how many stored runs are in each state (``RunState`` names)."""

    def run_created(self, run_id: str) -> None:
        """A run was created."""

    def run_recovered(self, run_id: str, state: str) -> None:
        """At start-up: an active run a previous gateway left (already in ``runs_loaded``)."""

    def run_state_changed(self, run_id: str, state: str) -> None:
        """A run was stored in ``state`` (the ``RunState`` name); also after a speed change,
        with the state unchanged."""

    def run_deleted(self, run_id: str, state: str) -> None:
        """A finished run in ``state`` was deleted."""

    def episode_received(self, run_id: str) -> None:
        """An episode arrived from the run's trainer (before checks and pacing)."""

    def heartbeat_received(self, run_id: str) -> None:
        """A heartbeat arrived from the run's trainer."""

    def episodes_published(self, run_id: str, count: int) -> None:
        """``count`` episodes became visible to watchers."""

    def episodes_sent(self, run_id: str, count: int) -> None:
        """``count`` episodes were handed to one watch stream (replayed or live)."""

    def store_commit(self, operations: int, seconds: float) -> None:
        """A group commit of ``operations`` took ``seconds`` (called on the store thread)."""

    def contract_violation(self, run_id: str, rule: str) -> None:
        """A trainer broke the stream contract."""

    def trainer_failure(self, run_id: str, kind: str) -> None:
        """A trainer stream failed: ``failed``, ``lost``, ``crashed`` or ``busy``."""

    def trainer_probed(self, address: str, capabilities: Capabilities | None) -> None:
        """A trainer answered ``GetCapabilities`` (``None``: it could not be reached)."""

    def watcher_attached(self, run_id: str) -> None:
        """A watch stream started."""

    def watcher_detached(self, run_id: str) -> None:
        """A watch stream ended (any way)."""
