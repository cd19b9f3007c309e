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

A job started with ``resume_from`` first restores (in the producer): each candidate, newest
first, is fetched and verified (``trainer_service.core.checkpointing``) and handed to the
provider as ``TrainJob.resume``; a candidate that is missing, damaged, of another run that this
job may not continue (``checkpointing.check_fork``: a fork continues its parent's task with
other hyperparameters only) or that the provider finds ``CheckpointUnusable`` before its first
episode is skipped, and when none is left the job starts from scratch. The job's episodes are
numbered from the restored episode + 1; the window and the contract checker start there.
Streams send ``resumed`` before anything else but heartbeats, and each checkpoint event of the
job once they have sent its episode (again on a re-attach).

``cancel(checkpoint=True)`` (stop, park) asks the provider for a final checkpoint: the job takes
no more credit, lets the episode in flight finish and be held, then closes the provider's
generator, which writes the checkpoint of its last episode while it stops.

A job whose ranks span trainers (``TrainJob.placement``, see ``trainer_service.core.placement``)
is one job per trainer. Rank 0's job announces the rendezvous its provider bound
(:meth:`RunningJob.announce_rendezvous`); its streams send it after ``resumed`` and before any
episode. With ``resume_from``, announcing decides the start: the other trainers join on the
checkpoint being restored, so a later failure to load it fails the job instead of trying the
next candidate. Any other trainer's job is a *share*: it takes no credit, produces no episode
and ends OK when its provider returns (its streams send heartbeats meanwhile). A share with
``resume_from`` restores the first candidate (the checkpoint rank 0 restored) or fails with
``FAILED_PRECONDITION``: it never trains from scratch beside a resumed rank 0.

