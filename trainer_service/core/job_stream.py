"""What a ``Train`` call reads of a job: :class:`JobStream` (the held episodes after its start
point, heartbeats while none is ready, then the job's end) and :class:`Heartbeat`.

A stream reads through the job's read side (``RunningJob._next`` from a thread, ``_try`` from an
event loop, which the job's changes wake through :attr:`JobStream.waker`) and reports each
episode its RPC sent (``_sent``), which moves the job's credit. The job raises :class:`JobEnd`
to a stream that has sent everything once the job ended; the stream then returns, or raises the
job's failure. Jobs and their producer threads live in ``trainer_service.core.job``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from trainwire.v1 import episode_pb2

if TYPE_CHECKING:
    from trainer_service.core.job import RunningJob


@dataclass(frozen=True)
class Heartbeat:
    """A sign of life while no episode is ready.

    Attributes:
        last_episode: The last episode handed out on this stream, 0 before the first.
        phase: What the job is doing (``loading``, ``training``, ``waiting``, ``finishing``).
        time_ns: When it was produced, nanoseconds since the epoch.
    """

    last_episode: int
    phase: str
    time_ns: int


class JobEnd(Exception):
    """The job ended and its stream sent every episode; ``error`` is what the job raised."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__()
        self.error = error


class JobStream:
    """One ``Train`` call's view of a job: the episodes after its start point, then the end.

    Read it with :meth:`events` from a thread or :meth:`aevents` from an event loop.
    """

    def __init__(self, job: RunningJob, after_episode: int) -> None:
        self.job = job
        self.cursor = after_episode
        self.replaced = False
        self.finished = False
        #: Called (from any thread, with the job's condition held) when the job changed.
        self.waker: Callable[[], None] | None = None

    def events(self) -> Iterator[episode_pb2.Episode | Heartbeat]:
        """Yields episodes and heartbeats until the job ends (blocking; for threads).

        Returns normally after the done episode (or when the provider stopped early because the
        job was cancelled while detached, with nothing left to send).

        Raises:
            ProviderError: The provider failed with a message for users.
            ContractViolation: The stream broke the contract (logged where detected).
            ShuttingDown: The trainer is shutting down.
            JobCancelled: The job was cancelled.
            Reattached: Another stream replaced this one.
            Exception: Whatever else the provider raised (an unexpected failure).
        """
        job = self.job
        with job._cond:
            job._streams.add(self)
        try:
            last_sent = time.monotonic()
            while True:
                wait = max(0.0, job._heartbeat_s - (time.monotonic() - last_sent))
                episode = self._step(partial(job._next, self, wait))
                if episode is None:
                    if time.monotonic() - last_sent < job._heartbeat_s:
                        continue  # woken early (a grant, a phase change): nothing to send yet
                    yield self._heartbeat()
                else:
                    yield episode
                    self._sent(episode)
                last_sent = time.monotonic()
        except _Ended:
            return
        finally:
            with job._cond:
                job._streams.discard(self)

    async def aevents(self) -> AsyncIterator[episode_pb2.Episode | Heartbeat]:
        """Like :meth:`events`, for an event loop: waits without holding a thread."""
        job = self.job
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def waker() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(wake.set)

        self.waker = waker
        with job._cond:
            job._streams.add(self)
        try:
            last_sent = time.monotonic()
            while True:
                # Cleared before polling: a change after the poll sets it again, so no wake-up
                # is lost.
                wake.clear()
                episode = self._step(partial(job._try, self))
                if episode is None:
                    left = job._heartbeat_s - (time.monotonic() - last_sent)
                    if left > 0:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(left):
                                await wake.wait()
                        continue
                    yield self._heartbeat()
                else:
                    yield episode
                    self._sent(episode)
                last_sent = time.monotonic()
        except _Ended:
            return
        finally:
            self.waker = None
            with job._cond:
                job._streams.discard(self)

    def _step(self, take: Callable[[], episode_pb2.Episode | None]) -> episode_pb2.Episode | None:
        """One poll of the job; raises ``_Ended`` after a normal end, or the job's failure."""
        try:
            return take()
        except JobEnd as end:
            self.finished = True
            if end.error is not None:
                raise end.error from None
            raise _Ended from None

    def _heartbeat(self) -> Heartbeat:
        self.job._observer.heartbeat_sent(self.job.kind)
        return Heartbeat(self.cursor, self.job.phase, time.time_ns())

    def _sent(self, episode: episode_pb2.Episode) -> None:
        """The handler wrote ``episode`` and asks for more."""
        self.job._sent(self, episode.episode)
        self.job._observer.episode_sent(self.job.kind)


class _Ended(Exception):
    """The stream delivered the job's normal end."""
