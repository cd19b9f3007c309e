"""The other trainers' shares of a job that spans trainers: started once rank 0's trainer
announces the job's rendezvous, watched while the job runs, cancelled when it ends.

A job placed on several trainers (``gateway.core.placement``) starts on rank 0's trainer alone;
its stream announces where the other ranks join it (``Rendezvous``, after ``Resumed`` if any,
before any episode). ``JobShares`` then starts each other trainer's share with the same run,
task and config, its ranks and that address, and the one checkpoint rank 0 restored (none when
it started from scratch). Those streams carry heartbeats only: rank 0's trainer relays steps,
stops, checkpoints and hyperparameters to the other ranks itself, so grants, controls and
hyperparameter changes go to rank 0's trainer alone, and a share's own grant is left unlimited.

A share whose stream ends OK is done (the job is). A share that fails (its stream broke, went
silent for the heartbeat timeout, or ended with an error) ends the job: ``run`` cancels rank 0's
stream and raises ``ShareFailed``, which names the trainer and its ranks, so the run goes
through the driver's restart path like a run whose one trainer died; rank 0's trainer lost is
named the same way. Who is blamed, when one trainer's loss makes the others' ranks fail too:

- a share whose trainer (or connection) was lost, at once;
- a share whose job failed there (its ranks lost a peer) only if rank 0's stream did not break
  before it or within ``SETTLE_S`` after it; else rank 0's trainer went first and is named;
- a failure of rank 0's job while a share's trainer was lost is that share's.

Once the job ends on purpose (stop, park) or has trained its last episode, failures of shares
are only logged.

``cancel`` cancels every share that may still have a job (``CancelJob``, no checkpoint: a share
whose stream broke may still run) and tells the driver each trainer's slots are free;
``stop_watching`` only stops reading (gateway shutdown, another replica taking the run over: the
trainers keep the jobs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from gateway.core.placement import Placement, Share
from gateway.core.runs import TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.trainers import (
    ResumePoint,
    TrainerBusy,
    TrainerConnector,
    TrainerCrashed,
    TrainerError,
    TrainerJobGone,
    TrainerLost,
    TrainerStream,
    next_event,
)
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Failures that mean a trainer (or its connection) is gone rather than the job failing there.
_LOST = (TrainerLost, TrainerJobGone)

#: Seconds a share whose job failed waits for rank 0's stream to show that its trainer went
#: first (the other ranks then fail for want of it).
SETTLE_S = 1.0


class ShareFailed(TrainerError):
    """One trainer's share of a job that spans trainers failed, so the whole job did.

    Attributes:
        who: ``trainer HOST:PORT (ranks A-B of N)``.
        address: That trainer.
        cause: How its share failed.
    """

    def __init__(self, who: str, address: str, cause: TrainerError) -> None:
        super().__init__(f"{who}: {cause}")
        self.who = who
        self.address = address
        self.cause = cause

    @property
    def lost(self) -> bool:
        """Whether the trainer (or its connection) was lost, rather than the job failing
        there."""
        return isinstance(self.cause, _LOST)


class SharesNotReattached(TrainerJobGone):
    """A gateway restart found a run whose job spans trainers: the other trainers' shares have
    no episodes to re-attach after, so every share was cancelled instead."""


class ShareHooks(Protocol):
    """What a driver learns from the shares of its run's job."""

    def share_answered(self, address: str) -> None:
        """The share on ``address`` answered (or ended): its reservation ends."""
        ...

    def share_ended(self, address: str) -> None:
        """The share on ``address`` ended or was cancelled: a slot may be free there."""
        ...


