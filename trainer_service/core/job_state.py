"""What one job's parts share: :class:`JobState`, the job's state under its one condition.

A job (``trainer_service.core.job``) is a producer thread (``job_producer``), the choice of the
checkpoint it resumes from (``job_resume``), another trainer's share of a job spanning trainers
(``job_share``) and the read side its streams poll (``job_reader``). Each of them reads and
writes this state; none keeps its own copy of it.

Invariants:

- Every change a waiter may wait for is made with :attr:`JobState.cond` held and followed by
  :meth:`JobState.notify`, which wakes the producer (waiting on the condition) and every stream
  being read (through its waker).
- ``stopped`` is set once, by the producer, after the provider has stopped; ``stop_reason`` is
  set at most once (``cancelled`` or ``shutdown``) and never after ``stopped``.
- ``resumed`` is set at most once, and only for a job with ``resume_from``; episodes are
  numbered from ``start_episode + 1``, which is fixed before the first episode is held.
- ``phase`` reads ``waiting`` exactly while the producer is blocked at its credit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainer_service.core.job_stream import JobStream
from trainer_service.core.job_window import EpisodeWindow
from trainwire import contract
from trainwire.v1 import trainer_service_pb2


class JobState:
    """One job's shared state, guarded by :attr:`cond`.

    Args:
        run_id: The job's run.
        checker: The job's stream-contract checker.
        window: The job's held episodes and credit.
        resume_from: Checkpoints to start from, newest first (none: from scratch).

    Attributes:
        cond: The condition every field below is read and written under (the phase fields
            excepted: they are single writes read for heartbeats).
        window: The held episodes and the credit.
        checker: The stream-contract checker of the job's episodes.
        stream: The attached stream (None: detached).
        wakers: The wakers of the streams still being read.
        stopped: The producer exited.
        error: What the provider (or the checker) raised.
        stop_reason: ``cancelled`` or ``shutdown`` once stopped from outside ("" before).
        waiting: The producer is blocked at its credit.
        provider_phase: What the provider last said it does (``loading`` first, ``finishing``
            once it stopped).
        resume_from: Checkpoints to start from, newest first.
        resumed: Where a job with ``resume_from`` started; None until decided.
        start_episode: The episode the job continues after (0: from scratch).
        rendezvous: Where the other trainers' ranks meet rank 0's job, once announced.
        share_ended: A share's provider returned: the share's part is done.
    """

    def __init__(
        self,
        run_id: str,
        checker: contract.StreamChecker,
        window: EpisodeWindow,
        resume_from: Sequence[trainer_service_pb2.CheckpointRef] = (),
    ) -> None:
        self.run_id = run_id
        self.cond = threading.Condition()
        self.window = window
        self.checker = checker
        self.stream: JobStream[Any] | None = None
        self.wakers: set[Callable[[], None]] = set()
        self.stopped = False
        self.error: BaseException | None = None
        self.stop_reason = ""
        self.waiting = False
        self.provider_phase = "loading"
        self.resume_from = tuple(resume_from)
        self.resumed: trainer_service_pb2.Resumed | None = None
        self.start_episode = 0
        self.rendezvous: trainer_service_pb2.Rendezvous | None = None
        self.share_ended = False

    def notify(self) -> None:
        """Wakes every waiter: the producer on the condition and the streams through their
        wakers (call with the condition held)."""
        self.cond.notify_all()
        for waker in self.wakers:
            waker()

    @property
    def phase(self) -> str:
        """What the job is doing now (``waiting`` while blocked at its credit)."""
        return "waiting" if self.waiting and not self.stopped else self.provider_phase

    @property
    def finished(self) -> bool:
        """Whether the job did all it had to: its done episode is out, or (a share) its
        provider returned."""
        return self.checker.done or self.share_ended

    def resumed_or_plain(self) -> bool:
        """Whether the job's start is decided (it restored, or needed not)."""
        return not self.resume_from or self.resumed is not None

    def start_at(self, episode: int) -> None:
        """Numbers the job's episodes from ``episode + 1`` (call with the condition held)."""
        self.start_episode = episode
        cursor = self.stream.cursor if self.stream is not None else 0
        self.window.start_at(episode, cursor)
        self.notify()

    def wait_credit(self, n: int) -> bool:
        """Blocks until episode ``n`` may be produced; False once the job is stopped."""
        with self.cond:
            if self.window.allows(n) or self.stop_reason:
                return not self.stop_reason
            self.waiting = True
            try:
                self.cond.wait_for(lambda: self.stop_reason or self.window.allows(n))
            finally:
                self.waiting = False
            return not self.stop_reason
