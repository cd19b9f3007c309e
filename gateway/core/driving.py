"""What a run's driver is given: the scheduler's ears, and the services every driver of a
registry shares (``DriverContext``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.core.checkpoints import CheckpointFiles
from gateway.core.details import DefaultsLookup
from gateway.core.observer import Observer
from gateway.core.runs import TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.store import Store
from gateway.core.trainers import TrainerConnector

if TYPE_CHECKING:
    from gateway.core.driver import RunDriver


class SchedulerHooks(Protocol):
    """What a driver tells the scheduler."""

    def started(self, trainer: str, slots: int = 1) -> None:
        """A run's share of ``slots`` dispatched to ``trainer`` got its first answer (or gave
        up waiting for it)."""
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

    settings: CoreSettings
    store: Store
    connector: TrainerConnector
    observer: Observer
    scheduler: SchedulerHooks
    #: Takes a driver that let its run go to another replica out of the runs driven here.
    demoted: Callable[[RunDriver], None]
    #: What a provider trains with where a task leaves a field unset, as a trainer advertised
    #: it (``Scheduler.provider_defaults``: kind, trainer address).
    provider_defaults: DefaultsLookup
    clock: Callable[[], float]
    now: Callable[[], int]
    #: Called once a run is finalized (it leaves the active runs).
    on_end: Callable[[RunDriver], None]
    #: Keeps a background task (a grant, a CancelJob) referenced until it is done.
    spawn: Callable[[Awaitable[None], str], None]
    #: Takes a run whose final state the store could not take, to write it later.
    unsaved: Callable[[TrainingRun], None]
    #: The checkpoint store's files (None: checkpoints are recorded, never deleted).
    checkpoint_files: CheckpointFiles | None = None
    #: Drops cached history pages of ``(run_id, first, last)`` (their details were dropped).
    forget_pages: Callable[[str, int, int], None] = lambda run_id, first, last: None
