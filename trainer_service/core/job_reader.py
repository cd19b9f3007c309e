"""A job's read side: :class:`JobReader`, what the job's ``Train`` streams attach to and poll.

A stream (``trainer_service.core.job_stream.JobStream``, one per ``Train`` call) reads the held
episodes after its start point and ends with the job's outcome. The job
(``trainer_service.core.job``) is the ``StreamSource`` a stream knows; it hands every stream
call to its reader.

What a stream reads, in order: ``resumed`` (a job started with ``resume_from``, on a stream that
starts at or before the restored episode; only heartbeats before it), the rendezvous (rank 0's
job of one that spans trainers, once announced), each checkpoint event of the job once the
stream has sent its episode (again on a re-attach), then the episode after its cursor; once the
job stopped and the stream sent everything, the job's end.

Invariants: at most one stream is attached; one that attaches replaces the one before, which
ends with ``Reattached``. Only the attached stream's progress moves the job's credit. A job
outlives a broken stream: it is *detached* (blocked at its credit) until another stream
attaches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from trainer_service.core.checkpointing import CheckpointEvent, JobCheckpoints
from trainer_service.core.errors import EpisodesNotHeld, JobCancelled, Reattached, ShuttingDown
from trainer_service.core.job_state import JobState
from trainer_service.core.job_stream import Heartbeat, JobEnd, JobStream, StreamEvent, StreamSource
from trainer_service.core.observe import JobObserver

SourceT = TypeVar("SourceT", bound=StreamSource)


def attach_range(
    first: int, produced: int, start: int, resume_from: Sequence[int], decided: bool
) -> tuple[int, int]:
    """The episodes a new stream of a job may start after (``low..high``): those it holds
    (``first - 1 .. produced``). A job with resume candidates (``resume_from``: their episodes)
    still at its start (``produced == start``: restoring, or restored and nothing produced
    since) takes any start point from 0 (such a stream gets ``resumed`` first and continues
    from there), and, while its choice is not ``decided``, up to its newest candidate."""
    at_start = bool(resume_from) and produced == start
    low = 0 if at_start else first - 1
    high = produced
    if resume_from and not decided:
        high = max(resume_from)
    return low, high


class JobReader:
    """The read side of one job (thread-safe).

    Args:
        state: The job's shared state.
        kind: The task kind, for metrics.
        checkpoints: The job's checkpoints (their events go out on the streams); None when
            the trainer has no checkpoint store.
        observer: Hears of episodes and heartbeats sent.
    """

    def __init__(
        self,
        state: JobState,
        kind: str,
        checkpoints: JobCheckpoints | None,
        observer: JobObserver,
    ) -> None:
        self._state = state
        self._kind = kind
        self._checkpoints = checkpoints
        self._observer = observer

    @property
    def attached(self) -> bool:
        """Whether a stream is attached."""
        return self._state.stream is not None

    def attach(self, source: SourceT, after_episode: int, grant: int) -> JobStream[SourceT]:
        """A new stream of ``source`` (the job) reading the episodes after ``after_episode``;
        replaces any attached stream and moves the grant to ``grant`` if that is later.

        Raises:
            EpisodesNotHeld: Those episodes are no longer (or not yet) held.
        """
        state = self._state
        with state.cond:
            window = state.window
            first = window.first
            low, high = attach_range(
                first,
                window.produced,
                state.start_episode,
                [ref.checkpoint.episode for ref in state.resume_from],
                state.resumed is not None,
            )
            if not low <= after_episode <= high:
                raise EpisodesNotHeld(state.run_id, after_episode, first, window.produced)
            previous = state.stream
            stream = JobStream(source, after_episode)
            state.stream = stream
            window.cursor = max(after_episode, state.start_episode)
            window.move_grant(grant)
            state.notify()
        if previous is not None:
            previous.replaced = True
        return stream

    def detach(self, stream: JobStream[Any]) -> bool | None:
        """Called when ``stream``'s RPC ended. Returns None when ``stream`` was not attached (any
        more), else whether the job is left undelivered (the stream broke before the job's end),
        so the runner keeps it for a re-attach."""
        state = self._state
        with state.cond:
            if state.stream is not stream:
                return None
            state.stream = None
            state.notify()
            return not stream.finished

    def next_event(self, stream: JobStream[Any]) -> StreamEvent | None:
        """The stream's next event if there is one, else None (see the module docstring).

        Raises:
            Reattached: another stream replaced this one.
            ShuttingDown: the trainer is shutting down.
            JobCancelled: the job was cancelled (``CancelJob``).
            JobEnd: the job ended and the stream has sent everything.
        """
        state = self._state
        with state.cond:
            if stream.replaced or state.stream is not stream:
                raise Reattached(state.run_id)
            if state.stop_reason == "shutdown" and not state.finished:
                raise ShuttingDown(state.run_id)
            if state.resume_from and not stream.resumed_sent:
                if state.resumed is None and not state.stopped:
                    return None  # still restoring: heartbeats only
                # (A job that failed before it decided has no resumed: its end follows.)
                stream.resumed_sent = True
                if stream.cursor <= state.start_episode:
                    stream.cursor = state.start_episode
                    if state.resumed is not None:
                        return state.resumed
            if state.rendezvous is not None and not stream.rendezvous_sent:
                stream.rendezvous_sent = True
                return state.rendezvous
            checkpoint = self._checkpoint_event(stream)
            if checkpoint is not None:
                return checkpoint.to_proto()
            n = stream.cursor + 1
            if n <= state.window.produced:
                return state.window.episode(n)
            if not state.stopped:
                return None
            if state.stop_reason == "cancelled" and not state.finished:
                raise JobCancelled(state.run_id)
            raise JobEnd(state.error)

    def _checkpoint_event(self, stream: JobStream[Any]) -> CheckpointEvent | None:
        """The stream's next checkpoint event, once it sent the episode (call with the
        condition held)."""
        if self._checkpoints is None:
            return None
        event = self._checkpoints.event(stream.checkpoints_sent)
        if event is None or event.episode > stream.cursor:
            return None
        stream.checkpoints_sent += 1
        return event

    def sent(self, stream: JobStream[Any], episode: int) -> None:
        """``stream``'s RPC wrote ``episode``: moves its cursor and, if attached, the credit."""
        state = self._state
        with state.cond:
            stream.cursor = episode
            if state.stream is stream:
                state.window.cursor = episode
                state.notify()
        self._observer.episode_sent(self._kind)

    def heartbeat(self, stream: JobStream[Any]) -> Heartbeat:
        """A heartbeat for ``stream`` now, counted as sent."""
        self._observer.heartbeat_sent(self._kind)
        return Heartbeat(stream.cursor, self._state.phase, time.time_ns())

    def add_waker(self, waker: Callable[[], None]) -> None:
        """Calls ``waker`` (with the job's condition held) whenever the job changes."""
        with self._state.cond:
            self._state.wakers.add(waker)

    def remove_waker(self, waker: Callable[[], None]) -> None:
        """Stops calling ``waker``."""
        with self._state.cond:
            self._state.wakers.discard(waker)

    def wake(self) -> None:
        """Wakes the producer and the streams (a checkpoint was committed)."""
        with self._state.cond:
            self._state.notify()
