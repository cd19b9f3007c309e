"""What a ``Train`` call reads of a job: :class:`JobStream` (the held episodes after its start
point and the job's checkpoint events, heartbeats while none is ready, then the job's end) and
:class:`Heartbeat`.

A stream knows its job only through :class:`StreamSource`, the job's read side: it polls the
job for its next event (:meth:`StreamSource.next_event`: where a resumed job started, the
rendezvous of a job that spans trainers, a checkpoint event whose episode it has sent, or the
episode after its cursor), reports each
episode its RPC sent (:meth:`StreamSource.sent`, which moves the job's credit), asks the job for a
heartbeat when none has gone out for :attr:`StreamSource.heartbeat_s` seconds, and registers a
waker that the job calls (from any thread) whenever it changes. The job raises :class:`JobEnd`
to a stream that has sent everything once the job ended; the stream then returns, or raises the
job's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from trainwire.v1 import episode_pb2, trainer_service_pb2

#: What a stream yields besides heartbeats: an episode, a checkpoint event (``resumed`` first
#: on a job started from a checkpoint, ``checkpoint`` / ``checkpoint_failure`` after their
#: episode), or the rendezvous of a job that spans trainers (before any episode).
StreamEvent: TypeAlias = (
    episode_pb2.Episode
    | episode_pb2.Checkpoint
    | trainer_service_pb2.CheckpointFailure
    | trainer_service_pb2.Resumed
    | trainer_service_pb2.Rendezvous
)


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


class StreamSource(Protocol):
    """The read side of a job, as its streams see it (thread-safe)."""

    @property
    def heartbeat_s(self) -> float:
        """Seconds without an episode after which a stream sends a heartbeat."""
        ...

    def next_event(self, stream: JobStream[Any]) -> StreamEvent | None:
        """The stream's next event (a checkpoint event, or the episode after ``stream.cursor``)
        if there is one, else None.

        Raises:
            JobEnd: The job ended and ``stream`` has sent everything.
            Exception: The domain error that ends ``stream`` (replaced, cancelled, shutdown).
        """
        ...

    def sent(self, stream: JobStream[Any], episode: int) -> None:
        """``stream``'s RPC wrote ``episode`` and asks for more."""
        ...

    def heartbeat(self, stream: JobStream[Any]) -> Heartbeat:
        """A heartbeat for ``stream`` (counted as sent)."""
        ...

    def add_waker(self, waker: Callable[[], None]) -> None:
        """Calls ``waker`` (from any thread) whenever the job changes, until removed."""
        ...

    def remove_waker(self, waker: Callable[[], None]) -> None:
        """Stops calling ``waker``."""
        ...


SourceT = TypeVar("SourceT", bound=StreamSource)


class JobStream(Generic[SourceT]):
    """One ``Train`` call's view of a job: the episodes after its start point, then the end.

    Read it with :meth:`aevents` from an event loop; it waits without holding a thread.

    Attributes:
        job: The job it reads.
        cursor: The last episode handed out on this stream (its start point before the first).
        replaced: Set by the job when another stream attached in its place.
        finished: Set once the stream delivered the job's end.
        resumed_sent: Whether the job's ``resumed`` went out on this stream.
        rendezvous_sent: Whether the job's rendezvous went out on this stream.
        checkpoints_sent: How many of the job's checkpoint events went out on this stream.
    """

    def __init__(self, job: SourceT, after_episode: int) -> None:
        self.job = job
        self.cursor = after_episode
        self.replaced = False
        self.finished = False
        self.resumed_sent = False
        self.rendezvous_sent = False
        self.checkpoints_sent = 0

    async def aevents(self) -> AsyncGenerator[StreamEvent | Heartbeat, None]:
        """Yields episodes, checkpoint events and heartbeats until the job ends.

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
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def waker() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(wake.set)

        job.add_waker(waker)
        try:
            last_sent = time.monotonic()
            while True:
                # Cleared before polling: a change after the poll sets it again, so no wake-up
                # is lost.
                wake.clear()
                event = self._next()
                if event is None:
                    left = job.heartbeat_s - (time.monotonic() - last_sent)
                    if left > 0:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(left):
                                await wake.wait()
                        continue
                    yield job.heartbeat(self)
                else:
                    yield event
                    if isinstance(event, episode_pb2.Episode):
                        job.sent(self, event.episode)
                last_sent = time.monotonic()
        except _Ended:
            return
        finally:
            job.remove_waker(waker)

    def _next(self) -> StreamEvent | None:
        """One poll of the job; raises ``_Ended`` after a normal end, or the job's failure."""
        try:
            return self.job.next_event(self)
        except JobEnd as end:
            self.finished = True
            if end.error is not None:
                raise end.error from None
            raise _Ended from None


class _Ended(Exception):
    """The stream delivered the job's normal end."""
