"""What every ``RunDriver`` shares and the state its parts work on.

``DriverContext`` is what the registry hands every driver (config, store, connector, hooks);
``DriverState`` declares the state of one driver, which the driver's parts share: the trainer
feed (``gateway.core.driver_feed``), the publisher and its grants
(``gateway.core.driver_publish``), how the run ends (``gateway.core.driver_end``) and the run's
lifecycle (``gateway.core.driver``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.core.settings import CoreSettings
from gateway.core.history import EpisodeLog
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.runs import TrainingRun
from gateway.core.store import Store
from gateway.core.trainers import TrainerConnector, TrainerStream
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

if TYPE_CHECKING:
    from gateway.core.driver import RunDriver


class SchedulerHooks(Protocol):
    """What a driver tells the scheduler."""

    def started(self, trainer: str) -> None:
        """A run dispatched to ``trainer`` got its first answer (or gave up waiting for it)."""
        ...

    def requeue(self, driver: RunDriver) -> None:
        """The trainer was busy: the run goes back in the queue at its place."""
        ...

    def dequeue(self, driver: RunDriver) -> None:
        """The run leaves the queue (stopped while PENDING)."""
        ...

    def run_ended(self, trainer: str) -> None:
        """A run that was placed on ``trainer`` ended: a slot may be free."""
        ...


@dataclass(frozen=True)
class DriverContext:
    """What every driver of a registry shares."""

    config: CoreSettings
    store: Store
    connector: TrainerConnector
    observer: Observer
    scheduler: SchedulerHooks
    clock: Callable[[], float]
    now: Callable[[], int]
    #: Called once a run is finalized (it leaves the registry's active runs).
    on_end: Callable[[RunDriver], None]
    #: Keeps a background task (a CancelJob) referenced until it is done.
    spawn: Callable[[asyncio.Task[None]], None]
    #: Takes a run whose final state the store could not take, to write it later.
    unsaved: Callable[[TrainingRun], None]
    #: Claims a candidate's run for this replica before it starts (replicas); False when
    #: another replica has it.
    claim: Callable[[RunDriver], Awaitable[bool]] | None = None
    #: Called once a driver abandoned its run to another replica (it leaves the registry).
    on_lost: Callable[[RunDriver], None] | None = None


class DriverState:
    """The state of one driver, shared by its parts (see the module docstring).

    Attributes are set by ``RunDriver.__init__``; the methods named here are defined by the
    part that owns them.
    """

    run: TrainingRun
    _ctx: DriverContext
    log: EpisodeLog
    pacer: Pacer
    task: asyncio.Task[None] | None
    finalizing: bool
    #: Set by every control (pause, resume, speed, stop) to wake a waiting publisher.
    _control: asyncio.Event
    #: Set by every commit of this run's episodes.
    _committed: asyncio.Event
    #: Set when the reader buffered an episode or ended.
    _arrived: asyncio.Event
    #: Episodes handed to the store, awaiting commit: (episode, reward, best_reward, frame).
    _pending: deque[tuple[int, float, float, bytes]]
    _commit_error: BaseException | None
    #: Received and checked, not yet handed to the store.
    _buffer: deque[episode_pb2.Episode]
    _received_best: float | None
    _trainer: str
    #: Whether this replica owns the run (see ``gateway.core.driver``).
    owned: bool
    _granted: int
    _granting: bool

    # Defined by the driver's parts:
    persist: Callable[[], Awaitable[None]]
    abandon: Callable[[], Awaitable[None]]
    _release_reservation: Callable[[], None]
    _stream: Callable[[int | None], Awaitable[None]]
    _read: Callable[[TrainerStream, StreamChecker], Awaitable[None]]
    _publish_loop: Callable[[asyncio.Task[None]], Awaitable[None]]
    _flush: Callable[[], Awaitable[None]]
    _lead: Callable[[], int]
    _grant_target: Callable[[], int]
    _maybe_grant: Callable[[], None]
