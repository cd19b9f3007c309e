"""The per-run driver: the thin shell around one active run's lifecycle.

A ``RunDriver`` owns an active run. Its lifecycle is the pure state machine of
``gateway.core.lifecycle``: every control, answer, timer and stream end becomes an event, and the
driver carries out the commands ``step`` returns, in order. Around it:

- a ``JobAttempt`` (``gateway.core.attempt``) per placement: its trainers, reservations, stream
  task and shares, let go in one way or another when the placement ends;
- the ``TrainerFeed`` (``gateway.core.feed``) streams the job into the ``Publisher``
  (``gateway.core.publisher``: the queue to the store at the run's pace, visible once committed);
- ``Grants`` (``gateway.core.granting``) give the trainer credit as episodes commit;
- the ``RestartPolicy`` (``gateway.core.restarts``) decides what a failed job leads to, and the
  ``CheckpointLedger`` (``gateway.core.ledger``) records checkpoints and finds resume points.

Invariants:

- ``episode`` (published) is the last episode the store has committed; nothing a watcher saw
  can be lost by a crash; ``episode <= trainer_episode <= granted``.
- A broken stream is re-attached by the feed for up to ``heartbeat_timeout_s``; only then does
  the job fail. Episodes received and not yet published stay in the driver's inbox across
  parks, restarts and re-attaches; a new job trains again the episodes after its checkpoint and
  the feed drops those the run received, so watchers see every episode once.
- Stop cancels the stream, stores the end, then cancels the job after its final checkpoint (the
  trained model). Gateway shutdown and a run taken over by another replica leave the trainers
  their jobs. Whenever a job ends every share that did not end is cancelled and every trainer's
  slots are reported free.
- With gateway replicas a driver drives its run only while its replica owns it: a candidate
  (``owned`` False) claims the run before its job starts, and a write the store refuses with
  ``NotOwner`` makes the driver abandon the run without touching the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core import lifecycle as lc
from gateway.core.attempt import JobAttempt, SlotHooks
from gateway.core.checkpoints import CheckpointFiles
from gateway.core.curve import CurveBuilder
from gateway.core.details import DetailRetention
from gateway.core.ending import Ending, end_of, log_end
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    StoreUnavailable,
    TrainerUnavailable,
)
from gateway.core.feed import Inbox, TrainerFeed
from gateway.core.forks import ForkNotRestored
from gateway.core.granting import Grants
from gateway.core.hyperparameters import applied_to, check_change, has_reference_model
from gateway.core.ledger import CheckpointLedger
from gateway.core.lifecycle import Command as C
from gateway.core.live_log import EpisodeLog
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.placement import Placement, rewards_needed, slots_needed
from gateway.core.publisher import MAX_UNCOMMITTED, Publisher
from gateway.core.restarts import Action, Decision, RestartPolicy
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.shares import JobShares, SharesNotReattached
from gateway.core.store import STORE_MESSAGE, NotOwner, Store, StoreWriteFailed
from gateway.core.trainers import (
    CheckpointFailed,
    CheckpointSaved,
    Rendezvous,
    Resumed,
    ResumePoint,
    TrainerBusy,
    TrainerConnector,
    TrainerError,
    TrainerJobFinished,
    TrainerRefused,
)
from trainwire.contract import ContractViolation, task_kind
from trainwire.hyperparameters import Hyperparameters

_LOGGER = logging.getLogger(__name__)


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


class DriverOwnership(Protocol):
    """What a driver asks of its replica's ownership of runs."""

    async def claim(self, driver: RunDriver) -> bool:
        """Claims a candidate's run before it starts; False when another replica has it."""
        ...

    def lost(self, driver: RunDriver) -> None:
        """The driver abandoned its run to another replica (it leaves the active runs)."""
        ...


@dataclass(frozen=True)
class DriverContext:
    """What every driver of a registry shares."""

    settings: CoreSettings
    store: Store
    connector: TrainerConnector
    observer: Observer
    scheduler: SchedulerHooks
    ownership: DriverOwnership
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


