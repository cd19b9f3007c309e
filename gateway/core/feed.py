"""A run's trainer feed: the trainer stream read, checked against the contract and queued for
the publisher, a broken stream re-attached within the heartbeat timeout, and a job that a
previous gateway started taken over.

``Inbox`` is the bounded queue between the feed (which puts checked episodes) and the
publisher (which takes them at the run's pace); the driver owns it, so episodes received and
not yet published outlive a feed (a parked or restarted run keeps them). ``TrainerFeed`` owns
the stream: it knows the trainer, the contract checker and ``trainer_episode``, and nothing of
pacing, commits or grants beyond the callables it is given.

A job that spans trainers streams from rank 0's trainer; the feed passes on where the other
trainers' ranks join it (``Rendezvous``) and says at once when its stream broke
(``stream_broke``, before the episodes received ahead of the break are published): the driver
starts and watches those shares (``gateway.core.shares``).

When a trainer is lost, and how fast (the rule):

- A stream that breaks (an error, not silence) is re-attached after the last episode it
  delivered, every ``REATTACH_BACKOFF_S``, for up to the heartbeat timeout: a network blip loses
  nothing and starts no second job.
- A re-attach whose connection the trainer's address refuses (``TrainerUnreachable``) ends the
  stream at once: no process listens there, so the trainer is gone and its jobs with it. The
  restart policy restarts the run from its checkpoint without waiting out the timeout.
- A re-attach that the trainer answers without the job (``TrainerJobGone``: it restarted on the
  same address) ends the stream at once too.
- A new job whose ``Train`` call is refused never ran: the run goes back in the queue
  (``TrainerGoneBeforeStart``, handled like a busy trainer), with no restart counted.
- A re-attach is never a job start (``attach_after_episode`` is always set): a trainer that came
  back on the same address cannot receive a second job of the run from it. Only the restart
  starts a new job, once.
- A silent trainer (stopped, or cut off by the network: connections hang or time out) is lost
  after ``heartbeat_timeout_s`` without an episode or heartbeat, then re-attached like a broken
  stream for up to the heartbeat timeout again, as a stopped process or a healed network still
  has its job.

A job started from a checkpoint (``resume_from``) says first where it started (``Resumed``);
it then trains again the episodes after that checkpoint that the run already received. Those
are checked and dropped: a watcher never sees an episode twice or changed. The first new
episode's ``best_reward`` continues the run's running maximum.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from gateway.core.observer import Observer
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.trainers import (
    CheckpointFailed,
    CheckpointSaved,
    JobPlacement,
    Rendezvous,
    Resumed,
    ResumePoint,
    StreamEvent,
    TrainerConnector,
    TrainerError,
    TrainerGoneBeforeStart,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
    TrainerStream,
    TrainerUnreachable,
    next_event,
)
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Seconds between two attempts to re-attach a broken stream.
REATTACH_BACKOFF_S = 0.25


class Inbox:
    """Episodes received and checked, not yet handed to the store (FIFO, bounded by its
    producer's ``cap``)."""

    __slots__ = ("_changed", "_items", "_taken")

    def __init__(self) -> None:
        self._items: deque[episode_pb2.Episode] = deque()
        self._changed = asyncio.Event()  # an episode arrived, or the producer ended
        self._taken = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def best_reward(self, before: float | None) -> float | None:
        """The running maximum after the episodes waiting here, starting from ``before``."""
        best = before
        for episode in self._items:
            best = episode.best_reward if best is None else max(best, episode.best_reward)
        return best

    async def put(self, episode: episode_pb2.Episode, cap: int) -> None:
        """Appends an episode once fewer than ``cap`` wait (a trainer that ignores its grants
        is held here, and HTTP/2 flow control then holds it)."""
        while len(self._items) >= cap:
            self._taken.clear()
            await self._taken.wait()
        self._items.append(episode)
        self._changed.set()

    def take(self) -> episode_pb2.Episode:
        """The oldest episode (the inbox must not be empty)."""
        episode = self._items.popleft()
        self._taken.set()
        return episode

    def wake(self) -> None:
        """Wakes the consumer (the producer ended)."""
        self._changed.set()

    async def changed(self) -> None:
        """Waits until an episode arrives or the producer ends."""
        self._changed.clear()
        await self._changed.wait()


class FeedHooks(Protocol):
    """What a feed tells its driver besides episodes."""

    async def answered(self) -> None:
        """Awaited on each message of the stream before it is handled (the first one releases
        the scheduler's reservation and starts a PENDING run)."""
        ...

    async def checkpoint_saved(self, saved: CheckpointSaved) -> None:
        """The trainer wrote a checkpoint (after an episode the run has received)."""
        ...

    def resumed(self, resumed: Resumed) -> None:
        """A job started from resume points says where it started."""
        ...

    def checkpoint_failed(self, failed: CheckpointFailed) -> None:
        """The trainer could not write a checkpoint; training goes on."""
        ...

    def rendezvous(self, rendezvous: Rendezvous) -> None:
        """Rank 0's trainer of a job that spans trainers says where the other ranks join."""
        ...

    def stream_broke(self, reason: str) -> None:
        """The stream broke (or went silent for the heartbeat timeout); it will be re-attached
        for up to the heartbeat timeout."""
        ...


class TrainerFeed:
    """Streams one run from its trainer into an ``Inbox`` (see the module docstring).

    Args:
        run: The run (the feed sets ``trainer_episode``, and starts a PENDING run on its first
            answer).
        trainer: The trainer's address.
        inbox: Where received episodes wait for the publisher (the driver's).
        connector: How to reach it.
        settings: Heartbeat timeout.
        observer: Metrics hooks.
        clock: Monotonic seconds (the re-attach deadline).
        hooks: The driver's ears for answers and checkpoint events.
        placement: Rank 0's share of a job that spans trainers (None: the whole job runs on
            ``trainer``).
    """

    def __init__(
        self,
        run: TrainingRun,
        trainer: str,
        inbox: Inbox,
        connector: TrainerConnector,
        settings: CoreSettings,
        observer: Observer,
        clock: Callable[[], float],
        hooks: FeedHooks,
        placement: JobPlacement | None = None,
    ) -> None:
        self.run = run
        self.trainer = trainer
        self.placement = placement
        self.inbox = inbox
        self._connector = connector
        self._settings = settings
        self._observer = observer
        self._clock = clock
        self._hooks = hooks
        self._received_best: float | None = run.best_reward if run.episode else None
        if run.trainer_episode > run.episode and inbox:
            self._received_best = inbox.best_reward(self._received_best)
        #: The last episode the job's streams delivered (re-trained ones included): where a
        #: re-attach continues.
        self._delivered = run.trainer_episode
        #: Episodes through this one were received before; a resumed job trains them again.
        self._drop_through = 0
        #: The running maximum of the job's own stream (what its contract check continues).
        self._checked_best = self._received_best

    async def stream(
        self,
        attach_after: int | None,
        opening_grant: Callable[[], int],
        cap: Callable[[], int],
        consume: Callable[[asyncio.Task[None]], Awaitable[None]],
        resume_from: Sequence[ResumePoint] = (),
    ) -> None:
        """Streams until ``consume`` returns (the done episode is published); re-attaches a
        broken stream after the last episode it delivered for up to the heartbeat timeout.

        Args:
            attach_after: None for a new job; else re-attach after this episode.
            opening_grant: The grant each ``Train`` call opens with.
            cap: How many episodes the inbox may hold.
            consume: The publisher: takes the inbox until the done episode and raises what
                the reader (the task it is given) raised.
            resume_from: For a new job: the checkpoints it may start from, newest first.

        Raises:
            TrainerUnreachable: A re-attach found the trainer's address refusing connections
                (at once, not after the heartbeat timeout).
            TrainerGoneBeforeStart: A new job's call was refused (the run is queued again).
            TrainerError, ContractViolation: how the run fails.
        """
        loop_deadline: float | None = None
        lost = ""  # why the stream broke
        after = attach_after
        if after is not None:
            self._delivered = after
        while True:
            # A new job's call sets up to check a fresh stream; one that finds the job alive
            # (taken over below) goes on checking the old stream from where it was.
            before = (self._drop_through, self._checked_best)
            try:
                await self._stream_once(after, opening_grant(), cap, consume, resume_from)
                return
            except TrainerJobGone as exc:
                if loop_deadline is None:
                    raise  # a restarted gateway's re-attach: the run was interrupted
                # The stream broke and the trainer no longer has the job: it was lost.
                raise TrainerLost(f"{lost}; then {exc}") from None
            except TrainerJobExists as exc:
                if after is not None:
                    # A re-attach (a takeover from another replica, or a restart) that came
                    # before the trainer saw the previous stream break: tried again within the
                    # heartbeat timeout.
                    now = self._clock()
                    if loop_deadline is None:
                        loop_deadline = now + self._settings.heartbeat_timeout_s
                        lost = str(exc)
                    elif now >= loop_deadline:
                        raise
                    await asyncio.sleep(REATTACH_BACKOFF_S)
                    continue
                # A job a previous gateway started before it crashed, or the job a restart
                # thought lost (its trainer was silent, then answered): take it over.
                self._drop_through, self._checked_best = before
                _LOGGER.info(
                    "run %s: trainer %s already runs its job; re-attaching",
                    self.run.id,
                    self.trainer,
                    extra={"run_id": self.run.id},
                )
                after = self._delivered
            except TrainerUnreachable as exc:
                if loop_deadline is None and after is None:
                    # A new job's call refused: nothing ran; placed again elsewhere.
                    raise TrainerGoneBeforeStart(str(exc)) from None
                # The trainer's address refuses connections: it is gone, its jobs with it.
                _LOGGER.warning(
                    "run %s: trainer %s refuses connections; its job is gone",
                    self.run.id,
                    self.trainer,
                    extra={"run_id": self.run.id},
                )
                raise TrainerUnreachable(f"{lost}; then {exc}" if lost else str(exc)) from None
            except TrainerLost as exc:
                if self.run.state is RunState.PENDING and after is None:
                    raise  # never started: nothing to re-attach to
                now = self._clock()
                if loop_deadline is None:
                    loop_deadline = now + self._settings.heartbeat_timeout_s
                    lost = str(exc)
                    _LOGGER.warning(
                        "run %s: stream from trainer %s broke (%s); re-attaching",
                        self.run.id,
                        self.trainer,
                        exc,
                        extra={"run_id": self.run.id},
                    )
                elif now >= loop_deadline:
                    raise
                after = self._delivered
                await asyncio.sleep(REATTACH_BACKOFF_S)

    async def _stream_once(
        self,
        after: int | None,
        grant: int,
        cap: Callable[[], int],
        consume: Callable[[asyncio.Task[None]], Awaitable[None]],
        resume_from: Sequence[ResumePoint],
    ) -> None:
        run = self.run
        checker = StreamChecker.for_task(run.task, run.config, run.id)
        if after:
            # Episodes received but not published stay in the inbox; a re-attach resumes
            # after them.
            checker.resume(after, self._checked_best)
        if after is None:
            # A new job: whatever it trains again up to what the run received is dropped.
            self._drop_through = run.trainer_episode
            self._checked_best = None
        stream = self._connector.train(
            self.trainer, run.id, run.task, run.config, grant, after, resume_from, self.placement
        )
        reader = asyncio.create_task(
            self._read(stream, checker, cap()), name=f"gateway-read-{run.id}"
        )
        reader.add_done_callback(lambda _: self.inbox.wake())
        try:
            await consume(reader)
        finally:
            reader.cancel()
            stream.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, stream: TrainerStream, checker: StreamChecker, cap: int) -> None:
        """Reads the stream into the inbox until its done episode (or its end)."""
        timeout = self._settings.heartbeat_timeout_s
        events = stream.__aiter__()
        while True:
            try:
                silent = f"no episode or heartbeat from {self.trainer}"
                event = await next_event(events, timeout, silent)
            except StopAsyncIteration:
                checker.finish()
                return
            except TrainerLost as exc:
                self._hooks.stream_broke(str(exc))
                raise
            await self._hooks.answered()
            if event is None:
                self._observer.heartbeat_received(self.run.id)
                continue
            if not isinstance(event, episode_pb2.Episode):
                await self._checkpoint_event(event, checker)
                continue
            self._observer.episode_received(self.run.id)
            checker.check(event)
            self._delivered = event.episode
            self._checked_best = event.best_reward
            if event.episode <= self._drop_through:
                continue  # trained again after a restart from a checkpoint: received before
            if event.done:
                # Rule 3: nothing may follow the done episode. The trainer closes its stream
                # right after it, so confirming that costs one read, and a bad stream never
                # gets to publish a done episode.
                await self._expect_end(events, checker)
            if self._drop_through and self._received_best is not None:
                # The run's running maximum goes on from what its watchers saw.
                event.best_reward = max(self._received_best, event.reward)
            self.run.received_through(event.episode)
            self._received_best = event.best_reward
            await self.inbox.put(event, cap)
            if event.done:
                return

    async def _checkpoint_event(
        self,
        event: CheckpointSaved | Resumed | CheckpointFailed | Rendezvous,
        checker: StreamChecker,
    ) -> None:
        if isinstance(event, Rendezvous):
            self._hooks.rendezvous(event)
        elif isinstance(event, Resumed):
            if event.episode:
                checker.resume(event.episode, event.best_reward)
                self._checked_best = event.best_reward
            self._delivered = event.episode
            self._hooks.resumed(event)
        elif isinstance(event, CheckpointSaved):
            await self._hooks.checkpoint_saved(event)
        else:
            self._hooks.checkpoint_failed(event)

    async def _expect_end(self, events: AsyncIterator[StreamEvent], checker: StreamChecker) -> None:
        """Reads the stream after the done episode to its end (heartbeats are tolerated).

        Raises:
            ContractViolation: an episode followed the done episode.
        """
        run_id = self.run.id
        try:
            async with asyncio.timeout(self._settings.heartbeat_timeout_s):
                while True:
                    event = await events.__anext__()
                    if isinstance(event, episode_pb2.Episode):
                        checker.check(event)  # raises: rule "done"
                    elif event is not None:
                        await self._checkpoint_event(event, checker)  # the final checkpoint
        except StopAsyncIteration:
            return
        except TimeoutError:
            _LOGGER.warning(
                "run %s: trainer %s kept the stream open after done",
                run_id,
                self.trainer,
                extra={"run_id": run_id},
            )
        except TrainerError as exc:  # the episodes are complete; the trainer's end is not ours
            _LOGGER.warning(
                "run %s: trainer %s failed after done: %s",
                run_id,
                self.trainer,
                exc,
                extra={"run_id": run_id},
            )
