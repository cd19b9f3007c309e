"""The settings the gateway core runs on: rates, timeouts, trainers and memory bounds.

The core takes this type, never the edge's ``CoreSettings``: ``CoreSettings.core()`` builds it
from the flags, and tests build it directly. Its defaults are the flags' defaults (the config
reads them from here), so each is written once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSettings:
    """What the run registry, its drivers and its scheduler need to know.

    Attributes:
        trainers: Trainer addresses ``HOST:PORT``, tried in order.
        episode_rate: Episodes per second of a run that sets none; negative: unpaced.
        keepalive_s: Seconds of silence on a watch before a keepalive.
        heartbeat_timeout_s: Seconds without an episode or heartbeat before a trainer counts as
            lost; a broken stream is re-attached for this long before the run fails.
        lead_s: Seconds of a paced run's rate x speed its trainer may train ahead.
        shutdown_grace_s: Seconds background work gets on shutdown.
        schedule_poll_s: Seconds between two probes of a trainer while runs wait.
        trainer_call_timeout_s: Deadline of a unary trainer call (probe, grant, cancel).
        history_cache_mb: Memory for cached history pages of finished runs (MiB).
        live_coalesce_s: Upper bound of a run's live wake window.
        max_pending: The most runs waiting for a trainer.
        park_after_s: Seconds a run stays paused before it is parked (checkpointed, its trainer
            slot freed); 0: never.
        max_restarts: How many times a run whose trainer or job died is restarted from its
            latest checkpoint before it fails.
        checkpoint_call_timeout_s: Deadline of a ``CancelJob`` that waits for a final
            checkpoint (stop, park): writing a model takes a while.
        live_episodes: Episodes of an active run held in memory (its live tail, between one
            and two times this many); older ones are read from the store.
        details_per_run: About how many episode details a long run keeps by its stride
            (``gateway.core.details``).
    """

    trainers: tuple[str, ...] = ("127.0.0.1:50052",)
    episode_rate: float = 20.0
    keepalive_s: float = 15.0
    heartbeat_timeout_s: float = 30.0
    lead_s: float = 2.0
    shutdown_grace_s: float = 2.0
    schedule_poll_s: float = 1.0
    trainer_call_timeout_s: float = 5.0
    history_cache_mb: float = 64.0
    live_coalesce_s: float = 0.02
    max_pending: int = 1000
    park_after_s: float = 60.0
    max_restarts: int = 3
    checkpoint_call_timeout_s: float = 300.0
    live_episodes: int = 2048
    details_per_run: int = 10_000


#: The defaults, for the edge's flags.
DEFAULTS = CoreSettings()
