"""How a driven run ends: the trainer stream run to its end, its failure mapped to the run's end
(``FAILURES``), the final state stored (``finalize``) and the trainer's job cancelled where the
end is the gateway's: a stop, or a failure on the gateway's side (the invariants are in
``gateway.core.driver``).

``EndMixin`` is part of ``RunDriver`` (split off to keep each module readable in one sitting).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

from gateway.core.driver_context import DriverState
from gateway.core.errors import StoreUnavailable
from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    LOST_MESSAGE,
    UNEXPECTED_MESSAGE,
    RunState,
    TrainingRun,
)
from gateway.core.store import STORE_MESSAGE, NotOwner, StoreWriteFailed
from gateway.core.trainers import (
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
)
from trainwire.contract import ContractViolation

if TYPE_CHECKING:
    from gateway.core.driver import RunDriver

_LOGGER = logging.getLogger("gateway.core.driver")

#: How a failure ends a run: the message users read (None: the trainer's own), the observer's
#: label and the log line (trainer, detail).
FAILURES: dict[type[Exception], tuple[str | None, str, str]] = {
    TrainerFailed: (None, "failed", "trainer %s failed: %s"),
    TrainerLost: (LOST_MESSAGE, "lost", "trainer %s stopped responding: %s"),
    TrainerJobGone: (INTERRUPTED_MESSAGE, "gone", "trainer %s no longer has the job: %s"),
    TrainerCrashed: (UNEXPECTED_MESSAGE, "crashed", "trainer %s stopped: %s"),
    TrainerBusy: (UNEXPECTED_MESSAGE, "busy", "trainer %s busy mid-stream: %s"),
    TrainerJobExists: (UNEXPECTED_MESSAGE, "exists", "trainer %s has a second job: %s"),
}


def _log_end(run: TrainingRun) -> None:
    """The one INFO line of a run's end: finished (DONE), stopped or failed (ERROR)."""
    extra = {"run_id": run.id, "state": run.state.name}
    if run.state is RunState.DONE:
        _LOGGER.info(
            "run %s finished: %d episodes, best reward %g",
            run.id,
            run.episode,
            run.best_reward,
            extra={**extra, "event": "finished"},
        )
    elif run.state is RunState.STOPPED:
        _LOGGER.info(
            "run %s stopped at episode %d (trainer at %d)",
            run.id,
            run.episode,
            run.trainer_episode,
            extra={**extra, "event": "stopped"},
        )
    else:
        _LOGGER.info(
            "run %s failed at episode %d: %s",
            run.id,
            run.episode,
            run.error_message,
            extra={**extra, "event": "failed"},
        )


class EndMixin(DriverState):
    """Drives the stream to its end and ends the run (``RunDriver``'s part; see
    ``DriverState``)."""

    @property
    def _driver(self) -> RunDriver:
        """This driver, as the hooks it passes itself to know it."""
        return cast("RunDriver", self)

    # -- driving -----------------------------------------------------------------------------

    async def _drive(self, attach_after: int | None) -> None:
        """Runs the trainer stream to its end and records how the run ended."""
        run = self.run
        trainer = self._trainer
        message: str | None = None
        try:
            if not self.owned:
                assert self._ctx.claim is not None
                if not await self._ctx.claim(self._driver):
                    raise NotOwner(run.id)
                self.owned = True
            await self._stream(attach_after)
        except asyncio.CancelledError:
            raise  # stop or shutdown: whoever cancelled finalizes the run
        except NotOwner:
            self.task = None
            self._release_reservation()
            await self.abandon()
            return
        except TrainerBusy:
            if run.state is RunState.PENDING and not self.finalizing:
                _LOGGER.info(
                    "run %s: trainer %s is busy; back in the queue",
                    run.id,
                    trainer,
                    extra={"run_id": run.id},
                )
                self._ctx.observer.trainer_failure(run.id, "busy")
                self.task = None
                self._release_reservation()
                self._ctx.scheduler.requeue(self._driver)
                return
            message = self._failed(TrainerBusy("busy after it started the run"), trainer)
        except ContractViolation as exc:
            message = CONTRACT_MESSAGE
            self._ctx.observer.contract_violation(run.id, exc.rule)
            _LOGGER.error(
                "CONTRACT VIOLATION run=%s rule=%s trainer=%s episode=%s field=%s: %s",
                run.id,
                exc.rule,
                trainer,
                exc.episode,
                exc.field,
                exc,
                extra={"run_id": run.id, "rule": exc.rule},
            )
        except TrainerError as exc:
            message = self._failed(exc, trainer)
        except (StoreWriteFailed, StoreUnavailable):
            message = STORE_MESSAGE  # logged where the write failed
        except Exception:
            message = UNEXPECTED_MESSAGE
            _LOGGER.exception(
                "run %s: unexpected failure driving trainer %s",
                run.id,
                trainer,
                extra={"run_id": run.id},
            )
        finally:
            self._release_reservation()
        if self.finalizing:
            return
        self.finalizing = True
        self.task = None
        try:
            await self._flush()
        except StoreWriteFailed:
            message = message or STORE_MESSAGE  # logged where the write failed
        except NotOwner:
            await self.abandon()
            return
        except Exception:
            _LOGGER.exception("run %s: store failure", run.id, extra={"run_id": run.id})
            message = message or UNEXPECTED_MESSAGE
        if message is None:
            run.complete(self._ctx.now())
        else:
            run.fail(message, self._ctx.now())
        await self.finalize()
        gateway_side = message in (CONTRACT_MESSAGE, STORE_MESSAGE, UNEXPECTED_MESSAGE)
        if gateway_side and self._trainer and self.owned:
            # The failure is the gateway's side: the trainer's job would run on for its detach
            # grace, computing for nobody. Only once the end is ours: a replica that lost the
            # run meanwhile (its stream ended because the new owner re-attached) leaves the
            # job to that owner.
            self._ctx.spawn(
                asyncio.create_task(self._cancel_job(), name=f"gateway-cancel-{run.id}")
            )

    def _failed(self, exc: TrainerError, trainer: str) -> str:
        """Looks a trainer failure up in ``FAILURES``: logs it and returns the user message."""
        kind = next((k for k in type(exc).__mro__ if k in FAILURES), TrainerCrashed)
        default, label, line = FAILURES[kind]
        self._ctx.observer.trainer_failure(self.run.id, label)
        _LOGGER.warning("run %s: " + line, self.run.id, trainer, exc, extra={"run_id": self.run.id})
        if default is None:
            assert isinstance(exc, TrainerFailed)
            return exc.user_message
        return default

    async def _cancel_job(self) -> None:
        try:
            await self._ctx.connector.cancel_job(
                self._trainer, self.run.id, self._ctx.config.trainer_call_timeout_s
            )
        except TrainerError as exc:
            _LOGGER.warning(
                "run %s: could not cancel its job on %s (it ends after the trainer's detach "
                "grace): %s",
                self.run.id,
                self._trainer,
                exc,
                extra={"run_id": self.run.id},
            )

    # -- the end -----------------------------------------------------------------------------

    async def finalize(self) -> None:
        """After the final transition: flush, persist, leave the registry, end the watches."""
        self.finalizing = True
        run = self.run
        try:
            await self._flush()
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
            self.log.wake()
            await self.abandon()
            return
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
        self._ctx.on_end(self._driver)
        self.log.close()
        if run.trainer or self._trainer:
            self._ctx.scheduler.run_ended(run.trainer or self._trainer)
        _log_end(run)
