"""The per-run driver: the thin shell that carries out one active run's lifecycle.

The lifecycle is the pure state machine of ``gateway.core.lifecycle``: every control, answer,
timer and stream end becomes an event, and the driver carries out the commands ``step`` returns,
in order. Each placement of the run's job is a ``JobAttempt`` (trainers, reservations, stream,
shares, the feed's hooks); the ``TrainerFeed`` streams the job into the ``Publisher`` (to the
store at the run's pace); ``Grants`` give the trainer credit as episodes commit; ``Failures``
turn a failed job into the restart policy's decision; ``Closing`` writes the run and its end.

Invariants:

- ``episode`` (published) is the last episode the store has committed: nothing a watcher saw
  is lost by a crash; ``episode <= trainer_episode <= granted``.
- Episodes received and not yet published stay in the inbox across re-attaches, parks and
  restarts; a new job trains again the episodes after its checkpoint, and the feed drops those
  the run received, so watchers see every episode once.
- Stop stores the end, then cancels the job after its final checkpoint (the trained model).
  Gateway shutdown and a run taken over by another replica leave the trainers their jobs.
  Whenever a job ends its other shares are cancelled and its trainers' slots reported free.
- With replicas a driver exists only for a run its replica owns (``gateway.core.router``
  promotes it); a write refused with ``NotOwner`` makes the driver abandon the run without
  touching the job (demoted).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.core import lifecycle as lc
from gateway.core.attempt import JobAttempt, SlotHooks
from gateway.core.closing import Closing
from gateway.core.curve import CurveBuilder
from gateway.core.details import DetailRetention
from gateway.core.driving import DriverContext
from gateway.core.errors import (
    IllegalTransition,
    StoreUnavailable,
)
from gateway.core.failures import Failures
from gateway.core.feed import Inbox, TrainerFeed
from gateway.core.granting import Grants
from gateway.core.hyperparameters import applied_to, job_takes, tell_job
from gateway.core.ledger import CheckpointLedger
from gateway.core.lifecycle import Command as C
from gateway.core.live_log import EpisodeLog
from gateway.core.pacing import Pacer
from gateway.core.parking import Parking
from gateway.core.placement import Placement, rewards_needed, slots_needed
from gateway.core.publisher import MAX_UNCOMMITTED, Publisher
from gateway.core.restarts import Decision, RestartPolicy
from gateway.core.run_detail import describe, log_control, log_parked, log_placed
from gateway.core.runs import RunState, TrainingRun
from gateway.core.store import NotOwner
from gateway.core.trainers import (
    TrainerBusy,
)
from trainwire.contract import task_kind
from trainwire.hyperparameters import Hyperparameters

_LOGGER = logging.getLogger(__name__)


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
        settings = ctx.settings
        self.log = EpisodeLog(
            run.id, settings.live_coalesce_s, ctx.clock, settings.live_episodes, run.fork_episode
        )
        self.pacer = Pacer(run.episodes_per_second, run.speed, ctx.clock)
        self.grants = Grants(run, self.pacer, settings, ctx.connector, ctx.spawn, self._granting)
        details = DetailRetention(
            run,
            self.kind,
            ctx.store,
            ctx.spawn,
            ctx.forget_pages,
            settings.live_episodes,
            settings.details_per_run,
            provider_defaults=ctx.provider_defaults,
        )
        self.publisher = Publisher(
            run, self.log, self.pacer, ctx.store, ctx.observer, self.grants.maybe, details
        )
        self.closing = Closing(run, ctx, self.publisher, self.log)
        #: Stores the run's state (``Closing.persist``).
        self.persist = self.closing.persist
        self.inbox = Inbox()
        #: Where its job stands (``gateway.core.lifecycle``), and the events that led there.
        self.state: lc.State = lc.Pending()
        self.history: list[lc.Event] = []
        #: The current (or last) placement of its job.
        self.attempt: JobAttempt | None = None
        self.pending_detail = "waiting for the scheduler"
        self._trainer = run.trainer  # rank 0's
        self._ended = asyncio.Event()  # let go: finalized, detached or abandoned
        #: The run's checkpoint records, retention and the note people read about them.
        self.ledger = CheckpointLedger(run, ctx.store, ctx.checkpoint_files, ctx.spawn)
        #: Its park: the timer, and the store-then-end-the-job procedure.
        self.parking = Parking(self, settings, ctx.spawn, self.ledger)
        self.failures = Failures(
            run, RestartPolicy(settings.max_restarts), self.ledger, ctx.observer
        )
        #: The failure that ended the last job, its decision and the resume points it had.
        self._decision: Decision | None = None

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
    def abandoned(self) -> bool:
        """Whether it let its run go to another replica."""
        return self.state == lc.Ended(lc.Exit.ABANDONED)

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
        run.state_detail = describe(
            run,
            self.state,
            self.pending_detail,
            self._where(),
            self.grants.window.granted,
            self.ledger.note,
        )
        return run

    # -- the state machine's shell -------------------------------------------------------------

    def _transition(self, event: lc.Event) -> lc.Commands:
        before = self.state
        self.state, commands = lc.step(before, event)
        if commands or self.state != before:
            self.history.append(event)
        return commands

    async def apply(self, event: lc.Event) -> None:
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
        elif command is C.STORE_FIRST:
            await self._store_first()
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

    async def _store_first(self) -> None:
        """Stores the run before its ended job is touched (see ``lifecycle``): on ``NotOwner``
        the run is abandoned (``apply`` then carries out nothing more of the step)."""
        try:
            await self.persist()
        except StoreUnavailable:
            pass  # logged by the store; the change is written with the next one
        except NotOwner:
            _LOGGER.info(
                "run %s: its job's stream ended after another gateway replica took it over;"
                " the job is left to that replica",
                self.run.id,
                extra={"run_id": self.run.id},
            )
            await self.abandon()

    def _carry_out_now(self, command: C) -> bool:
        """Carries out an immediate command; False for one that must be awaited."""
        ctx, run, attempt = self._ctx, self.run, self.attempt
        if command is C.START_JOB or command is C.ATTACH_JOB:
            assert attempt is not None
            attach_after = run.episode if command is C.ATTACH_JOB else None
            attempt.start(self._drive(attempt, attach_after), f"gateway-run-{run.id}")
        elif command is C.REQUEUE:
            if isinstance(self.state, lc.Restarting):
                self.pending_detail = lc.WAITING_AGAIN
            ctx.scheduler.requeue(self)
        elif command is C.DEQUEUE:
            ctx.scheduler.dequeue(self)
        elif command is C.ARM_PARK:
            self.parking.arm()
        elif command is C.DISARM_PARK:
            self.parking.disarm()
        elif command is C.PARK:
            self.parking.start()
        elif command is C.MARK_STARTED:
            run.start(self._trainer, ctx.now(), self._addresses())
            log_placed(run, "started on", self._where(), len(self._addresses()))
        elif command is C.MARK_PLACED:
            run.placed(self._trainer, self._addresses())
            log_placed(run, "continues on", self._where(), len(self._addresses()))
        elif command is C.MARK_PARKED:
            run.park()
            log_parked(run, self._addresses())
        elif command is C.COUNT_RESTART:
            assert self._decision is not None
            self.failures.count_restart(self._decision)
        elif command is C.SLOT_FREED:
            ctx.scheduler.run_ended(self._trainer)
        elif command is C.CANCEL_JOB:
            if attempt is not None and attempt.trainer and not self.abandoned:
                ctx.spawn(attempt.cancel(), f"gateway-cancel-{run.id}")
        elif command is C.CANCEL_JOB_CHECKPOINT:
            if attempt is not None:
                stop_job = attempt.stop_job(keep=self.abandoned)
                ctx.spawn(stop_job, f"gateway-cancel-{run.id}")
        elif command is C.CANCEL_SHARES:
            if attempt is not None and attempt.shares is not None:
                ctx.spawn(attempt.cancel_shares(), f"gateway-cancel-shares-{run.id}")
        elif command is C.GRANT:
            self.grants.maybe()
        elif command is C.RELEASE:
            ctx.demoted(self)
            self._ended.set()
        else:
            return False
        return True

    # -- starting ----------------------------------------------------------------------------

    def _new_attempt(self, trainer: str, placement: Placement | None) -> JobAttempt:
        ctx = self._ctx
        slots = SlotHooks(ctx.scheduler.started, ctx.scheduler.run_ended)
        return JobAttempt(
            self.run.id,
            trainer,
            placement,
            ctx.connector,
            ctx.settings,
            slots,
            self.ledger,
            self._answered,
        )

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
        self.publisher.restore_curve(curve)
        run.received_through(run.episode)
        if not run.parked:
            self.attempt = self._new_attempt(run.trainer, None)
        paused = run.state is RunState.PAUSED
        self._apply_now(lc.Reattach(run.trainer, paused, run.parked))

    async def recovered(self, error: str | None) -> None:
        """A gateway restart found the run finished (``error`` None: its done episode was
        committed) or unable to go on (``error`` says why): it ends so, and is let go."""
        if error is None:
            self.run.complete(self._ctx.now())
        else:
            self.run.fail(error, self._ctx.now())
        outcome = lc.Outcome.DONE if error is None else lc.Outcome.FAILED
        await self.apply(lc.Recovered(outcome))

    def waiting(self, why: str) -> None:
        """The scheduler says what the run waits for."""
        self.pending_detail = why

    def take_metadata(self, display_name: str, labels: dict[str, str]) -> None:
        """The run was renamed or relabelled (here, or by another replica)."""
        self.run.relabel(display_name, labels)

    # -- controls ----------------------------------------------------------------------------

    def _controlled(self) -> None:
        self.publisher.controlled()
        self.log.wake()

    async def pause(self) -> None:
        """Pauses publication; the trainer gets no new grant. No-op when paused."""
        if self.run.pause():
            self._controlled()
            await self.apply(lc.Pause())
            log_control(self.run, "paused")

    async def resume(self) -> None:
        """Resumes publication and grants (a parked run is placed again). No-op when running."""
        if self.run.resume():
            self.pacer.restart()
            self._controlled()
            await self.apply(lc.Resume())
            log_control(self.run, "resumed")

    async def set_speed(self, speed: float) -> None:
        """Changes the speed of publication and of the lead, at once."""
        self.run.set_speed(speed)
        self.pacer.set_speed(self.run.speed)
        self.publisher.controlled()
        self.grants.maybe()
        await self.persist()
        log_control(self.run, "speed")

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
        run = self.run
        defaults = self._ctx.provider_defaults("grpo", self._trainer)
        if job_takes(change, run, self.state, defaults):
            timeout = self._ctx.settings.trainer_call_timeout_s
            await tell_job(self._ctx.connector, self._trainer, run.id, change, timeout)
        run.retask(applied_to(change, run.task))
        await self.persist()
        log_control(run, "hyperparameters", change.describe())

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
        await self.apply(lc.Stop())
        if self.abandoned:
            raise NotOwner(self.run.id)

    async def detach(self) -> None:
        """Gateway shutdown: cancels the stream but not the trainer's job (the next gateway
        re-attaches), flushes the commits and stores the run as it is."""
        await self.apply(lc.Detach())

    async def _leave(self) -> None:
        try:
            await self.closing.leave()
        finally:
            self._ended.set()

    async def abandon(self) -> None:
        """Another replica owns the run now: stops driving it, leaving the trainer's job and
        the store alone (the new owner re-attaches and writes), and leaves the active runs."""
        if not isinstance(self.state, lc.Ended):
            await self.apply(lc.Abandon())

    async def _answered(self) -> None:
        """Rank 0's trainer answered for the first time: the run starts, or continues on its
        new trainers."""
        if isinstance(self.state, lc.Placing):
            await self.apply(lc.Answered())

    # -- driving -----------------------------------------------------------------------------

    async def _drive(self, attempt: JobAttempt, attach_after: int | None) -> None:
        """Runs the trainer stream to its end and tells the state machine how it ended."""
        ctx, run, trainer = self._ctx, self.run, attempt.trainer
        failure: BaseException | None = None
        try:
            resume_from = [] if attach_after is not None else await self.ledger.for_new_job()
            # A job shows it restored its checkpoint with the episode after it: grant that one
            # at least (the feed drops it if the run received it before).
            floor = (
                min(run.config.max_episodes, resume_from[0].checkpoint.episode + 1)
                if resume_from
                else 0
            )
            feed = TrainerFeed(
                run,
                trainer,
                self.inbox,
                ctx.connector,
                ctx.settings,
                ctx.observer,
                ctx.clock,
                attempt,
                attempt.job_placement(),
            )
            await attempt.stream(
                run,
                feed,
                attach_after,
                resume_from,
                lambda: self.grants.opening(floor),
                lambda: 2 * self.grants.lead() + MAX_UNCOMMITTED,
                lambda reader: self.publisher.run(self.inbox, reader),
            )
        except asyncio.CancelledError:
            raise  # stop, park or shutdown: whoever cancelled carries on
        except NotOwner:
            attempt.stream_ended()
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
                attempt.stream_ended()
                attempt.release_all()
                self._apply_now(lc.Busy())
                return
            failure = TrainerBusy(f"busy after it started the run: {exc}")
        except Exception as exc:
            failure = exc
        finally:
            attempt.release_all()
        attempt.stream_ended()
        if failure is not None and self._job_ended(attempt):
            self._decision = await self.failures.decide(failure, trainer)
        if self._job_ended(attempt):  # (else stopped, parked or let go: that path goes on)
            # (Never raises: a restart stores the run with ``STORE_FIRST``, an end with
            # ``FINISH``, and each lets the run go on ``NotOwner``.)
            await self.apply(lc.StreamEnded(None if failure is None else self._decision))

    def _job_ended(self, attempt: JobAttempt) -> bool:
        """Whether the end of ``attempt``'s stream is the run's to act on."""
        return attempt is self.attempt and isinstance(self.state, (lc.Placing, lc.Running))

    # -- the end -----------------------------------------------------------------------------

    async def _finish(self) -> None:
        """Carries out the decided end: a run whose job ended (done or failed) publishes what
        it received and takes its final state; then that state is stored and the run leaves
        the active runs (or is abandoned to the replica that owns it now)."""
        state = self.state
        assert isinstance(state, lc.Finishing)
        outcome = state.outcome
        if outcome is not lc.Outcome.STOPPED and not self.run.state.finished:
            failure = None if outcome is lc.Outcome.DONE else self.failures.failure
            gave_up = outcome is lc.Outcome.GAVE_UP
            if not await self.closing.take_end(failure, self._trainer, gave_up):
                await self.abandon()
                return
        self.parking.disarm()
        if not await self.closing.store_end():
            await self.abandon()
            return
        self._transition(lc.Stored())
        self._ctx.on_end(self)
        self._ended.set()
        self.closing.let_go(self._addresses())
