"""The per-run driver: one trainer stream, credit grants, pacing, commits and how a run ends.

A ``RunDriver`` owns an active run. Once the scheduler places the run on a trainer (or the
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
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.core.errors import StoreUnavailable
from gateway.core.history import EpisodeLog, encode_frame
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    LOST_MESSAGE,
    UNEXPECTED_MESSAGE,
    RunState,
    TrainingRun,
)
from gateway.core.store import STORE_MESSAGE, EpisodeRecord, NotOwner, Store, StoreWriteFailed
from gateway.core.trainers import (
    TrainerBusy,
    TrainerConnector,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
    TrainerStream,
)
from trainwire.contract import ContractViolation, StreamChecker, task_kind
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Episodes a run may have handed to the store but not yet seen committed; the publisher waits
#: beyond this.
MAX_UNCOMMITTED = 256
#: The smallest lead a paced run is granted, in episodes.
MIN_LEAD = 4
#: The credit window of an unpaced run, in episodes (far below what a trainer holds for a
#: re-attach, 1024 by default).
UNPACED_WINDOW = 256
#: Seconds between two attempts to re-attach a broken stream.
REATTACH_BACKOFF_S = 0.25

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

    config: GatewayConfig
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


class RunDriver:
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
        """Stops the run: cancels its stream and its trainer job, ends it STOPPED."""
        self.run.stop(self._ctx.now())
        self.finalizing = True
        self._ctx.scheduler.dequeue(self)
        dispatched = self.task is not None
        await self._cancel_task()
        if dispatched and self._trainer:
            self._ctx.spawn(
                asyncio.create_task(self._cancel_job(), name=f"gateway-cancel-{self.run.id}")
            )
        await self.finalize()

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
        if message in (CONTRACT_MESSAGE, STORE_MESSAGE, UNEXPECTED_MESSAGE) and self._trainer:
            # The failure is the gateway's side: the trainer's job would run on for its detach
            # grace, computing for nobody.
            self._ctx.spawn(
                asyncio.create_task(self._cancel_job(), name=f"gateway-cancel-{run.id}")
            )
        if message is None:
            run.complete(self._ctx.now())
        else:
            run.fail(message, self._ctx.now())
        await self.finalize()

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

    async def _stream(self, attach_after: int | None) -> None:
        """Streams from the trainer until the done episode is published; re-attaches a broken
        stream (see the module docstring).

        Raises:
            TrainerError, ContractViolation: how the run fails.
        """
        loop_deadline: float | None = None
        lost = ""  # why the stream broke
        after = attach_after
        while True:
            try:
                await self._stream_once(after)
                return
            except TrainerJobGone as exc:
                if loop_deadline is None:
                    raise  # a restarted gateway's re-attach: the run was interrupted
                # The stream broke and the trainer no longer has the job: it was lost.
                raise TrainerLost(f"{lost}; then {exc}") from None
            except TrainerJobExists as exc:
                if after is not None:
                    # A re-attach (a takeover from another replica, or a restart) that came
                    # before the trainer saw the previous stream break: tried again below,
                    # within the heartbeat timeout.
                    now = self._ctx.clock()
                    if loop_deadline is None:
                        loop_deadline = now + self._ctx.config.heartbeat_timeout_s
                        lost = str(exc)
                    elif now >= loop_deadline:
                        raise
                    await asyncio.sleep(REATTACH_BACKOFF_S)
                    continue
                # A job a previous gateway started before it crashed: take it over.
                _LOGGER.info(
                    "run %s: trainer %s already runs its job; re-attaching",
                    self.run.id,
                    self._trainer,
                    extra={"run_id": self.run.id},
                )
                after = self.run.trainer_episode
            except TrainerLost as exc:
                if self.run.state is RunState.PENDING and after is None:
                    raise  # never started: nothing to re-attach to
                now = self._ctx.clock()
                if loop_deadline is None:
                    loop_deadline = now + self._ctx.config.heartbeat_timeout_s
                    lost = str(exc)
                    _LOGGER.warning(
                        "run %s: stream from trainer %s broke (%s); re-attaching",
                        self.run.id,
                        self._trainer,
                        exc,
                        extra={"run_id": self.run.id},
                    )
                elif now >= loop_deadline:
                    raise
                after = self.run.trainer_episode
                await asyncio.sleep(REATTACH_BACKOFF_S)

    async def _stream_once(self, after: int | None) -> None:
        run = self.run
        checker = StreamChecker.for_task(run.task, run.config, run.id)
        if after:
            checker.resume(after, self._received_best)
            # Episodes received but not published stay buffered; a re-attach resumes after them.
        grant = self._grant_target() if not self._granting else self._granted
        stream = self._ctx.connector.train(
            self._trainer, run.id, run.task, run.config, grant, after
        )
        self._granted = max(self._granted, grant)
        reader = asyncio.create_task(self._read(stream, checker), name=f"gateway-read-{run.id}")
        reader.add_done_callback(lambda _: self._arrived.set())
        try:
            await self._publish_loop(reader)
        finally:
            reader.cancel()
            stream.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, stream: TrainerStream, checker: StreamChecker) -> None:
        """The reader (see the module docstring)."""
        run = self.run
        timeout = self._ctx.config.heartbeat_timeout_s
        events = stream.__aiter__()
        cap = 2 * self._lead() + MAX_UNCOMMITTED
        while True:
            while len(self._buffer) >= cap:
                # Only a trainer that ignores its grants gets here: stop reading (HTTP/2 flow
                # control then holds it) until the publisher caught up.
                self._committed.clear()
                await self._committed.wait()
            try:
                async with asyncio.timeout(timeout):
                    event = await events.__anext__()
            except StopAsyncIteration:
                checker.finish()
                return
            except TimeoutError:
                raise TrainerLost(
                    f"no episode or heartbeat from {self._trainer} for {timeout:g} s"
                ) from None
            self._release_reservation()
            if run.state is RunState.PENDING:
                run.start(self._trainer, self._ctx.now())
                await self.persist()
                _LOGGER.info(
                    "run %s started on trainer %s",
                    run.id,
                    self._trainer,
                    extra={"run_id": run.id, "event": "started"},
                )
            if event is None:
                self._ctx.observer.heartbeat_received(run.id)
                continue
            self._ctx.observer.episode_received(run.id)
            checker.check(event)
            if event.done:
                # Rule 3: nothing may follow the done episode. The trainer closes its stream
                # right after it, so confirming that costs one read, and a bad stream never
                # gets to publish a done episode.
                await self._expect_end(events, checker)
            run.trainer_episode = event.episode
            self._received_best = event.best_reward
            self._buffer.append(event)
            self._arrived.set()
            if event.done:
                return

    async def _expect_end(
        self, events: AsyncIterator[episode_pb2.Episode | None], checker: StreamChecker
    ) -> None:
        """Reads the stream after the done episode to its end (heartbeats are tolerated).

        Raises:
            ContractViolation: an episode followed the done episode.
        """
        run_id = self.run.id
        try:
            async with asyncio.timeout(self._ctx.config.heartbeat_timeout_s):
                while True:
                    event = await events.__anext__()
                    if event is not None:
                        checker.check(event)  # raises: rule "done"
        except StopAsyncIteration:
            return
        except TimeoutError:
            _LOGGER.warning(
                "run %s: trainer %s kept the stream open after done",
                run_id,
                self._trainer,
                extra={"run_id": run_id},
            )
        except TrainerError as exc:  # the episodes are complete; the trainer's end is not ours
            _LOGGER.warning(
                "run %s: trainer %s failed after done: %s",
                run_id,
                self._trainer,
                exc,
                extra={"run_id": run_id},
            )

    async def _publish_loop(self, reader: asyncio.Task[None]) -> None:
        """The publisher (see the module docstring); returns once the done episode is handed
        to the store. Raises what the reader raised."""
        while True:
            while not self._buffer:
                if reader.done():
                    reader.result()  # raises the reader's failure
                    if self._buffer:
                        break
                    return  # ended without done: the reader's checker already raised
                self._arrived.clear()
                await self._arrived.wait()  # set by the reader: an episode, or its end
            await self._until_publishable()
            episode = self._buffer.popleft()
            self._publish(episode)
            if episode.done:
                return

    async def _until_publishable(self) -> None:
        """Waits while the run is paused, then for its pace."""
        run = self.run
        while True:
            if self._commit_error is not None:
                raise self._commit_error
            if run.state is RunState.PAUSED:
                self._control.clear()
                await self._control.wait()
                continue
            if len(self._pending) >= MAX_UNCOMMITTED:
                self._committed.clear()
                await self._committed.wait()
                continue
            delay = self.pacer.delay()
            if delay <= 0:
                return
            self._control.clear()
            try:
                async with asyncio.timeout(delay):
                    await self._control.wait()
            except TimeoutError:
                pass

    def _publish(self, episode: episode_pb2.Episode) -> None:
        """Hands an episode to the store; it becomes visible when committed."""
        # Deterministic: map entries (metrics) in key order, so the stored bytes are canonical
        # and a watcher can compare what it got with any replay byte for byte.
        data = episode.SerializeToString(deterministic=True)
        n = episode.episode
        self._pending.append((n, episode.reward, episode.best_reward, encode_frame(data)))
        self.pacer.published()
        record = EpisodeRecord(self.run.id, n, episode.reward, episode.best_reward, data)
        self._ctx.store.append_episode(record, self._on_commit)

    def _on_commit(self, error: BaseException | None) -> None:
        self._committed.set()
        if error is not None:
            if self._commit_error is None and not isinstance(error, NotOwner):
                _LOGGER.error(
                    "run %s: storing episode %d failed: %s",
                    self.run.id,
                    self._pending[0][0] if self._pending else 0,
                    error,
                    extra={"run_id": self.run.id},
                )
            self._commit_error = error
            self._control.set()
            return
        n, reward, best, frame = self._pending.popleft()
        self.run.record_episode(n, reward, best)
        self.log.publish((frame,))
        self._ctx.observer.episodes_published(self.run.id, 1)
        self._maybe_grant()

    async def _flush(self) -> None:
        """Waits until every episode handed to the store is committed (and visible)."""
        while self._pending:
            if self._commit_error is not None:
                raise self._commit_error
            self._committed.clear()
            await self._committed.wait()

    # -- grants ------------------------------------------------------------------------------

    def _lead(self) -> int:
        """The credit the trainer may hold beyond the published episode."""
        if not self.pacer.paced:
            return UNPACED_WINDOW
        rate = self.run.episodes_per_second * self.run.speed
        return max(MIN_LEAD, math.ceil(self._ctx.config.lead_s * rate))

    def _grant_target(self) -> int:
        """How far the trainer may train now (the current grant while paused)."""
        if self.run.state is RunState.PAUSED:
            return self._granted
        return min(self.run.config.max_episodes, self.run.episode + self._lead())

    def _maybe_grant(self) -> None:
        """Sends a grant when it moves the trainer's credit forward by a quarter lead (or to
        the end); at most one grant is in flight."""
        if self._granting or self.finalizing or self.task is None:
            return
        if self.run.state is not RunState.RUNNING:
            return
        target = self._grant_target()
        step = max(1, self._lead() // 4)
        if target - self._granted < step and target < self.run.config.max_episodes:
            return
        if target <= self._granted:
            return
        self._granting = True
        self._ctx.spawn(
            asyncio.create_task(self._send_grant(target), name=f"gateway-grant-{self.run.id}")
        )

    async def _send_grant(self, target: int) -> None:
        try:
            await self._ctx.connector.grant(
                self._trainer, self.run.id, target, self._ctx.config.trainer_call_timeout_s
            )
            self._granted = max(self._granted, target)
        except TrainerError as exc:
            # The stream tells whether the trainer is gone; the next commit grants again.
            _LOGGER.debug(
                "run %s: grant through %d failed: %s",
                self.run.id,
                target,
                exc,
                extra={"run_id": self.run.id},
            )
        finally:
            self._granting = False
        self._maybe_grant()

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