Invariant: the producer releases the job's slot (``on_exit``) once the provider has stopped,
before the outcome is delivered to any stream.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainer_service.core.checkpointing import (
    CheckpointEvent,
    JobCheckpoints,
    check_fork,
    fetch_candidate,
    skip_reason,
)
from trainer_service.core.errors import (
    EpisodesNotHeld,
    JobCancelled,
    JobFinished,
    Reattached,
    ShuttingDown,
)
from trainer_service.core.hyperparameters import Hyperparameters
from trainer_service.core.job_stream import Heartbeat, JobEnd, JobStream, StreamEvent
from trainer_service.core.job_window import EpisodeWindow
from trainer_service.core.observe import JobObserver, JobOutcome, NullJobObserver
from trainer_service.core.provider import (
    CheckpointUnusable,
    ProviderError,
    RestoredCheckpoint,
    TrainJob,
)
from trainwire import contract
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointError, CheckpointInfo

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
        checkpoints: The job's checkpoints (``job.checkpoints``); None when the trainer has no
            checkpoint store.
        resume_from: Checkpoints to start from, newest first (none: from scratch).
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
        checkpoints: JobCheckpoints | None = None,
        resume_from: Sequence[trainer_service_pb2.CheckpointRef] = (),
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
        self._checkpoints = checkpoints
        self._resume_from = tuple(resume_from)
        # Where a job with resume_from started: None until decided.
        self._resumed: trainer_service_pb2.Resumed | None = None
        self._restored: CheckpointInfo | None = None  # of this run, when one restored
        self.start_episode = 0  # the episode the job continues after (0: from scratch)
        placement = job.placement
        # Another trainer's share of a job that spans trainers: no episodes, no credit.
        self._share = placement is not None and not placement.hosts_rendezvous
        self._share_ended = False  # its provider returned: the share's part is done
        self._rendezvous: trainer_service_pb2.Rendezvous | None = None
        # The resume candidate being opened, as _decide takes it (None: none is).
        self._opening: (
            tuple[
                trainer_service_pb2.CheckpointRef,
                float,
                list[trainer_service_pb2.SkippedCheckpoint],
            ]
            | None
        ) = None
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
    def provider(self) -> Any:
        """The job's provider module."""
        return self._provider

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
    def finished(self) -> bool:
        """Whether the job did all it had to: its done episode is out, or (a share) its
        provider returned."""
        return self._checker.done or self._share_ended

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

    def cancel(self, reason: str = "cancelled", checkpoint: bool = False) -> None:
        """Stops the job at its next episode; idempotent, callable from any thread.

        Args:
            reason: ``cancelled`` (``CancelJob``, a detach that expired) or ``shutdown``.
            checkpoint: End with a checkpoint of the last episode: the episode in flight is
                finished and held, then the provider writes the checkpoint as it stops. Only
                once the job produced an episode (before that, and without a checkpoint store,
                the job stops at once).
        """
        with self._cond:
            if not self._stop_reason and not self._stopped:
                self._stop_reason = reason
            final = (
                checkpoint
                and self._checkpoints is not None
                and not self._stopped
                and self._resumed_or_plain()
                and self._window.produced > self.start_episode
            )
            self._notify()
        if final:
            assert self._checkpoints is not None
            self._checkpoints.request_final()
            # stop_event is set once the generator is closed (see _produce): a provider that
            # watches it must not abandon the step in flight or the final checkpoint.
        else:
            self._job.stop_event.set()

    def set_hyperparameters(self, change: Hyperparameters) -> tuple[Hyperparameters, int]:
        """Asks the provider to train with ``change`` from its next optimizer step; returns
        the values that step trains with and the last episode produced so far.

        Raises:
            JobFinished: The job produced its last episode, or stopped.
        """
        with self._cond:
            if self._stopped or self._stop_reason or self.finished:
                raise JobFinished(self.run_id, self._window.produced)
            values = self._job.hyperparameters.request(change)
            produced = self._window.produced
        _LOGGER.info(
            "run %s: hyperparameters %s from its next optimizer step (produced through "
            "episode %d; next step trains with %s)",
            self.run_id,
            change.describe(),
            produced,
            values.describe(),
            extra={"run_id": self.run_id, "event": "hyperparameters"},
        )
        return values, produced

    def _resumed_or_plain(self) -> bool:
        """Whether the job's start is decided (it restored, or needed not)."""
        return not self._resume_from or self._resumed is not None

    def final_checkpoint(self) -> tuple[CheckpointInfo | None, str]:
        """The checkpoint of the job's last episode once it stopped: its record, or why there is
        none."""
        with self._cond:
            produced = self._window.produced
            stopped = self._stopped
        if self._checkpoints is None:
            return None, "this trainer has no checkpoint store"
        event = self._checkpoints.of_episode(produced)
        if event is not None:
            return event.info, event.error
        if produced and produced == self.start_episode and self._restored is not None:
            return self._restored, ""  # nothing trained since the checkpoint it restored
        if not produced or produced == self.start_episode:
            return None, "the job had not trained an episode"
        if not stopped:
            return None, f"the final checkpoint at episode {produced} is not written yet"
        return None, f"the job ended at episode {produced} without a final checkpoint"

    def attach(self, after_episode: int, grant: int) -> JobStream[RunningJob]:
        """A new stream of the episodes after ``after_episode``; replaces any attached stream.

        Raises:
            EpisodesNotHeld: Those episodes are no longer (or not yet) held.
        """
        with self._cond:
            window = self._window
            first = window.first
            # A job still restoring, or restored, takes any start point up to where it
            # continues: such a stream gets ``resumed`` first and continues from there.
            low = 0 if self._resume_from and window.produced == self.start_episode else first - 1
            high = window.produced
            if self._resume_from and self._resumed is None:
                high = max(ref.checkpoint.episode for ref in self._resume_from)
            if not low <= after_episode <= high:
                raise EpisodesNotHeld(self.run_id, after_episode, first, window.produced)
            previous = self._stream
            stream = JobStream[RunningJob](self, after_episode)
            self._stream = stream
            window.cursor = max(after_episode, self.start_episode)
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
            episodes, pending = self._open_provider()
            while episodes is not None:
                if pending is not None:
                    episode, pending = pending, None
                else:
                    # After the done episode the generator may only end: no credit needed. A
                    # share produces no episode: rank 0's trainer paces the whole job.
                    wait = not (self._checker.done or self._share)
                    if wait and not self._wait_credit(self._window.produced + 1):
                        break
                    try:
                        episode = next(episodes)
                    except StopIteration:
                        if self._job.stop_event.is_set():
                            pass
                        elif self._share:
                            self._share_ended = True
                        else:
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
            self._job.stop_event.set()  # whatever the provider left running stops now
            if self._checkpoints is not None:
                self._checkpoints.close()  # its scratch is gone before its slot is free
            self._on_exit(self)
            with self._cond:
                self._error = error
                self._stopped = True
                self._notify()
            self._conclude(self._outcome_of(error))
            self.exited.set()

    def _open_provider(
        self,
    ) -> tuple[Iterator[episode_pb2.Episode] | None, episode_pb2.Episode | None]:
        """Starts the provider, restoring the first resume candidate that loads; returns its
        generator (None: cancelled while restoring) and the first episode when restoring
        pulled it."""
        if not self._resume_from:
            return self._provider.run(self._job), None
        if self._share:
            return self._open_share(), None
        skipped: list[trainer_service_pb2.SkippedCheckpoint] = []
        for index, ref in enumerate(self._resume_from):
            if self._job.stop_event.is_set() or self._stop_reason:
                return None, None
            episode = ref.checkpoint.episode
            try:
                restored = self._fetch(ref, index)
            except CheckpointError as exc:
                self._skip(skipped, episode, skip_reason(exc))
                continue
            except CheckpointUnusable as exc:  # another run's that this job may not continue
                self._skip(skipped, episode, f"does not fit: {exc}")
                continue
            with self._cond:
                self._start_at(episode)
            episodes = self._provider.run(dataclasses.replace(self._job, resume=restored))
            if not self._wait_credit(episode + 1):
                self._decide(ref, restored.best_reward, skipped)
                return episodes, None
            self._opening = (ref, restored.best_reward, skipped)
            try:
                first = next(episodes)
            except CheckpointUnusable as exc:
                if self._resumed is not None:  # announced: other trainers joined on it
                    raise ProviderError(
                        f"The checkpoint at episode {episode} could not be restored: {exc}",
                        detail=f"run {self.run_id}: after the rendezvous was announced",
                    ) from exc
                self._skip(skipped, episode, f"does not load: {exc}")
                continue
            except StopIteration:
                self._decide_once(ref, restored.best_reward, skipped)
                return episodes, None
            finally:
                self._opening = None
            self._decide_once(ref, restored.best_reward, skipped)
            return episodes, first
        with self._cond:
            self._start_at(0)
        self._decide(None, 0.0, skipped)
        return self._provider.run(self._job), None

    def _open_share(self) -> Iterator[episode_pb2.Episode]:
        """A share's provider, restoring exactly the first candidate (the checkpoint rank 0
        restores): a share never trains beside rank 0 from anywhere else.

        Raises:
            ProviderError: The checkpoint cannot be fetched or does not fit
                (``FAILED_PRECONDITION``).
        """
        ref = self._resume_from[0]
        episode = ref.checkpoint.episode
        try:
            restored = self._fetch(ref, 0)
        except (CheckpointError, CheckpointUnusable) as exc:
            reason = skip_reason(exc) if isinstance(exc, CheckpointError) else str(exc)
            raise ProviderError(
                f"This trainer cannot restore the checkpoint at episode {episode} that the "
                f"job resumes from ({reason}); every trainer of the job needs it in its "
                "checkpoint store.",
                detail=f"run {self.run_id}: {type(exc).__name__}: {exc}",
            ) from exc
        with self._cond:
            self._start_at(episode)
        self._decide(ref, restored.best_reward, [])
        return self._provider.run(dataclasses.replace(self._job, resume=restored))  # type: ignore[no-any-return]

    def announce_rendezvous(self, address: str) -> None:
        """Records where the other trainers' ranks of this job meet it (rank 0's provider
        calls it once the rendezvous is bound); streams send it after ``resumed``. A job
        restoring a candidate starts from it now: the other trainers join on it."""
        opening = self._opening
        if opening is not None:
            self._decide_once(*opening)
        with self._cond:
            self._rendezvous = trainer_service_pb2.Rendezvous(address=address)
            self._notify()
        _LOGGER.info(
            "run %s: rendezvous for the job's ranks on other trainers at %s",
            self.run_id,
            address,
            extra={"run_id": self.run_id},
        )

    def _decide_once(
        self,
        ref: trainer_service_pb2.CheckpointRef | None,
        best_reward: float,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
    ) -> None:
        """:meth:`_decide`, unless the start is decided already."""
        if self._resumed is None:
            self._decide(ref, best_reward, skipped)

    def _fetch(self, ref: trainer_service_pb2.CheckpointRef, index: int) -> RestoredCheckpoint:
        if self._checkpoints is None:
            raise CheckpointError(
                ref.run_id, ref.checkpoint.episode, "this trainer has no checkpoint store"
            )
        self._phase = "loading"
        if ref.run_id != self.run_id:  # checked before fetching: a model may be large
            check_fork(self._checkpoints.store, ref, self.task, self.config)
        dest = self._checkpoints.scratch_root / f"resume-{index}-{ref.checkpoint.episode:012d}"
        restored = fetch_candidate(self._checkpoints.store, ref, dest)
        if ref.run_id == self.run_id:
            self._restored = self._checkpoints.store.info(ref.run_id, ref.checkpoint.episode)
        else:
            self._restored = None
        return restored

    def _skip(
        self,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
        episode: int,
        reason: str,
    ) -> None:
        _LOGGER.warning(
            "run %s: skipped the checkpoint at episode %d: %s",
            self.run_id,
            episode,
            reason,
            extra={"run_id": self.run_id, "episode": episode},
        )
        skipped.append(trainer_service_pb2.SkippedCheckpoint(episode=episode, reason=reason))
        self._restored = None

    def _start_at(self, episode: int) -> None:
        """Numbers the job's episodes from ``episode + 1`` (call with the condition held)."""
        self.start_episode = episode
        cursor = self._stream.cursor if self._stream is not None else 0
        self._window.start_at(episode, cursor)
        self._notify()

    def _decide(
        self,
        ref: trainer_service_pb2.CheckpointRef | None,
        best_reward: float,
        skipped: list[trainer_service_pb2.SkippedCheckpoint],
    ) -> None:
        """Records where the job started; its streams send it first."""
        resumed = trainer_service_pb2.Resumed(skipped=skipped)
        if ref is not None:
            resumed.checkpoint.CopyFrom(ref)
            resumed.best_reward = best_reward
            self._checker.resume(ref.checkpoint.episode, best_reward)
            _LOGGER.info(
                "run %s: continues from the checkpoint of run %s at episode %d",
                self.run_id,
                ref.run_id,
                ref.checkpoint.episode,
                extra={"run_id": self.run_id, "episode": ref.checkpoint.episode},
            )
        else:
            _LOGGER.info(
                "run %s: no checkpoint restored; training from scratch",
                self.run_id,
                extra={"run_id": self.run_id},
            )
        with self._cond:
            self._resumed = resumed
            self._notify()

    def _hold(self, episode: episode_pb2.Episode) -> None:
        with self._cond:
            self._window.hold(episode)
            self._notify()

    def _outcome_of(self, error: BaseException | None) -> JobOutcome:
        if self._stop_reason == "shutdown" and not self.finished:
            return JobOutcome.SHUTDOWN
        if error is None:
            return JobOutcome.OK if self.finished else JobOutcome.CANCELLED
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

    def next_event(self, stream: JobStream[RunningJob]) -> StreamEvent | None:
        """The stream's next event if there is one, else None: ``resumed`` first (a job started
        with ``resume_from``, on a stream that starts at or before the restored episode), then
        the rendezvous (rank 0's job of one that spans trainers, once bound), then each
        checkpoint event whose episode the stream has sent, then the episode after
        ``stream.cursor``.

        Raises:
            Reattached: another stream replaced this one.
            ShuttingDown: the trainer is shutting down.
            JobCancelled: the job was cancelled (``CancelJob``).
            JobEnd: the job ended and the stream has sent everything.
        """
        with self._cond:
            if stream.replaced or self._stream is not stream:
                raise Reattached(self.run_id)
            if self._stop_reason == "shutdown" and not self.finished:
                raise ShuttingDown(self.run_id)
            if self._resume_from and not stream.resumed_sent:
                if self._resumed is None and not self._stopped:
                    return None  # still restoring: heartbeats only
                # (A job that failed before it decided has no resumed: its end follows.)
                stream.resumed_sent = True
                if stream.cursor <= self.start_episode:
                    stream.cursor = self.start_episode
                    if self._resumed is not None:
                        return self._resumed
            if self._rendezvous is not None and not stream.rendezvous_sent:
                stream.rendezvous_sent = True
                return self._rendezvous
            checkpoint = self._checkpoint_event(stream)
            if checkpoint is not None:
                return checkpoint.to_proto()
            n = stream.cursor + 1
            if n <= self._window.produced:
                return self._window.episode(n)
            if not self._stopped:
                return None
            if self._stop_reason == "cancelled" and not self.finished:
                raise JobCancelled(self.run_id)
            raise JobEnd(self._error)

    def _checkpoint_event(self, stream: JobStream[RunningJob]) -> CheckpointEvent | None:
        """The stream's next checkpoint event, once it sent the episode (call with the
        condition held)."""
        if self._checkpoints is None:
            return None
        event = self._checkpoints.event(stream.checkpoints_sent)
        if event is None or event.episode > stream.cursor:
            return None
        stream.checkpoints_sent += 1
        return event

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

    def wake(self) -> None:
        """Wakes the producer and the streams (a checkpoint was committed)."""
        with self._cond:
            self._notify()
