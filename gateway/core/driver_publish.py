"""The publisher of a run: episodes from the buffer to the store at the run's pace (none while
paused), visible once committed, and the credit granted to the trainer as they are (the
invariants are in ``gateway.core.driver``)."""

from __future__ import annotations

import asyncio
import logging
import math

from gateway.core.driver_context import DriverState
from gateway.core.history import encode_frame
from gateway.core.runs import RunState
from gateway.core.store import EpisodeRecord, NotOwner
from gateway.core.trainers import TrainerError
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger("gateway.core.driver")

#: Episodes a run may have handed to the store but not yet seen committed; the publisher waits
#: beyond this.
MAX_UNCOMMITTED = 256
#: The smallest lead a paced run is granted, in episodes.
MIN_LEAD = 4
#: The credit window of an unpaced run, in episodes (far below what a trainer holds for a
#: re-attach, 1024 by default).
UNPACED_WINDOW = 256


class PublishMixin(DriverState):
    """Publishes and grants (``RunDriver``'s part; see ``DriverState``)."""

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
