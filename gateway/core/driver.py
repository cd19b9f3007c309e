"""The per-run driver: one trainer stream, credit grants, pacing, commits and how a run ends.

A ``RunDriver`` owns an active run. This module holds its state and lifecycle (dispatch,
re-attach, controls, persisting the run); its parts are the trainer feed
(``gateway.core.driver_feed``), the publisher with its grants (``gateway.core.driver_publish``),
how the run ends (``gateway.core.driver_end``: the stream driven to its end, its failure mapped
to the run's end, finalize) and the state they share (``gateway.core.driver_context``). Once the
scheduler places the run on a trainer (or the gateway re-attaches it after a restart) the driver
runs two coroutines:

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
from gateway.core.driver_end import EndMixin
from gateway.core.driver_feed import FeedMixin
from gateway.core.driver_publish import PublishMixin
from gateway.core.errors import StoreUnavailable
from gateway.core.history import EpisodeLog
from gateway.core.pacing import Pacer
from gateway.core.runs import RunState, TrainingRun
from gateway.core.store import STORE_MESSAGE, NotOwner, StoreWriteFailed
from trainwire.contract import task_kind
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)


class RunDriver(FeedMixin, PublishMixin, EndMixin):
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

    def _release_reservation(self) -> None:
        if self._reserved:
            self._reserved = False
            self._ctx.scheduler.started(self._trainer)