class RunDriver:
    """Drives one active run (see the module docstring).

    Args:
        run: The run (PENDING, or RUNNING/PAUSED when re-attached after a restart).
        ctx: What the registry's drivers share.
        owned: Whether this replica owns the run (always, with one gateway); a candidate's
            ownership claims it before it starts.
    """

    def __init__(self, run: TrainingRun, ctx: DriverContext, owned: bool = True) -> None:
        self.run = run
        self._ctx = ctx
        self.kind = task_kind(run.task)
        settings = ctx.settings
        self.log = EpisodeLog(
            run.id, settings.live_coalesce_s, ctx.clock, settings.live_episodes, run.fork_episode
        )
        self.pacer = Pacer(run.episodes_per_second, run.speed, ctx.clock)
        self.grants = Grants(run, self.pacer, settings, ctx.connector, ctx.spawn, self._granting)
        self.publisher = Publisher(
            run, self.log, self.pacer, ctx.store, ctx.observer, self.grants.maybe
        )
        self.publisher.details = DetailRetention(
            run,
            self.kind,
            ctx.store,
            ctx.spawn,
            ctx.forget_pages,
            settings.live_episodes,
            settings.details_per_run,
        )
        self.inbox = Inbox()
        #: Where its job stands (``gateway.core.lifecycle``), and the events that led there.
        self.state: lc.State = lc.Pending()
        self.history: list[lc.Event] = []
        #: The current (or last) placement of its job.
        self.attempt: JobAttempt | None = None
        self.pending_detail = "waiting for the scheduler"
        self.owned = owned
        self._trainer = run.trainer  # rank 0's
        self._ended = asyncio.Event()  # let go: finalized, detached or abandoned
        #: The run's checkpoint records, retention and the note people read about them.
        self.ledger = CheckpointLedger(run, ctx.store, ctx.checkpoint_files, ctx.spawn)
        self._park_timer: asyncio.TimerHandle | None = None
        self._restarts = RestartPolicy(settings.max_restarts)
        #: The failure that ended the last job, its decision and the resume points it had.
        self._failure: BaseException | None = None
        self._decision: Decision | None = None
        self._points: list[ResumePoint] = []

    @property
    def seq(self) -> int:
        """The run's creation order (FIFO placement)."""
        return self.run.seq

    @property
    def placeable(self) -> bool:
        """Whether the scheduler may place the run now."""
        return lc.queued(self.state)

    @property
    def finalizing(self) -> bool:
        """Whether its end is decided (or the driver let it go)."""
        return lc.over(self.state)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The current job's stream task (None: no job is being read)."""
        return None if self.attempt is None else self.attempt.task

    @property
    def slots(self) -> int:
        """Trainer slots its job takes."""
        return slots_needed(self.run.task)

    @property
    def rewards(self) -> tuple[str, ...]:
        """Reward functions its trainers must offer beyond the built-in ones."""
        return rewards_needed(self.run.task)

    @property
    def trainer(self) -> str:
        """The trainer it was placed on, rank 0's ("" before)."""
        return self._trainer

    def _where(self) -> str:
        return self.attempt.describe() if self.attempt is not None else self._trainer

    def _addresses(self) -> tuple[str, ...]:
        """Every trainer of its job (or of its last one), rank 0's first."""
        if self.attempt is not None and self.attempt.placement is not None:
            return self.attempt.addresses()
        return self.run.trainers or ((self._trainer,) if self._trainer else ())

    def _granting(self) -> str:
        """Rank 0's trainer while its job may take grants, else ""."""
        return "" if self.finalizing or self.task is None else self._trainer

    async def ended(self) -> None:
        """Returns once the driver let its run go: its end stored (or refused by a full
        disk), the gateway shut down, or the run handed to another replica."""
        await self._ended.wait()

    def snapshot(self) -> TrainingRun:
        """A copy of the run with its ``state_detail`` filled in."""
        run = self.run.snapshot()
        run.state_detail = self._detail()
        return run

    def _detail(self) -> str:
        run, state = self.run, self.state
        note = f"; {self.ledger.note}" if self.ledger.note else ""
        if run.state is RunState.PENDING:
            return self.pending_detail
        if lc.parked(state) and run.state is RunState.PAUSED:
            return (
                f"parked at episode {run.episode}: its training state is in the checkpoint "
                f"at episode {run.checkpoint_episode} and its trainer slot is free; resume "
                f"places it again{note}"
            )
        if isinstance(state, lc.Restarting) or (isinstance(state, lc.Placing) and state.again):
            return (
                f"{self.pending_detail}, to continue from its latest checkpoint "
                f"(episode {run.checkpoint_episode or run.fork_episode}){note}"
            )
        granted = self.grants.window.granted
        if run.state is RunState.RUNNING:
            return (
                f"training on {self._where()}: episode {run.trainer_episode} of "
                f"{run.config.max_episodes} trained, granted through {granted}{note}"
            )
        if run.state is RunState.PAUSED:
            return (
                f"paused at episode {run.episode}; training holds at episode "
                f"{run.trainer_episode} (granted through {granted}){note}"
            )
        return ""

    # -- the state machine's shell -------------------------------------------------------------

    def _transition(self, event: lc.Event) -> lc.Commands:
        before = self.state
        self.state, commands = lc.step(before, event)
        if commands or self.state != before:
            self.history.append(event)
        return commands

    async def _apply(self, event: lc.Event) -> None:
        """Steps the machine and carries out its commands; stops carrying them out once a
        command let the run go to another replica or the gateway's shutdown."""
        for command in self._transition(event):
            await self._carry_out(command)
            let_go = isinstance(self.state, lc.Ended) and self.state.exit is not lc.Exit.FINISHED
            if let_go and command not in (C.KEEP_JOB, C.RELEASE, C.DEQUEUE, C.DISARM_PARK):
                return

    def _apply_now(self, event: lc.Event) -> None:
        """Steps the machine from a caller that cannot wait (its commands are all immediate)."""
        for command in self._transition(event):
            done = self._carry_out_now(command)
            assert done, f"{command} is not immediate"

    async def _carry_out(self, command: C) -> None:
        if self._carry_out_now(command):
            return
        attempt = self.attempt
        if command is C.PERSIST:
            await self.persist()
        elif command is C.CANCEL_STREAM:
            if attempt is not None:
                attempt.quiet()
                await attempt.cancel_stream()
        elif command is C.KEEP_JOB:
            if attempt is not None:
                await attempt.keep()
        elif command is C.FINISH:
            await self._finish()
        elif command is C.LEAVE:
            await self._leave()
        else:  # pragma: no cover - every command is carried out above or in _carry_out_now
            raise AssertionError(command)

    def _carry_out_now(self, command: C) -> bool:
        """Carries out an immediate command; False for one that must be awaited."""
        ctx, run, attempt = self._ctx, self.run, self.attempt
        if command is C.START_JOB or command is C.ATTACH_JOB:
            assert attempt is not None
            attach_after = run.episode if command is C.ATTACH_JOB else None
            attempt.task = asyncio.create_task(
                self._drive(attempt, attach_after), name=f"gateway-run-{run.id}"
            )
        elif command is C.REQUEUE:
            if isinstance(self.state, lc.Restarting):
                self.pending_detail = lc.WAITING_AGAIN
            ctx.scheduler.requeue(self)
        elif command is C.DEQUEUE:
            ctx.scheduler.dequeue(self)
        elif command is C.ARM_PARK:
            self._arm_park()
        elif command is C.DISARM_PARK:
            self._disarm_park()
        elif command is C.PARK:
            ctx.spawn(self._park(), f"gateway-park-{run.id}")
        elif command is C.MARK_STARTED:
            run.start(self._trainer, ctx.now(), self._addresses())
            self._log_placed("started on")
        elif command is C.MARK_PLACED:
            run.parked = False
            run.trainer, run.trainers = self._trainer, self._addresses()
            self._log_placed("continues on")
        elif command is C.MARK_PARKED:
            run.parked = True
            _LOGGER.info(
                "run %s parked at episode %d (trained through %d, checkpoint at %d); trainer "
                "slots on %s freed",
                run.id,
                run.episode,
                run.trainer_episode,
                run.checkpoint_episode,
                ", ".join(self._addresses()),
                extra={"run_id": run.id, "event": "parked"},
            )
        elif command is C.COUNT_RESTART:
            self._count_restart()
        elif command is C.SLOT_FREED:
            ctx.scheduler.run_ended(self._trainer)
        elif command is C.CANCEL_JOB:
            if attempt is not None and attempt.trainer and self.owned:
                ctx.spawn(attempt.cancel_job(), f"gateway-cancel-{run.id}")
        elif command is C.CANCEL_JOB_CHECKPOINT:
            if attempt is not None:
                ctx.spawn(self._cancel_for_stop(attempt), f"gateway-cancel-{run.id}")
        elif command is C.CANCEL_SHARES:
            if attempt is not None and attempt.shares is not None:
                ctx.spawn(attempt.cancel_shares(), f"gateway-cancel-shares-{run.id}")
        elif command is C.GRANT:
            self.grants.maybe()
        elif command is C.RELEASE:
            ctx.ownership.lost(self)
            self._ended.set()
        else:
            return False
        return True

    def _log_placed(self, how: str) -> None:
        trainers = "trainers" if len(self._addresses()) > 1 else "trainer"
        event = "started" if how == "started on" else "placed_again"
        _LOGGER.info(
            "run %s %s %s %s",
            self.run.id,
            how,
            trainers,
            self._where(),
            extra={"run_id": self.run.id, "event": event},
        )

    # -- starting ----------------------------------------------------------------------------

    def _new_attempt(self, trainer: str, placement: Placement | None) -> JobAttempt:
        ctx = self._ctx
        slots = SlotHooks(ctx.scheduler.started, ctx.scheduler.run_ended)
        return JobAttempt(self.run.id, trainer, placement, ctx.connector, ctx.settings, slots)

    def dispatch(self, placement: Placement) -> None:
        """Starts the run on the trainers of ``placement`` (called by the scheduler, which
        counts each share's slots as starting there until :meth:`SchedulerHooks.started`)."""
        self._trainer = placement.rank0.address
        self.attempt = self._new_attempt(self._trainer, placement)
        self.pending_detail = f"starting on {placement.describe()}"
        self._apply_now(lc.Dispatch(placement.describe()))

    def reattach(self, frames: list[bytes], curve: CurveBuilder) -> None:
        """Continues a RUNNING or PAUSED run after a gateway restart: the live tail of its
        committed history (``frames``) goes back into the log, its curve's open blocks into the
        publisher, and the stream re-attaches to the trainer's job (a parked run has none:
        resume places it again). What a previous gateway received and did not publish is gone
        with it. A job that spans trainers is not re-attached: the other trainers' shares
        stream no episodes to re-attach after, so every share is cancelled and the run is
        restarted from its newest checkpoint (or ends ERROR without one)."""
        run = self.run
        self.log.restore(run.episode, frames)
        self.publisher.curve = curve
        run.trainer_episode = run.episode
        if not run.parked:
            self.attempt = self._new_attempt(run.trainer, None)
        paused = run.state is RunState.PAUSED
        self._apply_now(lc.Reattach(run.trainer, paused, run.parked))

    async def finalize(self) -> None:
        """Stores the end of a run that recovery found finished (or could not continue) and
        lets it go."""
        done = self.run.state is RunState.DONE
        await self._apply(lc.Recovered(lc.Outcome.DONE if done else lc.Outcome.FAILED))

    # -- controls ----------------------------------------------------------------------------

    def _controlled(self) -> None:
        self.publisher.controlled()
        self.log.wake()

    async def pause(self) -> None:
        """Pauses publication; the trainer gets no new grant. No-op when paused."""
        if self.run.pause():
            self._controlled()
            await self._apply(lc.Pause())
            self._log_control("paused at episode %d (trainer at %d)", "paused")

    async def resume(self) -> None:
        """Resumes publication and grants (a parked run is placed again). No-op when running."""
        if self.run.resume():
            self.pacer.restart()
            self._controlled()
            await self._apply(lc.Resume())
            self._log_control("resumed at episode %d", "resumed")

    def _log_control(self, what: str, event: str) -> None:
        run = self.run
        args = (run.episode, run.trainer_episode)[: what.count("%d")]
        _LOGGER.info("run %s " + what, run.id, *args, extra={"run_id": run.id, "event": event})

    async def set_speed(self, speed: float) -> None:
        """Changes the speed of publication and of the lead, at once."""
        self.run.set_speed(speed)
        self.pacer.set_speed(self.run.speed)
        self.publisher.controlled()
        self.grants.maybe()
        await self.persist()
        _LOGGER.info(
            "run %s speed %g",
            self.run.id,
            self.run.speed,
            extra={"run_id": self.run.id, "event": "speed"},
        )

    async def set_hyperparameters(self, change: Hyperparameters) -> None:
        """Changes the run's hyperparameters from its job's next optimizer step and writes them
        into its task; a run without a job (parked, or waiting to be placed again) takes them
        in its task only, and the job placed next trains with them.

        Raises:
            InvalidRequest: a value the run's kind does not have or its job cannot take.
            IllegalTransition: the run is not RUNNING or PAUSED, or its job trained its last
                episode.
            TrainerUnavailable: its trainer could not be reached (or its job is starting).
        """
        run, state = self.run, self.state
        check_change(change, run.id, run.task, reference_model=True)
        if run.state not in (RunState.RUNNING, RunState.PAUSED) or lc.over(state):
            raise IllegalTransition(
                f"cannot change the hyperparameters of run {run.id!r}: it is {run.state.name}",
                run.id,
            )
        if run.trainer_episode >= run.config.max_episodes:
            raise IllegalTransition(
                f"cannot change the hyperparameters of run {run.id!r}: its trainer has trained "
                f"its last episode ({run.trainer_episode})",
                run.id,
            )
        if not isinstance(state, (lc.Running, lc.Placing)) or lc.parked(state):
            # No job to tell: the next one starts from the task.
            check_change(change, run.id, run.task, has_reference_model(run.task))
        elif isinstance(state, lc.Placing):
            raise TrainerUnavailable(
                f"run {run.id!r} is being placed on a trainer again; try again in a moment",
                run.id,
            )
        else:
            await self._tell_job(change)
        run.task = applied_to(change, run.task)
        await self.persist()
        _LOGGER.info(
            "run %s: hyperparameters %s (episode %d published, %d trained)",
            run.id,
            change.describe(),
            run.episode,
            run.trainer_episode,
            extra={"run_id": run.id, "event": "hyperparameters"},
        )

    async def _tell_job(self, change: Hyperparameters) -> None:
        run, what = self.run, f"cannot change the hyperparameters of run {self.run.id!r}"
        try:
            await self._ctx.connector.set_hyperparameters(
                self._trainer, run.id, change, self._ctx.settings.trainer_call_timeout_s
            )
        except TrainerRefused as exc:
            raise InvalidRequest(f"{what}: {exc.user_message}", exc.violations, run.id) from None
        except TrainerJobFinished:
            raise IllegalTransition(
                f"{what}: its trainer has trained its last episode", run.id
            ) from None
        except TrainerError as exc:
            raise TrainerUnavailable(
                f"run {run.id!r}: its trainer {self._trainer} did not take the new "
                f"hyperparameters ({exc}); try again",
                run.id,
            ) from None

    def take_speed(self, speed: float) -> None:
        """Takes the speed another replica stored while this one had the run as a candidate."""
        self.run.speed = speed
        self.pacer.set_speed(speed)

    async def stop(self) -> None:
        """Stops the run: cancels its stream, ends it STOPPED and, once that end is stored as
        this replica's, cancels its trainer job after its final checkpoint.

        Raises:
            IllegalTransition: the run is finishing already (done or failed).
            NotOwner: another replica took the run over before the end was stored; the stop is
                that replica's to apply, and the job is left to it.
        """
        if isinstance(self.state, lc.Finishing):
            raise IllegalTransition(
                f"cannot stop run {self.run.id!r}: it is ending ({self.state.outcome.value})",
                self.run.id,
            )
        self.run.stop(self._ctx.now())
        await self._apply(lc.Stop())
        if not self.owned:
            raise NotOwner(self.run.id)

    async def _cancel_for_stop(self, attempt: JobAttempt) -> None:
        """After a stop: the job's final checkpoint is the trained model, recorded once rank
        0's trainer wrote it; the other trainers' shares are cancelled after it. A replica
        that lost the run meanwhile leaves the job to the new owner."""
        if not self.owned:
            await attempt.keep()
            return
        try:
            outcome = await attempt.cancel_job(checkpoint=True)
            if outcome is not None and outcome.checkpoint is not None:
                with contextlib.suppress(NotOwner):  # the new owner records what it sees
                    await self.checkpoint_saved(outcome.checkpoint)
        finally:
            await attempt.cancel_shares()

    async def detach(self) -> None:
        """Gateway shutdown: cancels the stream but not the trainer's job (the next gateway
        re-attaches), flushes the commits and stores the run as it is."""
        await self._apply(lc.Detach())

    async def _leave(self) -> None:
        try:
            await self.publisher.flush()
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store",
                self.run.id,
                extra={"run_id": self.run.id},
            )
        try:
            await self.persist()
        finally:
            self.log.close()
            self._ended.set()

    async def abandon(self) -> None:
        """Another replica owns the run now: stops driving it, leaving the trainer's job and
        the store alone (the new owner re-attaches and writes), and leaves the active runs."""
        if isinstance(self.state, lc.Ended):
            return
        self.owned = False
        await self._apply(lc.Abandon())

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

    # -- the feed's hooks --------------------------------------------------------------------

    async def answered(self) -> None:
        """Rank 0's trainer answered (every message): its reservation ends; the first answer
        starts a PENDING run, or a run placed again on its new trainers."""
        attempt = self.attempt
        if attempt is not None:
            attempt.release(self._trainer)
            if attempt.shares is not None:
                attempt.shares.rank0_answered()
        if isinstance(self.state, lc.Placing):
            await self._apply(lc.Answered())

    async def checkpoint_saved(self, saved: CheckpointSaved) -> None:
        """Records a checkpoint the trainer wrote (``CheckpointLedger.saved``).

        Raises:
            NotOwner: another replica owns the run now.
        """
        await self.ledger.saved(saved)

    def resumed(self, resumed: Resumed) -> None:
        """Notes where a job placed again started from, and what it skipped.

        Raises:
            ForkNotRestored: a fork's job restored none of its checkpoints (it would train
                from scratch).
        """
        run = self.run
        skipped = "; ".join(
            f"skipped the checkpoint at episode {e} ({why})" for e, why in resumed.skipped
        )
        if run.fork_run_id and not resumed.episode:
            reasons = "; ".join(f"episode {e}: {why}" for e, why in resumed.skipped)
            raise ForkNotRestored(run, f"no checkpoint restored ({reasons or 'none given'})")
        if self.attempt is not None:
            self.attempt.restored = next(
                (p for p in self.attempt.resume_from if p.checkpoint.episode == resumed.episode),
                None,
            )
        start = (
            f"continued from the checkpoint at episode {resumed.episode}"
            if resumed.episode
            else "started again from scratch (no checkpoint restored)"
        )
        self.ledger.note = f"{start}; {skipped}" if skipped else start
        log = _LOGGER.warning if resumed.skipped else _LOGGER.info
        log(
            "run %s: %s",
            run.id,
            self.ledger.note,
            extra={"run_id": run.id, "event": "resumed", "episode": resumed.episode},
        )

    def rendezvous(self, rendezvous: Rendezvous) -> None:
        """Rank 0's trainer says where the other ranks join its job: the other trainers' shares
        start there, from the one checkpoint rank 0 restored (none when from scratch)."""
        attempt = self.attempt
        if attempt is None or attempt.shares is None:
            _LOGGER.warning(
                "run %s: trainer %s announced a rendezvous for a job placed on it alone; ignored",
                self.run.id,
                self._trainer,
                extra={"run_id": self.run.id},
            )
            return
        restored = [] if attempt.restored is None else [attempt.restored]
        attempt.shares.start(rendezvous.address, restored)

    def stream_broke(self, reason: str) -> None:
        """Rank 0's stream broke: a share that fails now fails for want of rank 0."""
        if self.attempt is not None and self.attempt.shares is not None:
            self.attempt.shares.rank0_broke(reason)

    def checkpoint_failed(self, failed: CheckpointFailed) -> None:
        """A checkpoint could not be written: said in the run's detail; training goes on."""
        self.ledger.failed(failed)

    # -- driving -----------------------------------------------------------------------------

    async def _stream(self, attempt: JobAttempt, attach_after: int | None) -> None:
        ctx, run = self._ctx, self.run
        if attach_after is not None and len(run.trainers) > 1:
            await self._drop_spanning_job(attempt)
        resume_from: list[ResumePoint] = []
        if attach_after is None and run.trainer_episode:
            resume_from = await self.ledger.resume_points()
            if not resume_from and run.fork_run_id:
                raise ForkNotRestored(
                    run, "that checkpoint is gone (deleted with its run or by its retention)"
                )
        attempt.resume_from, attempt.restored = resume_from, None
        placement = attempt.placement
        if attach_after is None and placement is not None and placement.spans:
            attempt.shares = JobShares(run, placement, ctx.connector, ctx.settings, attempt)
        feed = TrainerFeed(
            run,
            attempt.trainer,
            self.inbox,
            ctx.connector,
            ctx.settings,
            ctx.observer,
            ctx.clock,
            self,
            None if placement is None else placement.job_placement(placement.rank0),
        )
        # A job shows it restored its checkpoint with the episode after it: grant that one at
        # least (the feed drops it if the run received it before).
        floor = 0
        if resume_from:
            floor = min(run.config.max_episodes, resume_from[0].checkpoint.episode + 1)
        streaming = feed.stream(
            attach_after,
            lambda: self.grants.opening(floor),
            lambda: 2 * self.grants.lead() + MAX_UNCOMMITTED,
            lambda reader: self.publisher.run(self.inbox, reader),
            resume_from,
        )
        if attempt.shares is None:
            await streaming
        else:
            await attempt.shares.run(streaming)

    async def _drop_spanning_job(self, attempt: JobAttempt) -> None:
        """A gateway restart found the run's job spanning trainers: every share is cancelled
        (see ``reattach``).

        Raises:
            SharesNotReattached: always (the run is restarted from its newest checkpoint).
        """
        run = self.run
        trainers = ", ".join(run.trainers)
        _LOGGER.warning(
            "run %s: its job spans trainers %s; the shares of trainers other than rank 0's "
            "cannot be re-attached, so every share is cancelled",
            run.id,
            trainers,
            extra={"run_id": run.id},
        )
        await asyncio.gather(*(attempt.cancel_job(address) for address in run.trainers))
        for address in run.trainers:
            self._ctx.scheduler.run_ended(address)
        raise SharesNotReattached(
            f"the job of run {run.id} spanned trainers {trainers}: its shares cannot be "
            "re-attached after a gateway restart"
        )

    async def _drive(self, attempt: JobAttempt, attach_after: int | None) -> None:
        """Runs the trainer stream to its end and tells the state machine how it ended."""
        run, trainer = self.run, attempt.trainer
        failure: BaseException | None = None
        try:
            if not self.owned:
                if not await self._ctx.ownership.claim(self):
                    raise NotOwner(run.id)
                self.owned = True
            await self._stream(attempt, attach_after)
        except asyncio.CancelledError:
            raise  # stop, park or shutdown: whoever cancelled carries on
        except NotOwner:
            attempt.task = None
            attempt.release_all()
            await self.abandon()
            return
        except TrainerBusy as exc:
            # Refused before its first answer: back in the queue at its place.
            if isinstance(self.state, lc.Placing):
                _LOGGER.info(
                    "run %s: trainer %s is busy; back in the queue",
                    run.id,
                    trainer,
                    extra={"run_id": run.id},
                )
                self._ctx.observer.trainer_failure(run.id, "busy")
                attempt.task = None
                attempt.release_all()
                self._apply_now(lc.Busy())
                return
            failure = TrainerBusy(f"busy after it started the run: {exc}")
        except Exception as exc:
            failure = exc
        finally:
            attempt.release_all()
        decision = None if failure is None else await self._decide(failure, trainer)
        if attempt is not self.attempt or not isinstance(self.state, (lc.Placing, lc.Running)):
            attempt.task = None  # stopped, parked or let go meanwhile: that path goes on
            return
        attempt.task = None
        self._failure, self._decision = failure, decision
        if decision is None or decision.action is not Action.RESTART:
            with contextlib.suppress(StoreUnavailable):
                await self._apply(lc.StreamEnded(decision))
            return
        with contextlib.suppress(StoreUnavailable):
            # (Logged by the store; the count is written with the next change.)
            await self._apply(lc.StreamEnded(decision))

    async def _decide(self, failure: BaseException, trainer: str) -> Decision:
        """The restart policy's decision on a failed job (reading the run's checkpoints only
        when it depends on them)."""
        run, policy = self.run, self._restarts
        active = run.state in (RunState.RUNNING, RunState.PAUSED)
        points: list[ResumePoint] = []
        if policy.wants_checkpoints(failure, active) and isinstance(
            self.state, (lc.Placing, lc.Running)
        ):
            try:
                points = await self.ledger.resume_points()
            except Exception:
                _LOGGER.exception("run %s: cannot read its checkpoints", run.id)
        self._points = points
        decision = policy.decide(
            failure, trainer, active=active, restarts=run.restarts, has_checkpoint=bool(points)
        )
        if decision.action is Action.REQUEUE:
            _LOGGER.info(
                "run %s: %s; the job is cancelled and the run back in the queue",
                run.id,
                decision.culprit,
                extra={"run_id": run.id},
            )
            self._ctx.observer.trainer_failure(run.id, "busy")
        return decision

    def _count_restart(self) -> None:
        run, decision = self.run, self._decision
        assert decision is not None and self._points
        run.restarts = decision.number
        self._ctx.observer.trainer_failure(run.id, decision.ending.label)
        limit = self._restarts.max_restarts
        self.ledger.note = f"restart {run.restarts} of {limit} after {decision.culprit}"
        _LOGGER.warning(
            "run %s: %s (%s); restart %d of %d from the checkpoint at episode %d",
            run.id,
            decision.culprit,
            self._failure,
            run.restarts,
            limit,
            self._points[0].checkpoint.episode,
            extra={"run_id": run.id, "event": "restarting"},
        )

    # -- park --------------------------------------------------------------------------------

    def _arm_park(self) -> None:
        delay = self._ctx.settings.park_after_s
        if delay <= 0 or self.run.state is not RunState.PAUSED or self.run.parked:
            return
        self._disarm_park()
        loop = asyncio.get_running_loop()
        self._park_timer = loop.call_later(delay, self._park_due)

    def _park_due(self) -> None:
        self._park_timer = None
        self._apply_now(lc.ParkDue())

    def _disarm_park(self) -> None:
        if self._park_timer is not None:
            self._park_timer.cancel()
            self._park_timer = None

    async def _park(self) -> None:
        """Parks a run paused for ``park_after_s``: its job writes a final checkpoint at its
        last episode and ends, its stream still attached so that the run receives every
        episode up to that checkpoint; the run keeps what it received and frees its slot."""
        attempt = self.attempt
        assert attempt is not None
        run, task = self.run, attempt.task
        attempt.quiet()  # the other ranks lose rank 0 on purpose now
        try:
            outcome = await attempt.cancel_job(checkpoint=True)
            if outcome is not None and outcome.checkpoint is not None:
                await self.checkpoint_saved(outcome.checkpoint)
            elif outcome is not None and outcome.checkpoint_error:
                self.ledger.note = (
                    f"the parking checkpoint could not be written: {outcome.checkpoint_error}"
                )
            # The stream delivers what the job trained, its checkpoint, and ends.
            if task is not None:
                done, _ = await asyncio.wait([task], timeout=self._ctx.settings.heartbeat_timeout_s)
                if not done:
                    await attempt.cancel_stream()
            # Rank 0's final checkpoint is written: the other trainers' shares go now.
            await attempt.cancel_shares()
            if isinstance(self.state, lc.Parking):
                await self._apply(lc.ParkDone())
        except (StoreUnavailable, NotOwner) as exc:
            _LOGGER.warning("run %s: parking not saved: %s", run.id, exc, extra={"run_id": run.id})

    # -- the end -----------------------------------------------------------------------------

    def _report(self, exc: BaseException, trainer: str) -> Ending:
        """Logs and counts the failure that ends the run; returns its ``Ending``."""
        run = self.run
        ending = end_of(exc)
        if isinstance(exc, ContractViolation):
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
        elif ending.line is not None:
            self._ctx.observer.trainer_failure(run.id, ending.label)
            _LOGGER.warning(
                "run %s: " + ending.line, run.id, trainer, exc, extra={"run_id": run.id}
            )
        elif not isinstance(exc, (StoreWriteFailed, StoreUnavailable)):
            # (A store failure was logged where the write failed.)
            _LOGGER.error(
                "run %s: unexpected failure driving trainer %s",
                run.id,
                trainer,
                exc_info=exc,
                extra={"run_id": run.id},
            )
        return ending

    async def _finish(self) -> None:
        """Carries out the decided end: a run whose job ended (done or failed) publishes what
        it received and takes its final state; then that state is stored and the run leaves
        the active runs."""
        state, run = self.state, self.run
        assert isinstance(state, lc.Finishing)
        if state.outcome is not lc.Outcome.STOPPED and not run.state.finished:
            failure = self._failure if state.outcome is not lc.Outcome.DONE else None
            ending = None if failure is None else self._report(failure, self._trainer)
            try:
                await self.publisher.flush()
            except NotOwner:
                await self.abandon()
                return
            except Exception as exc:
                if ending is None:
                    ending = self._report(exc, self._trainer)
            if ending is None:
                run.complete(self._ctx.now())
            elif state.outcome is lc.Outcome.GAVE_UP:
                run.fail(
                    f"{ending.message} Gave up after {run.restarts} restarts from checkpoints.",
                    self._ctx.now(),
                )
            else:
                run.fail(ending.message, self._ctx.now())
        await self._store_end()

    async def _store_end(self) -> None:
        """Flushes, stores the final state, leaves the active runs, ends the watches."""
        self._disarm_park()
        run = self.run
        try:
            await self.publisher.flush()
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
        self._transition(lc.Stored())
        self._ctx.on_end(self)
        self._ended.set()
        self.log.close()
        if self.publisher.details is not None:
            self._ctx.spawn(self.publisher.details.finish(), f"gateway-details-{run.id}")
        for address in self._addresses():
            self._ctx.scheduler.run_ended(address)
        log_end(run)
