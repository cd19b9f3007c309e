"""The trainer feed of a run: the trainer stream read into the run's buffer, a broken stream
re-attached, and a job a previous gateway started taken over (the invariants are in
``gateway.core.driver``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from gateway.core.driver_context import DriverState
from gateway.core.driver_publish import MAX_UNCOMMITTED
from gateway.core.runs import RunState
from gateway.core.trainers import (
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


class FeedMixin(DriverState):
    """Reads the trainer stream (``RunDriver``'s part; see ``DriverState``)."""

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
