"""A run's trainer feed: the trainer stream read, checked against the contract and queued for
the publisher, a broken stream re-attached within the heartbeat timeout, and a job that a
previous gateway started taken over.

``Inbox`` is the bounded queue between the feed (which puts checked episodes) and the
publisher (which takes them at the run's pace). ``TrainerFeed`` owns the stream: it knows the
trainer, the contract checker and ``trainer_episode``, and nothing of pacing, commits or grants
beyond the two callables it is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.core.observer import Observer
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.trainers import (
    TrainerConnector,
    TrainerError,
    TrainerJobExists,
    TrainerJobGone,
    TrainerLost,
    TrainerStream,
)
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger("gateway.core.driver")

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


class TrainerFeed:
    """Streams one run from its trainer into an ``Inbox`` (see the module docstring).

    Args:
        run: The run (the feed sets ``trainer_episode``, and starts a PENDING run on its first
            answer).
        trainer: The trainer's address.
        connector: How to reach it.
        settings: Heartbeat timeout.
        observer: Metrics hooks.
        clock: Monotonic seconds (the re-attach deadline).
        on_answer: Awaited on each message of the stream before it is handled (the first one
            releases the scheduler's reservation and starts a PENDING run).
    """

    def __init__(
        self,
        run: TrainingRun,
        trainer: str,
        connector: TrainerConnector,
        settings: CoreSettings,
        observer: Observer,
        clock: Callable[[], float],
        on_answer: Callable[[], Awaitable[None]],
    ) -> None:
        self.run = run
        self.trainer = trainer
        self.inbox = Inbox()
        self._connector = connector
        self._settings = settings
        self._observer = observer
        self._clock = clock
        self._on_answer = on_answer
        self._received_best: float | None = run.best_reward if run.episode else None

    async def stream(
        self,
        attach_after: int | None,
        opening_grant: Callable[[], int],
        cap: Callable[[], int],
        consume: Callable[[asyncio.Task[None]], Awaitable[None]],
    ) -> None:
        """Streams until ``consume`` returns (the done episode is published); re-attaches a
        broken stream after ``trainer_episode`` for up to the heartbeat timeout.

        Args:
            attach_after: None for a new job; else re-attach after this episode.
            opening_grant: The grant each ``Train`` call opens with.
            cap: How many episodes the inbox may hold.
            consume: The publisher: takes the inbox until the done episode and raises what
                the reader (the task it is given) raised.

        Raises:
            TrainerError, ContractViolation: how the run fails.
        """
        loop_deadline: float | None = None
        lost = ""  # why the stream broke
        after = attach_after
        while True:
            try:
                await self._stream_once(after, opening_grant(), cap, consume)
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
                # A job a previous gateway started before it crashed: take it over.
                _LOGGER.info(
                    "run %s: trainer %s already runs its job; re-attaching",
                    self.run.id,
                    self.trainer,
                    extra={"run_id": self.run.id},
                )
                after = self.run.trainer_episode
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
                after = self.run.trainer_episode
                await asyncio.sleep(REATTACH_BACKOFF_S)

    async def _stream_once(
        self,
        after: int | None,
        grant: int,
        cap: Callable[[], int],
        consume: Callable[[asyncio.Task[None]], Awaitable[None]],
    ) -> None:
        run = self.run
        checker = StreamChecker.for_task(run.task, run.config, run.id)
        if after:
            # Episodes received but not published stay in the inbox; a re-attach resumes
            # after them.
            checker.resume(after, self._received_best)
        stream = self._connector.train(self.trainer, run.id, run.task, run.config, grant, after)
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
                async with asyncio.timeout(timeout):
                    event = await events.__anext__()
            except StopAsyncIteration:
                checker.finish()
                return
            except TimeoutError:
                raise TrainerLost(
                    f"no episode or heartbeat from {self.trainer} for {timeout:g} s"
                ) from None
            await self._on_answer()
            if event is None:
                self._observer.heartbeat_received(self.run.id)
                continue
            self._observer.episode_received(self.run.id)
            checker.check(event)
            if event.done:
                # Rule 3: nothing may follow the done episode. The trainer closes its stream
                # right after it, so confirming that costs one read, and a bad stream never
                # gets to publish a done episode.
                await self._expect_end(events, checker)
            self.run.trainer_episode = event.episode
            self._received_best = event.best_reward
            await self.inbox.put(event, cap)
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
            async with asyncio.timeout(self._settings.heartbeat_timeout_s):
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
