"""The per-run driver: one active run's lifecycle over its trainer feed, publisher and credit.

A ``RunDriver`` owns an active run. Once the scheduler places the run on a trainer (or the
gateway re-attaches it after a restart) it runs the run's ``TrainerFeed`` (the trainer stream,
checked and queued, re-attached when it breaks; ``gateway.core.feed``) into its ``Publisher``
(the queue to the store at the run's pace, visible once committed; ``gateway.core.publisher``)
and grants the trainer credit as episodes commit (``CreditWindow``, ``gateway.core.credit``).
It applies the controls, persists the run and ends it (``gateway.core.ending``).

Invariants:

- ``episode`` (published) is the last episode the store has committed; nothing a watcher saw
  can be lost by a crash.
- ``trainer_episode`` is the last episode received; ``episode <= trainer_episode <= granted``.
- A stream that breaks is re-attached after ``trainer_episode`` for up to
  ``heartbeat_timeout_s``; only then does the run fail. The break is acted on once the
  episodes received before it are published (at most one lead later), at once while the run
  is paused; they stay queued across the re-attach (a failure that ends a running run ends it
  after them; a paused one ends without them).
- Stop cancels the stream and the trainer's job (``CancelJob``); gateway shutdown cancels the
  stream only, so the trainer keeps the job for the next gateway to re-attach.
- Every checkpoint the trainer reports is recorded (``Store.add_checkpoint``, which applies
  the run's retention). A run paused for ``park_after_s`` is *parked*: its job writes a final
  checkpoint and ends, and its slot is free; resume places it again, and the new job starts
  from the newest checkpoint the run has every episode of. A run whose trainer or job died is
  *restarted* the same way, at most ``max_restarts`` times, once it has such a checkpoint. A
  new job trains again the episodes after its checkpoint that the run received; the feed drops
  them, so watchers see every episode once. Episodes received and not yet published stay in
  the driver's inbox across all of this.
- A job the scheduler placed on several trainers (``gateway.core.placement``) streams from rank
  0's trainer, which alone gets grants, controls and hyperparameter changes; the other
  trainers' shares start on its rendezvous and are watched by ``JobShares``
  (``gateway.core.shares``). A failed share fails the job (cancelling rank 0's stream) and the
  run is restarted as above, possibly on other trainers, or ends ERROR naming the trainer and
  its ranks; a share refused as busy puts the run back in the queue without counting a
  restart. Whenever the job ends (done, failure, stop, park, restart) every share that did not
  end is cancelled (rank 0's first where its final checkpoint is wanted) and every trainer's
  slots are reported free. ``Run.trainers`` lists them, rank 0's first.
- With gateway replicas a driver drives its run only while its replica owns it: a *candidate*
  (a PENDING run no replica owns, ``owned`` False) has its ``Ownership`` claim the run before
  it dispatches it, and any write the store refuses with ``NotOwner`` makes the driver
  *abandon* the run: it stops driving without cancelling the trainer's job and without writing
  anything more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core.checkpoints import CheckpointFiles
from gateway.core.credit import CreditWindow, lead_for
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
from gateway.core.hyperparameters import applied_to, check_change, has_reference_model
from gateway.core.ledger import CheckpointLedger
from gateway.core.live_log import EpisodeLog
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.placement import Placement, rewards_needed, slots_needed
from gateway.core.publisher import MAX_UNCOMMITTED, Publisher
from gateway.core.restarts import Action, RestartPolicy
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

#: Seconds before a grant the trainer did not take is tried again without a commit.
GRANT_RETRY_S = 1.0


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
        self.log = EpisodeLog(
            run.id,
            ctx.settings.live_coalesce_s,
            ctx.clock,
            ctx.settings.live_episodes,
            run.fork_episode,
        )
        self.pacer = Pacer(run.episodes_per_second, run.speed, ctx.clock)
        self.credit = CreditWindow(run.config.max_episodes)
        self.publisher = Publisher(
            run, self.log, self.pacer, ctx.store, ctx.observer, self._maybe_grant
        )
        self.publisher.details = DetailRetention(
            run,
            self.kind,
            ctx.store,
            ctx.spawn,
            ctx.forget_pages,
            ctx.settings.live_episodes,
            ctx.settings.details_per_run,
        )
        self.inbox = Inbox()
        self.feed: TrainerFeed | None = None
        self.task: asyncio.Task[None] | None = None
        self.finalizing = False
        self.pending_detail = "waiting for the scheduler"
        self.owned = owned
        self._trainer = run.trainer  # rank 0's
        #: Where its job runs (None before it was placed, and for a job re-attached after a
        #: gateway restart: that one runs on ``run.trainer`` alone).
        self._placement: Placement | None = None
        #: Slots the scheduler counts as starting, by trainer, until each answers.
        self._reserved: dict[str, int] = {}
        #: The other trainers' shares of the current job (None: it runs on one trainer).
        self._shares: JobShares | None = None
        #: The checkpoints the current job was given, and the one it restored.
        self._resume_from: list[ResumePoint] = []
        self._restored: ResumePoint | None = None
        self._ended = asyncio.Event()  # finalized (or handed to another replica)
        #: An active run waiting to be placed again (parked and resumed, or restarted).
        self.placing_again = False
        #: The run's checkpoint records, retention and the note people read about them.
        self.ledger = CheckpointLedger(run, ctx.store, ctx.checkpoint_files, ctx.spawn)
        self._park_timer: asyncio.TimerHandle | None = None
        self._parking = False
        self._gave_up = False  # the failure came after the last restart
        self._restarts = RestartPolicy(ctx.settings.max_restarts)

    @property
    def seq(self) -> int:
        """The run's creation order (FIFO placement)."""
        return self.run.seq

    @property
    def placeable(self) -> bool:
        """Whether the scheduler may still place the run."""
        waiting = self.run.state is RunState.PENDING or self.placing_again
        return waiting and not self.finalizing and self.task is None

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
        """Where its job runs, for people."""
        if self._placement is not None:
            return self._placement.describe()
        return self._trainer

    def _addresses(self) -> tuple[str, ...]:
        """Every trainer of its job (or of its last one), rank 0's first."""
        if self._placement is not None:
            return self._placement.addresses
        return self.run.trainers or ((self._trainer,) if self._trainer else ())

    async def ended(self) -> None:
        """Returns once the driver let its run go: its end stored (or refused by a full
        disk), or the run handed to another replica."""
        await self._ended.wait()

    def snapshot(self) -> TrainingRun:
        """A copy of the run with its ``state_detail`` filled in."""
        run = self.run.snapshot()
        run.state_detail = self._detail()
        return run

    def _detail(self) -> str:
        run = self.run
        granted = self.credit.granted
        note = f"; {self.ledger.note}" if self.ledger.note else ""
        if run.state is RunState.PENDING:
            return self.pending_detail
        if run.parked and run.state is RunState.PAUSED:
            return (
                f"parked at episode {run.episode}: its training state is in the checkpoint "
                f"at episode {run.checkpoint_episode} and its trainer slot is free; resume "
                f"places it again{note}"
            )
        if self.placing_again:
            return (
                f"{self.pending_detail}, to continue from its latest checkpoint "
                f"(episode {run.checkpoint_episode or run.fork_episode}){note}"
            )
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

    # -- starting ----------------------------------------------------------------------------

    def dispatch(self, placement: Placement) -> None:
        """Starts the run on the trainers of ``placement`` (called by the scheduler, which
        counts each share's slots as starting there until :meth:`SchedulerHooks.started`)."""
        self._placement = placement
        self._trainer = placement.rank0.address
        self._reserved = {s.address: s.processes for s in placement.shares}
        self.pending_detail = f"starting on {placement.describe()}"
        self.task = asyncio.create_task(self._drive(None), name=f"gateway-run-{self.run.id}")

    def reattach(self, frames: list[bytes], curve: CurveBuilder) -> None:
        """Continues a RUNNING or PAUSED run after a gateway restart: the live tail of its
        committed history (``frames``) goes back into the log, its curve's open blocks into the
        publisher, and the stream re-attaches to the trainer's job. (What a previous gateway
        received and did not publish is gone with it: the run has received through its
        published episode.)

        A job that spans trainers (``run.trainers``) is not re-attached: rank 0's stream could
        be, but the other trainers' shares stream no episodes to re-attach after, so nothing
        tells whether they are still in the job. Every share is cancelled instead (rank 0's
        too) and the run goes through the restart path: from its newest checkpoint at or before
        its published episode (counted as a restart), or, with none, it ends ERROR as a run
        whose job is gone."""
        self.log.restore(self.run.episode, frames)
        self.publisher.curve = curve
        self.run.trainer_episode = self.run.episode
        if self.run.parked:
            # No job to re-attach to: resume places it again.
            if self.run.state is RunState.RUNNING:
                self._place_again("waiting for a free slot")
            return
        self.task = asyncio.create_task(
            self._drive(self.run.episode), name=f"gateway-run-{self.run.id}"
        )
        self._arm_park()

    # -- controls ----------------------------------------------------------------------------

    def _controlled(self) -> None:
        self.publisher.controlled()
        self.log.wake()

    async def pause(self) -> None:
        """Pauses publication; the trainer gets no new grant. No-op when paused."""
        if self.run.pause():
            self._controlled()
            self._arm_park()
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
            self._disarm_park()
            self.pacer.restart()
            self._controlled()
            if self.run.parked and not self._parking and self.task is None:
                self._place_again("waiting for a free slot")
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
        self.publisher.controlled()
        self._maybe_grant()
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
        run = self.run
        check_change(change, run.id, run.task, reference_model=True)
        if run.state not in (RunState.RUNNING, RunState.PAUSED) or self.finalizing:
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
        if self.task is None or run.parked or self._parking:
            # No job to tell: the next one starts from the task.
            check_change(change, run.id, run.task, has_reference_model(run.task))
        elif self.placing_again:
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
        run = self.run
        try:
            await self._ctx.connector.set_hyperparameters(
                self._trainer, run.id, change, self._ctx.settings.trainer_call_timeout_s
            )
        except TrainerRefused as exc:
            raise InvalidRequest(
                f"cannot change the hyperparameters of run {run.id!r}: {exc.user_message}",
                exc.violations,
                run.id,
            ) from None
        except TrainerJobFinished:
            raise IllegalTransition(
                f"cannot change the hyperparameters of run {run.id!r}: its trainer has trained "
                "its last episode",
                run.id,
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
        this replica's, cancels its trainer job.

        Raises:
            NotOwner: another replica took the run over before the end was stored; the stop is
                that replica's to apply, and the job is left to it.
        """
        self.run.stop(self._ctx.now())
        self.finalizing = True
        self._disarm_park()
        self._ctx.scheduler.dequeue(self)
        dispatched = self.task is not None
        shares, self._shares = self._shares, None
        if shares is not None:
            shares.quiet()
        await self._cancel_task()
        await self.finalize()
        if not self.owned:
            if shares is not None:
                await shares.stop_watching()
            raise NotOwner(self.run.id)
        if dispatched and self._trainer:
            # The job's final checkpoint is the trained model; the other trainers' shares
            # are cancelled once rank 0's trainer wrote it.
            self._ctx.spawn(
                self._cancel_job(checkpoint=True, then=shares), f"gateway-cancel-{self.run.id}"
            )
        elif shares is not None:
            self._ctx.spawn(shares.cancel(), f"gateway-cancel-shares-{self.run.id}")

    async def detach(self) -> None:
        """Gateway shutdown: cancels the stream but not the trainer's job (the next gateway
        re-attaches), flushes the commits and stores the run as it is."""
        self.finalizing = True
        self._disarm_park()
        await self._cancel_task()
        await self._stop_watching_shares()
        try:
            await self.publisher.flush()
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store",
                self.run.id,
                extra={"run_id": self.run.id},
            )
        await self.persist()
        self.log.close()
        self._ended.set()

    async def abandon(self) -> None:
        """Another replica owns the run now: stops driving it, leaving the trainer's job and
        the store alone (the new owner re-attaches and writes), and leaves the active runs."""
        if not self.owned and self.finalizing:
            return  # abandoned already
        self.finalizing = True
        self._disarm_park()
        self.owned = False
        self._ctx.scheduler.dequeue(self)
        await self._cancel_task()
        await self._stop_watching_shares()
        self._ctx.ownership.lost(self)
        self._ended.set()

    async def _stop_watching_shares(self) -> None:
        """Stops reading the other trainers' shares; their jobs go on (for the next gateway,
        or the replica that took the run over)."""
        shares, self._shares = self._shares, None
        if shares is not None:
            await shares.stop_watching()

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
        """Ends the reservation of every share's slots that is left."""
        for address in list(self._reserved):
            self._release(address)

    def _release(self, address: str) -> None:
        slots = self._reserved.pop(address, 0)
        if slots:
            self._ctx.scheduler.started(address, slots)

    # -- the shares' hooks -----------------------------------------------------------------------

    def share_answered(self, address: str) -> None:
        """The share on ``address`` answered or ended: its reservation ends."""
        self._release(address)

    def share_ended(self, address: str) -> None:
        """The share on ``address`` ended or was cancelled: a slot may be free there."""
        self._ctx.scheduler.run_ended(address)

    # -- credit ------------------------------------------------------------------------------

    def lead(self) -> int:
        """The credit the trainer may hold beyond the published episode."""
        rate = self.run.episodes_per_second * self.run.speed if self.pacer.paced else None
        return lead_for(rate, self._ctx.settings.lead_s)

    def _opening_grant(self) -> int:
        paused = self.run.state is RunState.PAUSED
        return self.credit.opening(self.run.episode, self.lead(), paused)

    def _maybe_grant(self) -> None:
        """Sends a grant when the credit window says one is due (at most one in flight)."""
        if self.finalizing or self.task is None or self.run.state is not RunState.RUNNING:
            return
        target = self.credit.due(self.run.episode, self.lead())
        if target is not None:
            self._ctx.spawn(self._send_grant(target), f"gateway-grant-{self.run.id}")

    async def _send_grant(self, target: int) -> None:
        delivered = False
        try:
            await self._ctx.connector.grant(
                self._trainer, self.run.id, target, self._ctx.settings.trainer_call_timeout_s
            )
            delivered = True
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
            self.credit.sent(target, delivered)
        if delivered:
            self._maybe_grant()  # commits that came meanwhile may make another one due
        else:
            # Not at once (a trainer that refuses at once would get grants back to back): at
            # the next commit, or after a pause for a trainer that waits at its grant.
            loop = asyncio.get_running_loop()
            loop.call_later(GRANT_RETRY_S, self._maybe_grant)

    # -- driving -----------------------------------------------------------------------------

    async def answered(self) -> None:
        """Rank 0's trainer answered: its reservation ends, a PENDING run starts, and a run
        placed again trains on its new trainers."""
        self._release(self._trainer)
        if self._shares is not None:
            self._shares.rank0_answered()
        run = self.run
        trainers = "trainers" if len(self._addresses()) > 1 else "trainer"
        if self.placing_again:
            self.placing_again = False
            run.parked = False
            run.trainer, run.trainers = self._trainer, self._addresses()
            await self.persist()
            _LOGGER.info(
                "run %s continues on %s %s",
                run.id,
                trainers,
                self._where(),
                extra={"run_id": run.id, "event": "placed_again"},
            )
            return
        if run.state is RunState.PENDING:
            run.start(self._trainer, self._ctx.now(), self._addresses())
            await self.persist()
            _LOGGER.info(
                "run %s started on %s %s",
                run.id,
                trainers,
                self._where(),
                extra={"run_id": run.id, "event": "started"},
            )

    async def _stream(self, attach_after: int | None) -> None:
        ctx = self._ctx
        if attach_after is not None and len(self.run.trainers) > 1:
            await self._drop_spanning_job()
        resume_from: list[ResumePoint] = []
        if attach_after is None and self.run.trainer_episode:
            resume_from = await self.ledger.resume_points()
            if not resume_from and self.run.fork_run_id:
                raise ForkNotRestored(
                    self.run, "that checkpoint is gone (deleted with its run or by its retention)"
                )
        self._resume_from, self._restored = resume_from, None
        placement = self._placement
        shares = None
        if attach_after is None and placement is not None and placement.spans:
            shares = JobShares(self.run, placement, ctx.connector, ctx.settings, self)
        self._shares = shares
        feed = TrainerFeed(
            self.run,
            self._trainer,
            self.inbox,
            ctx.connector,
            ctx.settings,
            ctx.observer,
            ctx.clock,
            self,
            None if placement is None else placement.job_placement(placement.rank0),
        )
        self.feed = feed
        opening = self._opening_grant
        if resume_from:
            # A job shows it restored its checkpoint with the episode after it: grant that one
            # at least (the feed drops it if the run received it before).
            floor = min(self.run.config.max_episodes, resume_from[0].checkpoint.episode + 1)

            def opening() -> int:
                grant = max(self._opening_grant(), floor)
                self.credit.granted = max(self.credit.granted, grant)
                return grant

        streaming = feed.stream(
            attach_after,
            opening,
            lambda: 2 * self.lead() + MAX_UNCOMMITTED,
            lambda reader: self.publisher.run(self.inbox, reader),
            resume_from,
        )
        if shares is None:
            await streaming
        else:
            await shares.run(streaming)

    async def _drop_spanning_job(self) -> None:
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
        await asyncio.gather(*(self._cancel_job(address) for address in run.trainers))
        for address in run.trainers:
            self._ctx.scheduler.run_ended(address)
        raise SharesNotReattached(
            f"the job of run {run.id} spanned trainers {trainers}: its shares cannot be "
            "re-attached after a gateway restart"
        )

    # -- checkpoints (the feed's hooks) --------------------------------------------------------

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
        self._restored = next(
            (p for p in self._resume_from if p.checkpoint.episode == resumed.episode), None
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
        shares = self._shares
        if shares is None:
            _LOGGER.warning(
                "run %s: trainer %s announced a rendezvous for a job placed on it alone; ignored",
                self.run.id,
                self._trainer,
                extra={"run_id": self.run.id},
            )
            return
        restored = [] if self._restored is None else [self._restored]
        shares.start(rendezvous.address, restored)

    def stream_broke(self, reason: str) -> None:
        """Rank 0's stream broke: a share that fails now fails for want of rank 0."""
        if self._shares is not None:
            self._shares.rank0_broke(reason)

    def checkpoint_failed(self, failed: CheckpointFailed) -> None:
        """A checkpoint could not be written: said in the run's detail; training goes on."""
        self.ledger.failed(failed)

    # -- park and restart ----------------------------------------------------------------------

    def _place_again(self, why: str) -> None:
        """Queues an active run whose job ended to be placed on a trainer again."""
        self.placing_again = True
        self.pending_detail = why
        self._ctx.scheduler.requeue(self)

    def _arm_park(self) -> None:
        delay = self._ctx.settings.park_after_s
        if delay <= 0 or self.run.state is not RunState.PAUSED or self.run.parked:
            return
        self._disarm_park()
        loop = asyncio.get_running_loop()
        self._park_timer = loop.call_later(
            delay, lambda: self._ctx.spawn(self._park(), f"gateway-park-{self.run.id}")
        )

    def _disarm_park(self) -> None:
        if self._park_timer is not None:
            self._park_timer.cancel()
            self._park_timer = None

    async def _park(self) -> None:
        """Parks a run paused for ``park_after_s``: its job writes a final checkpoint at its
        last episode and ends, its stream still attached so that the run receives every
        episode up to that checkpoint; the run keeps what it received and frees its slot."""
        self._park_timer = None
        run = self.run
        if run.state is not RunState.PAUSED or run.parked or self.task is None:
            return
        if self.finalizing or self._parking:
            return
        self._parking = True  # the stream's end is the park's, not a failure
        trainer, task, shares = self._trainer, self.task, self._shares
        if shares is not None:
            shares.quiet()  # the other ranks lose rank 0 on purpose now
        settings = self._ctx.settings
        try:
            try:
                outcome = await self._ctx.connector.cancel_job(
                    trainer, run.id, settings.checkpoint_call_timeout_s, checkpoint=True
                )
            except TrainerError as exc:
                _LOGGER.warning(
                    "run %s: trainer %s did not confirm its final checkpoint (%s); parked on "
                    "the checkpoints it has",
                    run.id,
                    trainer,
                    exc,
                    extra={"run_id": run.id},
                )
            else:
                if outcome.checkpoint is not None:
                    await self.checkpoint_saved(outcome.checkpoint)
                elif outcome.checkpoint_error:
                    self.ledger.note = (
                        f"the parking checkpoint could not be written: {outcome.checkpoint_error}"
                    )
            # The stream delivers what the job trained, its checkpoint, and ends.
            done, _ = await asyncio.wait([task], timeout=settings.heartbeat_timeout_s)
            if not done:
                await self._cancel_task()
            if shares is not None:
                # Rank 0's final checkpoint is written: the other trainers' shares go now.
                self._shares = None
                await shares.cancel()
            if self.finalizing:
                return
            run.parked = True
            self._ctx.scheduler.run_ended(trainer)
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
            if run.state is RunState.RUNNING:  # resumed while it parked
                self._place_again("waiting for a free slot")
            await self.persist()
        except (StoreUnavailable, NotOwner) as exc:
            _LOGGER.warning("run %s: parking not saved: %s", run.id, exc, extra={"run_id": run.id})
        finally:
            self._parking = False

    async def _after_failure(self, failure: BaseException, trainer: str) -> bool:
        """Carries out the restart policy's decision on a job that failed: a run requeued
        (a share refused as busy) or restarted from its newest usable checkpoint returns True;
        a run to end returns False (``_gave_up`` set when its restarts were spent)."""
        run = self.run
        policy = self._restarts
        active = run.state in (RunState.RUNNING, RunState.PAUSED)
        points: list[ResumePoint] = []
        if policy.wants_checkpoints(failure, active):
            try:
                points = await self.ledger.resume_points()
            except Exception:
                _LOGGER.exception("run %s: cannot read its checkpoints", run.id)
        decision = policy.decide(
            failure, trainer, active=active, restarts=run.restarts, has_checkpoint=bool(points)
        )
        if decision.action is Action.END:
            self._gave_up = decision.gave_up
            return False
        if decision.action is Action.REQUEUE:
            _LOGGER.info(
                "run %s: %s; the job is cancelled and the run back in the queue",
                run.id,
                decision.culprit,
                extra={"run_id": run.id},
            )
            self._ctx.observer.trainer_failure(run.id, "busy")
        else:
            run.restarts = decision.number
            self._ctx.observer.trainer_failure(run.id, decision.ending.label)
            limit = policy.max_restarts
            self.ledger.note = f"restart {run.restarts} of {limit} after {decision.culprit}"
            _LOGGER.warning(
                "run %s: %s (%s); restart %d of %d from the checkpoint at episode %d",
                run.id,
                decision.culprit,
                failure,
                run.restarts,
                limit,
                points[0].checkpoint.episode,
                extra={"run_id": run.id, "event": "restarting"},
            )
        self.task = None
        self._ctx.scheduler.run_ended(trainer)
        if decision.action is Action.REQUEUE or decision.ending.cancel_job:
            self._ctx.spawn(self._cancel_job(trainer), f"gateway-cancel-{run.id}")
        self._cancel_shares()
        self._place_again("waiting for a free slot")
        if decision.action is Action.RESTART:
            with contextlib.suppress(StoreUnavailable):
                # (Logged by the store; the count is written with the next change.)
                await self.persist()
        return True

    async def _drive(self, attach_after: int | None) -> None:
        """Runs the trainer stream to its end and records how the run ended."""
        run = self.run
        trainer = self._trainer
        failure: BaseException | None = None
        try:
            if not self.owned:
                if not await self._ctx.ownership.claim(self):
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
        except TrainerBusy as exc:
            # Refused before its first answer (a run placed again is still placing_again then).
            if (run.state is RunState.PENDING or self.placing_again) and not self.finalizing:
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
            failure = TrainerBusy(f"busy after it started the run: {exc}")
        except Exception as exc:
            failure = exc
        finally:
            self._release_reservation()
        if self.finalizing:
            return
        if self._parking:
            self.task = None  # the job ended for the park (``_park`` goes on from here)
            return
        if failure is not None and await self._after_failure(failure, trainer):
            return
        self.finalizing = True
        self.task = None
        self._cancel_shares()
        ending = None if failure is None else self._report(failure, trainer)
        try:
            await self.publisher.flush()
        except NotOwner:
            await self.abandon()
            return
        except Exception as exc:
            if ending is None:
                ending = self._report(exc, trainer)
        if ending is None:
            run.complete(self._ctx.now())
        elif self._gave_up:
            run.fail(
                f"{ending.message} Gave up after {run.restarts} restarts from checkpoints.",
                self._ctx.now(),
            )
        else:
            run.fail(ending.message, self._ctx.now())
        await self.finalize()
        if ending is not None and ending.cancel_job and self._trainer and self.owned:
            # The trainer's job would run on for its detach grace, computing for nobody. Only
            # once the end is ours: a replica that lost the run meanwhile (its stream ended
            # because the new owner re-attached) leaves the job to that owner.
            self._ctx.spawn(self._cancel_job(), f"gateway-cancel-{run.id}")

    def _cancel_shares(self) -> None:
        """Cancels the other trainers' shares of the job that ended (in the background)."""
        shares, self._shares = self._shares, None
        if shares is not None:
            shares.quiet()
            self._ctx.spawn(shares.cancel(), f"gateway-cancel-shares-{self.run.id}")

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

    async def _cancel_job(
        self, trainer: str = "", checkpoint: bool = False, then: JobShares | None = None
    ) -> None:
        """Cancels the run's job on ``trainer`` (its current one by default); with
        ``checkpoint`` the job first writes its final checkpoint, which is recorded. The
        shares ``then`` are cancelled after it."""
        try:
            await self._cancel_rank(trainer, checkpoint)
        finally:
            if then is not None:
                await then.cancel()

    async def _cancel_rank(self, trainer: str, checkpoint: bool) -> None:
        trainer = trainer or self._trainer
        settings = self._ctx.settings
        timeout = (
            settings.checkpoint_call_timeout_s if checkpoint else settings.trainer_call_timeout_s
        )
        try:
            outcome = await self._ctx.connector.cancel_job(
                trainer, self.run.id, timeout, checkpoint=checkpoint
            )
        except TrainerError as exc:
            _LOGGER.warning(
                "run %s: could not cancel its job on %s (it ends after the trainer's detach "
                "grace): %s",
                self.run.id,
                trainer,
                exc,
                extra={"run_id": self.run.id},
            )
            return
        if outcome.checkpoint is not None:
            with contextlib.suppress(NotOwner):  # the run's owner now records what it sees
                await self.checkpoint_saved(outcome.checkpoint)

    # -- the end -----------------------------------------------------------------------------

    async def finalize(self) -> None:
        """After the final transition: flush, persist, leave the active runs, end the
        watches."""
        self.finalizing = True
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
        self._ctx.on_end(self)
        self._ended.set()
        self.log.close()
        if self.publisher.details is not None:
            self._ctx.spawn(self.publisher.details.finish(), f"gateway-details-{run.id}")
        for address in self._addresses():
            self._ctx.scheduler.run_ended(address)
        log_end(run)
