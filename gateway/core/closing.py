"""The store's side of a driven run's end: the run's state written, the final state taken once
what it received is published, and the run let go of (its log closed, its details trimmed, its
trainers' slots reported free).

A write the store refuses because another replica owns the run (``NotOwner``) is answered
False: the driver abandons the run to that replica. A store that cannot be written keeps a
finished run's final state in memory (``unsaved``) to write once it can.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gateway.core.driving import DriverContext
from gateway.core.ending import Ending, log_end
from gateway.core.errors import StoreUnavailable
from gateway.core.live_log import EpisodeLog
from gateway.core.publisher import Publisher
from gateway.core.reporting import report_failure
from gateway.core.runs import TrainingRun
from gateway.core.store import STORE_MESSAGE, NotOwner, StoreWriteFailed

_LOGGER = logging.getLogger(__name__)


class Closing:
    """Writes one run's state and its end (see the module docstring)."""

    def __init__(
        self, run: TrainingRun, ctx: DriverContext, publisher: Publisher, log: EpisodeLog
    ) -> None:
        self._run = run
        self._ctx = ctx
        self._publisher = publisher
        self._log = log

    async def persist(self) -> None:
        """Stores the run's state, speed, times and trainer.

        Raises:
            StoreUnavailable: the store cannot be written (the change holds in memory, and a
                finished run's final state is written once the store can be again).
            NotOwner: another replica owns the run.
        """
        run = self._run
        self._ctx.observer.run_state_changed(run.id, run.state.name)
        snapshot = run.snapshot()
        try:
            await self._ctx.store.update_run(snapshot)
        except StoreWriteFailed:
            if snapshot.state.finished:
                self._ctx.unsaved(snapshot)
            raise StoreUnavailable(f"run {run.id!r}: {STORE_MESSAGE}", run.id) from None

    async def take_end(self, failure: BaseException | None, trainer: str, gave_up: bool) -> bool:
        """A run whose job ended publishes what it received, then ends DONE (no ``failure``)
        or ERROR saying why (and that its restarts were spent). False: another replica owns
        the run."""
        run, now = self._run, self._ctx.now()
        ending = None if failure is None else self._report(failure, trainer)
        try:
            await self._publisher.flush()
        except NotOwner:
            return False
        except Exception as exc:
            if ending is None:
                ending = self._report(exc, trainer)
        if ending is None:
            run.complete(now)
        elif gave_up:
            spent = f"Gave up after {run.restarts} restarts from checkpoints."
            run.fail(f"{ending.message} {spent}", now)
        else:
            run.fail(ending.message, now)
        return True

    def _report(self, exc: BaseException, trainer: str) -> Ending:
        return report_failure(self._ctx.observer, self._run.id, exc, trainer)

    async def store_end(self) -> bool:
        """Flushes and stores the run's final state (kept to write later when the store
        cannot be written). False: another replica owns the run and finishes it."""
        run = self._run
        try:
            await self._publisher.flush()
        except (StoreWriteFailed, NotOwner):
            pass  # logged where the write failed; a NotOwner comes again from persist below
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store", run.id, extra={"run_id": run.id}
            )
        try:
            await self.persist()
        except NotOwner:
            _LOGGER.warning(
                "run %s: another gateway replica took it over before its end (%s) was "
                "saved; that replica finishes it",
                run.id,
                run.state.name,
                extra={"run_id": run.id},
            )
            self._log.wake()
            return False
        except StoreUnavailable:
            _LOGGER.error(
                "run %s: its final state %s is saved once the store can be written again",
                run.id,
                run.state.name,
                extra={"run_id": run.id},
            )
        except Exception:
            _LOGGER.exception(
                "run %s: could not store its final state", run.id, extra={"run_id": run.id}
            )
        return True

    def let_go(self, trainers: Sequence[str]) -> None:
        """After the end is stored: ends the watches, trims the details, reports the slots
        on ``trainers`` free and logs the end."""
        run = self._run
        self._log.close()
        if self._publisher.details is not None:
            self._ctx.spawn(self._publisher.details.finish(), f"gateway-details-{run.id}")
        for address in trainers:
            self._ctx.scheduler.run_ended(address)
        log_end(run)

    async def leave(self) -> None:
        """Gateway shutdown: flushes the commits and stores the run as it is.

        Raises:
            StoreUnavailable, NotOwner: as ``persist``.
        """
        try:
            await self._publisher.flush()
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store",
                self._run.id,
                extra={"run_id": self._run.id},
            )
        try:
            await self.persist()
        finally:
            self._log.close()
