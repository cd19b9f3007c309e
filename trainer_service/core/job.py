"""One training job: its provider thread, its credit gate, and the streams attached to it.

The provider generator runs in a thread the job owns (the *producer*). Before it pulls episode
``n`` from the generator it waits for *credit*; the job holds its last episodes for a re-attach.
The credit rule and the held episodes are bookkeeping in ``trainer_service.core.job_window``;
here the producer waits on them under the job's condition. While it waits, the job's phase reads
``waiting`` (it goes into heartbeats). Every episode is checked against the stream contract in
the producer, before any stream can send it.

A *stream* (``trainer_service.core.job_stream.JobStream``, one per ``Train`` call) reads the held
episodes after its start point through the job's read side (the last section of
:class:`RunningJob`, the ``StreamSource`` a stream knows its job by) and ends with the job's
outcome. A job outlives a broken stream: it is *detached* (blocked at its credit) until another
stream re-attaches or the runner's detach grace runs out. A second stream that attaches
replaces the first, which ends with ``Reattached``.

Invariant: the producer releases the job's slot (``on_exit``) once the provider has stopped,
before the outcome is delivered to any stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from trainer_service.core.errors import (
    EpisodesNotHeld,
    JobCancelled,
    Reattached,
    ShuttingDown,
)
from trainer_service.core.job_stream import Heartbeat, JobEnd, JobStream
from trainer_service.core.job_window import EpisodeWindow
from trainer_service.core.observe import JobObserver, JobOutcome, NullJobObserver
from trainer_service.core.provider import ProviderError, TrainJob
from trainwire import contract
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

_OUTCOME_VERBS = {
    JobOutcome.OK: "finished",
    JobOutcome.ERROR: "failed",
    JobOutcome.CRASH: "failed unexpectedly",
    JobOutcome.CONTRACT_VIOLATION: "failed (contract violation)",
    JobOutcome.CANCELLED: "cancelled",
    JobOutcome.SHUTDOWN: "stopped by shutdown",
}


class RunningJob:
    """One training job. Created by ``JobRunner`` with a slot already taken.

    Args:
        job: What the provider runs.
        provider: The provider (``run(job)`` yields episodes).
        kind: The task kind (``imitation``, ``grpo``), for logs and metrics.
        heartbeat_s: Seconds without an episode after which a stream sends a heartbeat.
        queue_size: Episodes the producer may run ahead of an attached stream without a grant.
        retain: Episodes held for a re-attach (at least ``queue_size``).
        grant: The initial grant (0: none).
        on_exit: Called from the producer thread once the provider has stopped.
        observer: Hears of the job's end, episodes and heartbeats sent and contract violations.
    """

    def __init__(
        self,
        job: TrainJob,
        provider: Any,
        kind: str,
        heartbeat_s: float,
        queue_size: int,
        retain: int,
        grant: int,
        on_exit: Callable[[RunningJob], None],
        observer: JobObserver | None = None,
    ) -> None:
        self.run_id = job.run_id
        self.kind = kind
        self.task = job.task
        self.config = job.config
        self.devices = job.devices or (job.device,)
        self._job = job
        self._provider = provider
        self.heartbeat_s = heartbeat_s
        self._on_exit = on_exit
        self._observer: JobObserver = observer or NullJobObserver()
        self._checker = contract.StreamChecker.for_task(job.task, job.config, job.run_id)
        self._cond = threading.Condition()
        self._window = EpisodeWindow(queue_size, retain, grant)
        self._stream: JobStream[RunningJob] | None = None
        self._wakers: set[Callable[[], None]] = set()  # of the streams still being read
        self._stopped = False  # the producer exited
        self._error: BaseException | None = None  # what the provider (or the checker) raised
        self._stop_reason = ""  # "cancelled" or "shutdown" once stopped from outside
        self._waiting = False
        self._phase = "loading"
        self._outcome: JobOutcome | None = None
        self.exited = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, name=f"trainwire-job-{job.run_id}", daemon=True
        )

    # -- state -------------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wakes every waiter: the producer on the condition and the streams through their
        wakers (call with the condition held)."""
        self._cond.notify_all()
        for waker in self._wakers:
            waker()

    @property
    def phase(self) -> str:
        """What the job is doing now (``waiting`` while blocked at its credit)."""
        return "waiting" if self._waiting and not self._stopped else self._phase

    def set_phase(self, phase: str) -> None:
        """Records the provider's phase (for heartbeats)."""
        self._phase = phase

    @property
    def produced(self) -> int:
        """The last episode the provider produced (0 before the first)."""
        return self._window.produced

    @property
    def grant(self) -> int:
        """The last episode the job may produce (0: no grant)."""
        return self._window.grant

    @property
    def attached(self) -> bool:
        """Whether a stream is attached."""
        return self._stream is not None

    @property
    def stopped(self) -> bool:
        """Whether the provider has stopped (finished, failed or cancelled)."""
        return self._stopped

    @property
    def outcome(self) -> JobOutcome | None:
        """How the job ended; ``None`` while it runs."""
        return self._outcome

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the producer thread to exit; returns whether it did."""
        return self.exited.wait(timeout)

    # -- control -----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the producer thread."""
        self._thread.start()

    def move_grant(self, through_episode: int) -> int:
        """Lets the job produce up to ``through_episode`` (grants only move forward); returns the
        last produced episode."""
        with self._cond:
            if self._window.move_grant(through_episode):
                self._notify()
            return self._window.produced

    def cancel(self, reason: str = "cancelled") -> None:
        """Stops the job at its next episode; idempotent, callable from any thread.

        Args:
            reason: ``cancelled`` (``CancelJob``, a detach that expired) or ``shutdown``.
        """
        with self._cond:
            if not self._stop_reason and not self._stopped:
                self._stop_reason = reason
            self._notify()
        self._job.stop_event.set()

    def attach(self, after_episode: int, grant: int) -> JobStream[RunningJob]:
        """A new stream of the episodes after ``after_episode``; replaces any attached stream.

        Raises:
            EpisodesNotHeld: Those episodes are no longer (or not yet) held.
        """
        with self._cond:
            window = self._window
            first = window.first
            if not first - 1 <= after_episode <= window.produced:
                raise EpisodesNotHeld(self.run_id, after_episode, first, window.produced)
            previous = self._stream
            stream = JobStream(self, after_episode)
            self._stream = stream
            window.cursor = after_episode
            window.move_grant(grant)
            self._notify()
        if previous is not None:
            previous.replaced = True
        return stream

    def detach(self, stream: JobStream[RunningJob]) -> bool | None:
        """Called when ``stream``'s RPC ended. Returns None when ``stream`` was not attached (any
        more), else whether the job is left undelivered (the stream broke before the job's end),
        so the runner keeps it for a re-attach."""
        with self._cond:
            if self._stream is not stream:
                return None
            self._stream = None
            self._notify()
            return not stream.finished

    # -- the producer ------------------------------------------------------------------------

    def _wait_credit(self, n: int) -> bool:
        """Blocks until episode ``n`` may be produced; False once the job is stopped."""
        with self._cond:
            if self._window.allows(n) or self._stop_reason:
                return not self._stop_reason
            self._waiting = True
            try:
                self._cond.wait_for(lambda: self._stop_reason or self._window.allows(n))
            finally:
                self._waiting = False
            return not self._stop_reason

    def _produce(self) -> None:
        """The producer thread: pulls the provider's generator, one credited episode at a time."""
        error: BaseException | None = None
        episodes: Iterator[episode_pb2.Episode] | None = None
        try:
            episodes = self._provider.run(self._job)
            while True:
                # After the done episode the generator may only end: no credit needed to see it.
                if not self._checker.done and not self._wait_credit(self._window.produced + 1):
                    break
                try:
                    episode = next(episodes)
                except StopIteration:
                    if not self._job.stop_event.is_set():
                        self._checker.finish()
                    break
                if self._job.stop_event.is_set():
                    break
                self._checker.check(episode)
                self._hold(episode)
        except contract.ContractViolation as exc:
            _LOGGER.error(
                "CONTRACT VIOLATION run %s rule %s: %s",
                self.run_id,
                exc.rule,
                exc,
                extra={"run_id": self.run_id, "rule": exc.rule},
            )
            self._observer.contract_violation(self.kind, exc.rule)
            error = exc
        except BaseException as exc:  # delivered to the stream, which maps it to a status
            error = exc
        finally:
            self._phase = "finishing"
            if episodes is not None and hasattr(episodes, "close"):
                try:
                    # Runs the provider's own cleanup (freeing model memory) before the slot
                    # is given back.
                    episodes.close()
                except Exception:
                    _LOGGER.exception("run %s: provider failed while stopping", self.run_id)
            self._on_exit(self)
            with self._cond:
                self._error = error
                self._stopped = True
                self._notify()
            self._conclude(self._outcome_of(error))
            self.exited.set()

    def _hold(self, episode: episode_pb2.Episode) -> None:
        with self._cond:
            self._window.hold(episode)
            self._notify()

    def _outcome_of(self, error: BaseException | None) -> JobOutcome:
        if self._stop_reason == "shutdown" and not self._checker.done:
            return JobOutcome.SHUTDOWN
        if error is None:
            return JobOutcome.OK if self._checker.done else JobOutcome.CANCELLED
        if isinstance(error, contract.ContractViolation):
            return JobOutcome.CONTRACT_VIOLATION
        if isinstance(error, ProviderError):
            return JobOutcome.ERROR
        return JobOutcome.CRASH

    def _conclude(self, outcome: JobOutcome) -> None:
        """Records the job's outcome once, logs it and reports it."""
        if self._outcome is not None:
            return
        self._outcome = outcome
        _LOGGER.info(
            "run %s: %s job %s at episode %d",
            self.run_id,
            self.kind,
            _OUTCOME_VERBS[outcome],
            self._window.produced,
            extra={"run_id": self.run_id, "outcome": outcome.value},
        )
        self._observer.job_ended(self.run_id, self.kind, outcome)

    # -- what streams read (the ``StreamSource`` of ``job_stream``) --------------------------

    def next_episode(self, stream: JobStream[RunningJob]) -> episode_pb2.Episode | None:
        """The episode after ``stream.cursor`` if held, else None.

        Raises:
            Reattached: another stream replaced this one.
            ShuttingDown: the trainer is shutting down.
            JobCancelled: the job was cancelled (``CancelJob``).
            JobEnd: the job ended and the stream has sent everything.
        """
        with self._cond:
            if stream.replaced or self._stream is not stream:
                raise Reattached(self.run_id)
            if self._stop_reason == "shutdown" and not self._checker.done:
                raise ShuttingDown(self.run_id)
            n = stream.cursor + 1
            if n <= self._window.produced:
                return self._window.episode(n)
            if not self._stopped:
                return None
            if self._stop_reason == "cancelled" and not self._checker.done:
                raise JobCancelled(self.run_id)
            raise JobEnd(self._error)

    def sent(self, stream: JobStream[RunningJob], episode: int) -> None:
        """``stream``'s RPC wrote ``episode``: moves its cursor and, if attached, the credit."""
        with self._cond:
            stream.cursor = episode
            if self._stream is stream:
                self._window.cursor = episode
                self._notify()
        self._observer.episode_sent(self.kind)

    def heartbeat(self, stream: JobStream[RunningJob]) -> Heartbeat:
        """A heartbeat for ``stream`` now, counted as sent."""
        self._observer.heartbeat_sent(self.kind)
        return Heartbeat(stream.cursor, self.phase, time.time_ns())

    def add_waker(self, waker: Callable[[], None]) -> None:
        """Calls ``waker`` (with the job's condition held) whenever the job changes."""
        with self._cond:
            self._wakers.add(waker)

    def remove_waker(self, waker: Callable[[], None]) -> None:
        """Stops calling ``waker``."""
        with self._cond:
            self._wakers.discard(waker)
