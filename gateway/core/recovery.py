"""Nothing lost across a restart or a full disk.

``Recovery`` brings back a run that a previous gateway (or a replica that died) left active: a
PENDING run is queued again in creation order, a RUNNING or PAUSED run re-attaches to its
trainer job after its last committed episode (a PAUSED run stays paused; a job that spans
trainers is cancelled everywhere and the run restarted from its checkpoint instead,
``RunDriver.reattach``), a run whose done episode was committed completes, and a run whose
history is incomplete ends ERROR (``INTERRUPTED_MESSAGE``) with what it has.

``UnsavedEnds`` keeps the final states the store could not take (disk full) and writes them
once it can again; until then the registry answers with them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from gateway.core.curve import restore_builder
from gateway.core.driver import RunDriver
from gateway.core.framing import encode_frame
from gateway.core.observer import Observer
from gateway.core.runs import INTERRUPTED_MESSAGE, RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import Store, StoreWriteFailed
from gateway.core.table import RunTable
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)


class Recovery:
    """Recovers runs left active (see the module docstring).

    Args:
        store: Where their history is.
        table: Where their drivers go.
        scheduler: Where PENDING runs queue.
        observer: Metrics hooks.
        make_driver: A new driver of a run (driven here).
        now: Wall time in Unix nanoseconds.
    """

    def __init__(
        self,
        store: Store,
        table: RunTable,
        scheduler: Scheduler,
        observer: Observer,
        make_driver: Callable[[TrainingRun], RunDriver],
        now: Callable[[], int],
    ) -> None:
        self._store = store
        self._table = table
        self._scheduler = scheduler
        self._observer = observer
        self._make_driver = make_driver
        self._now = now

    async def recover(self, run: TrainingRun) -> None:
        """Brings back one run this gateway drives now."""
        driver = self._make_driver(run)
        self._table.add(driver)
        self._observer.run_recovered(run.id, run.state.name)
        if run.state is RunState.PENDING:
            _LOGGER.info(
                "run %s: queued again after a gateway restart",
                run.id,
                extra={"run_id": run.id, "event": "requeued"},
            )
            self._scheduler.enqueue(driver)
            return
        first = max(run.fork_episode + 1, run.episode - driver.log.keep + 1)
        data = await self._store.read_episodes(run.id, first, run.episode)
        if len(data) != run.episode - first + 1:
            _LOGGER.error(
                "run %s: %d of episodes %d..%d in the store; cannot continue it",
                run.id,
                len(data),
                first,
                run.episode,
                extra={"run_id": run.id},
            )
            await driver.recovered(INTERRUPTED_MESSAGE)
            return
        frames = [encode_frame(d) for d in data]
        if data and episode_pb2.Episode.FromString(data[-1]).done:
            # The done episode was committed before the gateway stopped: the run is complete.
            driver.log.restore(run.episode, frames)
            await driver.recovered(None)
            return
        curve = await restore_builder(
            run.id,
            run.episode,
            self._store.read_curve_blocks,
            functools.partial(self._store.read_episodes, scalars=True),
            run.fork_episode,
        )
        _LOGGER.info(
            "run %s: re-attaching to its job on %s after episode %d (%s)",
            run.id,
            run.trainer,
            run.episode,
            run.state.name,
            extra={"run_id": run.id, "event": "reattaching"},
        )
        driver.reattach(frames, curve)


class UnsavedEnds:
    """Final states the store could not take yet (see the module docstring).

    Args:
        store: Where they go.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._runs: dict[str, TrainingRun] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def remember(self, run: TrainingRun) -> None:
        """Keeps a final state the store refused."""
        self._runs[run.id] = run

    def get(self, run_id: str) -> TrainingRun | None:
        """The run's final state, while it is not saved."""
        return self._runs.get(run_id)

    async def save(self) -> None:
        """Writes what it keeps, until the store refuses again."""
        for run_id, run in list(self._runs.items()):
            try:
                await self._store.update_run(run)
            except StoreWriteFailed:
                return  # not writable after all: the next recovery tries again
            if self._runs.get(run_id) is run:
                del self._runs[run_id]
            _LOGGER.info(
                "run %s: its final state %s is saved now",
                run_id,
                run.state.name,
                extra={"run_id": run_id},
            )