class JobShares:
    """The shares of one job on the trainers other than rank 0's (see the module docstring).

    Args:
        run: The run (its id, task and config; ``trainer_episode`` says whether the job is
            through).
        placement: Where the job runs (it spans trainers).
        connector: How to reach trainers.
        settings: Heartbeat timeout, call deadline.
        hooks: The driver.
    """

    def __init__(
        self,
        run: TrainingRun,
        placement: Placement,
        connector: TrainerConnector,
        settings: CoreSettings,
        hooks: ShareHooks,
    ) -> None:
        self._run = run
        self._placement = placement
        self._connector = connector
        self._settings = settings
        self._hooks = hooks
        self._rendezvous = ""
        self._watchers: dict[str, asyncio.Task[None]] = {}
        #: Shares with no job left to cancel: ended OK, or refused as busy.
        self._no_job: set[str] = set()
        self._failure: asyncio.Future[ShareFailed] = asyncio.get_running_loop().create_future()
        self._quiet = False
        self._rank0_broken = ""  # why rank 0's stream is broken now
        self._rank0_broke = asyncio.Event()

    @property
    def started(self) -> bool:
        """Whether the shares were started (rank 0's trainer announced the rendezvous)."""
        return bool(self._rendezvous)

    def start(self, rendezvous: str, resume_from: Sequence[ResumePoint]) -> None:
        """Starts every other trainer's share at ``rendezvous`` (once; a later announcement
        of the same job is ignored)."""
        run = self._run
        if self._rendezvous:
            if rendezvous != self._rendezvous:
                _LOGGER.warning(
                    "run %s: rank 0's trainer announced rendezvous %s after %s; ignored",
                    run.id,
                    rendezvous,
                    self._rendezvous,
                    extra={"run_id": run.id},
                )
            return
        self._rendezvous = rendezvous
        _LOGGER.info(
            "run %s: starting the shares of its job on %s at rendezvous %s",
            run.id,
            ", ".join(self._placement.who(s) for s in self._placement.others),
            rendezvous,
            extra={"run_id": run.id, "event": "shares_started"},
        )
        for share in self._placement.others:
            stream = self._connector.train(
                share.address,
                run.id,
                run.task,
                run.config,
                0,  # unlimited: rank 0's trainer relays every step
                None,
                resume_from,
                self._placement.job_placement(share, rendezvous),
            )
            self._watchers[share.address] = asyncio.create_task(
                self._watch(share, stream), name=f"gateway-share-{run.id}-{share.address}"
            )

    def rank0_broke(self, reason: str) -> None:
        """Rank 0's stream broke (it is being re-attached)."""
        self._rank0_broken = reason
        self._rank0_broke.set()

    def rank0_answered(self) -> None:
        """Rank 0's stream delivered a message (it streams)."""
        if self._rank0_broken:
            self._rank0_broken = ""
            self._rank0_broke.clear()

    def quiet(self) -> None:
        """The job ends on purpose from now on: failures of shares are only logged."""
        self._quiet = True

    async def run(self, rank0: Awaitable[None]) -> None:
        """Runs rank 0's stream (``rank0``) to its end, or until a share fails first.

        Raises:
            ShareFailed: a share failed (rank 0's stream is cancelled), or rank 0's trainer was
                lost.
            TrainerError, ContractViolation: how rank 0's stream failed otherwise.
        """
        feed = asyncio.ensure_future(rank0)
        try:
            await self._until_either(feed)
        finally:
            if not feed.done():
                feed.cancel()
                await asyncio.gather(feed, return_exceptions=True)
        exc = feed.exception()
        if exc is None:
            return
        failed = self._failure.result() if self._failure.done() else None
        if failed is not None and failed.lost and not isinstance(exc, _LOST):
            raise failed  # the job failed on rank 0's trainer because a share's was lost
        if isinstance(exc, _LOST):
            raise self._rank0_failed(exc)
        raise exc

    async def _until_either(self, feed: asyncio.Future[None]) -> None:
        """Waits until rank 0's stream ends or a share fails.

        Raises:
            ShareFailed: a share failed first (the one to blame, see the module docstring).
        """
        either: list[asyncio.Future[Any]] = [feed, self._failure]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if feed.done():
            return
        failure = self._failure.result()
        if not failure.lost and not self._rank0_broken:
            # Its ranks lost a peer: rank 0's trainer may be the one gone.
            broke: asyncio.Future[Any] = asyncio.ensure_future(self._rank0_broke.wait())
            try:
                await asyncio.wait([broke, feed], timeout=SETTLE_S)
            finally:
                broke.cancel()
            if feed.done():
                return
        if self._rank0_broken and failure.address != self._placement.rank0.address:
            raise self._rank0_failed(TrainerLost(f"{self._rank0_broken}; then {failure}"))
        raise failure

    def _rank0_failed(self, cause: TrainerError) -> ShareFailed:
        share = self._placement.rank0
        return ShareFailed(self._placement.who(share), share.address, cause)

    async def cancel(self) -> None:
        """Stops watching and cancels every share that has not ended (no checkpoint); each
        trainer's slots are then reported free."""
        self._quiet = True
        await self.stop_watching()
        started = self.started
        await asyncio.gather(
            *(
                self._cancel(share, started and share.address not in self._no_job)
                for share in self._placement.others
            )
        )

    async def _cancel(self, share: Share, live: bool) -> None:
        if live:
            try:
                await self._connector.cancel_job(
                    share.address, self._run.id, self._settings.trainer_call_timeout_s
                )
            except TrainerError as exc:
                _LOGGER.warning(
                    "run %s: could not cancel its share on %s (it ends after the trainer's "
                    "detach grace): %s",
                    self._run.id,
                    self._placement.who(share),
                    exc,
                    extra={"run_id": self._run.id},
                )
        self._hooks.share_answered(share.address)
        self._hooks.share_ended(share.address)

    async def stop_watching(self) -> None:
        """Stops reading the shares' streams; their jobs go on."""
        tasks = [t for t in self._watchers.values() if t is not asyncio.current_task()]
        self._watchers = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one share -----------------------------------------------------------------------------

    async def _watch(self, share: Share, stream: TrainerStream) -> None:
        try:
            await self._read(share, stream)
        except TrainerBusy as exc:
            self._no_job.add(share.address)
            self._failed(share, exc)
        except TrainerError as exc:
            self._failed(share, exc)
        except Exception as exc:  # a bug in a stream must end the job, not hang it
            _LOGGER.exception("run %s: reading its share on %s failed", self._run.id, share)
            self._failed(share, TrainerCrashed(f"trainer {share.address}: {exc}"))
        else:
            self._no_job.add(share.address)
            _LOGGER.info(
                "run %s: its share on %s ended",
                self._run.id,
                self._placement.who(share),
                extra={"run_id": self._run.id},
            )
        finally:
            stream.cancel()
            self._hooks.share_answered(share.address)

    async def _read(self, share: Share, stream: TrainerStream) -> None:
        """Reads a share's stream to its end: heartbeats, nothing else of note."""
        timeout = self._settings.heartbeat_timeout_s
        events = stream.__aiter__()
        while True:
            try:
                event = await next_event(events, timeout, f"no heartbeat from {share.address}")
            except StopAsyncIteration:
                return
            self._hooks.share_answered(share.address)
            if isinstance(event, episode_pb2.Episode):
                _LOGGER.warning(
                    "run %s: its share on %s sent episode %d; only rank 0's trainer streams "
                    "episodes (ignored)",
                    self._run.id,
                    self._placement.who(share),
                    event.episode,
                    extra={"run_id": self._run.id},
                )

    def _failed(self, share: Share, exc: TrainerError) -> None:
        failure = ShareFailed(self._placement.who(share), share.address, exc)
        run = self._run
        through = run.trainer_episode >= run.config.max_episodes
        if self._quiet or through or self._failure.done():
            _LOGGER.info(
                "run %s: its share on %s ended: %s",
                run.id,
                failure.who,
                exc,
                extra={"run_id": run.id},
            )
            return
        self._failure.set_result(failure)
