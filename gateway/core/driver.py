"""The per-run driver: one trainer stream, credit grants, pacing, commits and how a run ends.

A ``RunDriver`` owns an active run. This module holds its lifecycle (dispatch, re-attach,
controls, how the run ends); its parts are the trainer feed (``gateway.core.driver_feed``), the
publisher with its grants (``gateway.core.driver_publish``) and the state they share
(``gateway.core.driver_context``). Once the scheduler places the run on a trainer (or the
gateway re-attaches it after a restart) the driver runs two coroutines:

- the *reader* reads the trainer stream, checks every episode against the contract and puts it
  in the run's buffer (``trainer_episode`` is the last one received);
- the *publisher* takes episodes from the buffer at the run's pace (none while paused), hands
  them to the store, and grants the trainer credit.

Invariants:

- ``episode`` (the run's published episode) is the last episode the store has *committed*; an
  episode enters the run's ``EpisodeLog`` (and so reaches watchers) only after its commit, in
  order. Nothing a watcher saw can be lost by a crash.
- ``trainer_episode`` is the last episode received; ``episode <= trainer_episode <= granted``.
- Grants follow commits: ``granted = min(max_episodes, episode + lead)`` whenever that moves it
  forward by at least a quarter of the lead, never while paused. ``lead`` is ``lead_s`` seconds
  of the paced rate x speed, at least ``MIN_LEAD`` episodes; an unpaced run gets a window of
  ``UNPACED_WINDOW`` episodes. Hence ``trainer_episode - episode <= lead`` at all times (the
  lead at the time of the last grant), the trainer stops training when the run is paused, trains
  at the run's pace when it is slow, and never runs further ahead than it holds for a re-attach.
- A stream that breaks (trainer lost, heartbeat timeout) is re-attached after
  ``trainer_episode`` for up to ``heartbeat_timeout_s``; only then does the run fail.
- Stop cancels the stream and the trainer's job (``CancelJob``); gateway shutdown cancels the
  stream only, so the trainer keeps the job for the next gateway to re-attach.
- With gateway replicas (PostgreSQL) a driver drives its run only while its replica owns it:
  a *candidate* (a PENDING run no replica owns, ``owned`` False) claims the run before it
  dispatches it, and any write the store refuses with ``NotOwner`` (another replica took the
  lease over) makes the driver *abandon* the run: it stops driving without cancelling the
  trainer's job (the new owner re-attaches to it) and without writing anything more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from gateway.core.driver_context import DriverContext
from gateway.core.driver_feed import FeedMixin
from gateway.core.driver_publish import PublishMixin
from gateway.core.errors import StoreUnavailable
from gateway.core.history import EpisodeLog
from gateway.core.pacing import Pacer
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
from trainwire.contract import ContractViolation, task_kind
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

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


class RunDriver(FeedMixin, PublishMixin):
    """Drives one active run (see the module docstring).

    Args:
        run: The run (PENDING, or RUNNING/PAUSED when re-attached after a restart).
        ctx: What the registry's drivers share.
    """

    def __init__(self, run: TrainingRun, ctx: DriverContext) -> None:
        self.run = run
        self._ctx = ctx
        self.kind = task_kind(run.task)
        self.log = EpisodeLog(run.id, ctx.config.live_coalesce_s, ctx.clock)
        self.pacer = Pacer(run.episodes_per_second, run.speed, ctx.clock)
        self.task: asyncio.Task[None] | None = None
        self.finalizing = False
        self.pending_detail = "waiting for the scheduler"
        # Set by every control (pause, resume, speed, stop) to wake a waiting publisher.
        self._control = asyncio.Event()
        # Set by every commit of this run's episodes.
        self._committed = asyncio.Event()
        # Set when the reader buffered an episode or ended.
        self._arrived = asyncio.Event()
        # Episodes handed to the store, awaiting commit: (episode, reward, best_reward, frame).
        self._pending: deque[tuple[int, float, float, bytes]] = deque()
        self._commit_error: BaseException | None = None
        # Received and checked, not yet handed to the store.
        self._buffer: deque[episode_pb2.Episode] = deque()
        self._received_best: float | None = run.best_reward if run.episode else None
        self._trainer = run.trainer
        self._reserved = False  # counted by the scheduler as starting on self._trainer
        self._granted = 0
        self._granting = False
        #: Whether this replica owns the run (always, with one gateway); a candidate claims it
        #: before it starts it.
        self.owned = True

    @property
    def seq(self) -> int:
        """The run's creation order (FIFO placement)."""
        return self.run.seq

    @property
    def placeable(self) -> bool:
        """Whether the scheduler may still place the run."""
        return self.run.state is RunState.PENDING and not self.finalizing and self.task is None

    def snapshot(self) -> TrainingRun:
        """A copy of the run with its ``state_detail`` filled in."""
        run = self.run.snapshot()
        run.state_detail = self._detail()
        return run

    def _detail(self) -> str:
        run = self.run
        if run.state is RunState.PENDING:
            return self.pending_detail
        if run.state is RunState.RUNNING:
            return (
                f"training on {self._trainer}: episode {run.trainer_episode} of "
                f"{run.config.max_episodes} trained, granted through {self._granted}"
            )
        if run.state is RunState.PAUSED:
            return (
                f"paused at episode {run.episode}; training holds at episode "
                f"{run.trainer_episode} (granted through {self._granted})"
            )
        return ""

    # -- starting ----------------------------------------------------------------------------

    def dispatch(self, trainer: str) -> None:
        """Starts the run on ``trainer`` (called by the scheduler, which counts it as
        starting there until :meth:`SchedulerHooks.started`)."""
        self._trainer = trainer
        self._reserved = True
        self.pending_detail = f"starting on {trainer}"
        self.task = asyncio.create_task(self._drive(None), name=f"gateway-run-{self.run.id}")

    def reattach(self, frames: list[bytes]) -> None:
        """Continues a RUNNING or PAUSED run after a gateway restart: its committed history
        ``frames`` goes back into the log and the stream re-attaches to the trainer's job."""
        self.log.frames.extend(frames)
        self.run.trainer_episode = max(self.run.trainer_episode, self.run.episode)
        self.task = asyncio.create_task(
            self._drive(self.run.episode), name=f"gateway-run-{self.run.id}"
        )

    # -- controls ----------------------------------------------------------------------------

    async def pause(self) -> None:
        """Pauses publication; the trainer gets no new grant. No-op when paused."""
        if self.run.pause():
            self._control.set()
            self.log.wake()
            await self.persist()
            _LOGGER.info(
                "run %s paused at episode %d (trainer at %d)",
                self.run.id,
                self.run.episode,
                self.run.trainer_episode,
                extra={"run_id": self.run.id, "event": "paused"},
            )

    async def resume(self) -> None:
        """Resumes publication and grants. No-op when running."""
        if self.run.resume():
            self.pacer.restart()
            self._control.set()
            self.log.wake()
            self._maybe_grant()
            await self.persist()
            _LOGGER.info(
                "run %s resumed at episode %d",
                self.run.id,
                self.run.episode,
                extra={"run_id": self.run.id, "event": "resumed"},
            )

    async def set_speed(self, speed: float) -> None:
        """Changes the speed of publication and of the lead, at once."""
        self.run.set_speed(speed)
        self.pacer.set_speed(self.run.speed)
        self._control.set()
        self._maybe_grant()
        await self.persist()
        _LOGGER.info(
            "run %s speed %g",
            self.run.id,
            self.run.speed,
            extra={"run_id": self.run.id, "event": "speed"},
        )

    async def stop(self) -> None:
        """Stops the run: cancels its stream, ends it STOPPED and, once that end is stored as
        this replica's, cancels its trainer job.

        Raises:
            NotOwner: another replica took the run over before the end was stored; the stop is
                that replica's to apply, and the job is left to it.
        """
        self.run.stop(self._ctx.now())
        self.finalizing = True
        self._ctx.scheduler.dequeue(self)
        dispatched = self.task is not None
        await self._cancel_task()
        await self.finalize()
        if not self.owned:
            raise NotOwner(self.run.id)
        if dispatched and self._trainer:
            self._ctx.spawn(
                asyncio.create_task(self._cancel_job(), name=f"gateway-cancel-{self.run.id}")
            )

    async def detach(self) -> None:
        """Gateway shutdown: cancels the stream but not the trainer's job (the next gateway
        re-attaches), flushes the commits and stores the run as it is."""
        self.finalizing = True
        await self._cancel_task()
        try:
            await self._flush()
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store",
                self.run.id,
                extra={"run_id": self.run.id},
            )
        await self.persist()
        self.log.close()

    async def abandon(self) -> None:
        """Another replica owns the run now: stops driving it, leaving the trainer's job and
        the store alone (the new owner re-attaches and writes), and leaves the registry."""
        if not self.owned and self.finalizing:
            return  # abandoned already
        self.finalizing = True
        self.owned = False
        self._ctx.scheduler.dequeue(self)
        await self._cancel_task()
        if self._ctx.on_lost is not None:
            self._ctx.on_lost(self)

    async def _cancel_task(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._release_reservation()

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

    async def persist(self) -> None:
        """Stores the run's state, speed, times and trainer.

        Raises:
            StoreUnavailable: the store cannot be written (the change holds in memory, and a
                finished run's final state is written once the store can be again).
        """
        self._ctx.observer.run_state_changed(self.run.id, self.run.state.name)
        snapshot = self.run.snapshot()
        try:
            await self._ctx.store.update_run(snapshot)
        except StoreWriteFailed:
            if snapshot.state.finished:
                self._ctx.unsaved(snapshot)
            raise StoreUnavailable(f"run {self.run.id!r}: {STORE_MESSAGE}", self.run.id) from None

    # -- driving -----------------------------------------------------------------------------

    async def _drive(self, attach_after: int | None) -> None:
        """Runs the trainer stream to its end and records how the run ended."""
        run = self.run
        trainer = self._trainer
        message: str | None = None
        try:
            if not self.owned:
                assert self._ctx.claim is not None
                if not await self._ctx.claim(self):
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
                self._ctx.scheduler.requeue(self)
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

    def _release_reservation(self) -> None:
        if self._reserved:
            self._reserved = False
            self._ctx.scheduler.started(self._trainer)

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
        self._ctx.on_end(self)
        self.log.close()
        if run.trainer or self._trainer:
            self._ctx.scheduler.run_ended(run.trainer or self._trainer)
        _log_end(run)
