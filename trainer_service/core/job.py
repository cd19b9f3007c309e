"""One training job: :class:`RunningJob`, its provider thread, its credit gate and the streams
attached to it.

A job is four parts over one shared state (``trainer_service.core.job_state``):

- the *producer* (``job_producer``): the thread that runs the provider's generator, one
  credited episode at a time (``job_window``), and checks every episode against the stream
  contract before any stream can send it;
- the *resume choice* (``job_resume``): for a job started with ``resume_from``, which
  checkpoint it restores (newest first, skipping those that do not load; from scratch when none
  does) and where its episodes are numbered from;
- the *share* (``job_share``): another trainer's part of a job whose ranks span trainers, which
  takes no credit and produces no episode;
- the *reader* (``job_reader``): what the job's ``Train`` streams (``job_stream``) attach to and
  read.

:class:`RunningJob` builds them and is the job's one face: the runner controls it (grants,
cancels, hyperparameters, the final checkpoint) and its streams know it as their
``StreamSource``. A job outlives a broken stream: it is *detached* (blocked at its credit) until
another stream re-attaches or the runner's detach grace runs out.

``cancel(checkpoint=True)`` (stop, park) asks the provider for a final checkpoint: the job takes
no more credit, lets the episode in flight finish and be held, then closes the provider's
generator, which writes the checkpoint of its last episode while it stops.

Rank 0's job of one that spans trainers announces the rendezvous its provider bound
(:meth:`RunningJob.announce_rendezvous`); its streams send it after ``resumed`` and before any
episode.

Invariant: the producer releases the job's slot (``on_exit``) once the provider has stopped,
before the outcome is delivered to any stream.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainer_service.core.checkpointing import CheckpointEvent, JobCheckpoints
from trainer_service.core.errors import JobFinished
from trainer_service.core.job_producer import Opener, Producer
from trainer_service.core.job_reader import JobReader
from trainer_service.core.job_resume import ResumeChoice
from trainer_service.core.job_share import Share, is_share
from trainer_service.core.job_state import JobState
from trainer_service.core.job_stream import Heartbeat, JobStream, StreamEvent
from trainer_service.core.job_window import EpisodeWindow
from trainer_service.core.observe import JobObserver, JobOutcome, NullJobObserver
from trainer_service.core.provider import TrainJob
from trainwire import contract
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointInfo

_LOGGER = logging.getLogger(__name__)


def writes_final_checkpoint(stopped: bool, decided: bool, produced: int, start: int) -> bool:
    """Whether a job cancelled with a checkpoint (stop, park) has its provider write one as it
    stops: it still runs, its start is decided (restored, or needed not) and it trained an
    episode since its start (``start``: the episode it continues after)."""
    return not stopped and decided and produced > start


def final_checkpoint_of(
    event: CheckpointEvent | None,
    produced: int,
    start: int,
    restored: CheckpointInfo | None,
    stopped: bool,
) -> tuple[CheckpointInfo | None, str]:
    """The checkpoint of a cancelled job's last episode, or why there is none.

    Args:
        event: The outcome of the last checkpoint attempt of episode ``produced`` (None: none).
        produced: The job's last produced episode (0 before the first).
        start: The episode the job continues after (0: from scratch).
        restored: The record of the checkpoint of this run it restored (None: none, or
            another run's).
        stopped: Whether the job has stopped.
    """
    if event is not None:
        return event.info, event.error
    if produced and produced == start and restored is not None:
        return restored, ""  # nothing trained since the checkpoint it restored
    if not produced or produced == start:
        return None, "the job had not trained an episode"
    if not stopped:
        return None, f"the final checkpoint at episode {produced} is not written yet"
    return None, f"the job ended at episode {produced} without a final checkpoint"


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
        self.heartbeat_s = heartbeat_s
        self._job = job
        self._provider = provider
        self._checkpoints = checkpoints
        observer = observer or NullJobObserver()
        self._state = JobState(
            job.run_id,
            contract.StreamChecker.for_task(job.task, job.config, job.run_id),
            EpisodeWindow(queue_size, retain, grant),
            resume_from,
        )
        self._resume = ResumeChoice(self._state, job, provider, checkpoints)
        share = Share(self._state, job, provider, self._resume) if is_share(job.placement) else None
        self._reader = JobReader(self._state, kind, checkpoints, observer)
        self._producer = Producer(
            self._state,
            job,
            kind,
            self._opener(share),
            share,
            checkpoints,
            observer,
            on_exit=lambda: on_exit(self),
        )
        self.exited: threading.Event = self._producer.exited

    def _opener(self, share: Share | None) -> Opener:
        """How the producer starts the provider: as a share, through the resume choice, or
        plainly."""
        if share is not None:
            return lambda: (share.open(), None)
        if self._state.resume_from:
            return self._resume.open
        return lambda: (self._provider.run(self._job), None)

    # -- state -------------------------------------------------------------------------------

    @property
    def provider(self) -> Any:
        """The job's provider module."""
        return self._provider

    @property
    def phase(self) -> str:
        """What the job is doing now (``waiting`` while blocked at its credit)."""
        return self._state.phase

    def set_phase(self, phase: str) -> None:
        """Records the provider's phase (for heartbeats)."""
        self._state.provider_phase = phase

    @property
    def start_episode(self) -> int:
        """The episode the job continues after (0: from scratch)."""
        return self._state.start_episode

    @property
    def produced(self) -> int:
        """The last episode the provider produced (0 before the first)."""
        return self._state.window.produced

    @property
    def grant(self) -> int:
        """The last episode the job may produce (0: no grant)."""
        return self._state.window.grant

    @property
    def attached(self) -> bool:
        """Whether a stream is attached."""
        return self._reader.attached

    @property
    def stopped(self) -> bool:
        """Whether the provider has stopped (finished, failed or cancelled)."""
        return self._state.stopped

    @property
    def finished(self) -> bool:
        """Whether the job did all it had to: its done episode is out, or (a share) its
        provider returned."""
        return self._state.finished

    @property
    def outcome(self) -> JobOutcome | None:
        """How the job ended; ``None`` while it runs."""
        return self._producer.outcome

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the producer thread to exit; returns whether it did."""
        return self.exited.wait(timeout)

    # -- control -----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the producer thread."""
        self._producer.start()

    def move_grant(self, through_episode: int) -> int:
        """Lets the job produce up to ``through_episode`` (grants only move forward); returns the
        last produced episode."""
        state = self._state
        with state.cond:
            if state.window.move_grant(through_episode):
                state.notify()
            return state.window.produced

    def cancel(self, reason: str = "cancelled", checkpoint: bool = False) -> None:
        """Stops the job at its next episode; idempotent, callable from any thread.

        Args:
            reason: ``cancelled`` (``CancelJob``, a detach that expired) or ``shutdown``.
            checkpoint: End with a checkpoint of the last episode: the episode in flight is
                finished and held, then the provider writes the checkpoint as it stops. Only
                once the job produced an episode (before that, and without a checkpoint store,
                the job stops at once).
        """
        state = self._state
        with state.cond:
            if not state.stop_reason and not state.stopped:
                state.stop_reason = reason
            final = (
                checkpoint
                and self._checkpoints is not None
                and writes_final_checkpoint(
                    state.stopped,
                    state.resumed_or_plain(),
                    state.window.produced,
                    state.start_episode,
                )
            )
            state.notify()
        if final:
            assert self._checkpoints is not None
            self._checkpoints.request_final()
            # stop_event is set once the generator is closed (see the producer): a provider
            # that watches it must not abandon the step in flight or the final checkpoint.
        else:
            self._job.stop_event.set()

    def set_hyperparameters(self, change: Hyperparameters) -> tuple[Hyperparameters, int]:
        """Asks the provider to train with ``change`` from its next optimizer step; returns
        the values that step trains with and the last episode produced so far.

        Raises:
            JobFinished: The job produced its last episode, or stopped.
        """
        state = self._state
        with state.cond:
            if state.stopped or state.stop_reason or state.finished:
                raise JobFinished(self.run_id, state.window.produced)
            values = self._job.hyperparameters.request(change)
            produced = state.window.produced
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

    def final_checkpoint(self) -> tuple[CheckpointInfo | None, str]:
        """The checkpoint of the job's last episode once it stopped: its record, or why there is
        none."""
        state = self._state
        with state.cond:
            produced = state.window.produced
            stopped = state.stopped
        if self._checkpoints is None:
            return None, "this trainer has no checkpoint store"
        return final_checkpoint_of(
            self._checkpoints.of_episode(produced),
            produced,
            state.start_episode,
            self._resume.restored,
            stopped,
        )

    def attach(self, after_episode: int, grant: int) -> JobStream[RunningJob]:
        """A new stream of the episodes after ``after_episode``; replaces any attached stream.

        Raises:
            EpisodesNotHeld: Those episodes are no longer (or not yet) held.
        """
        return self._reader.attach(self, after_episode, grant)

    def detach(self, stream: JobStream[RunningJob]) -> bool | None:
        """Called when ``stream``'s RPC ended. Returns None when ``stream`` was not attached (any
        more), else whether the job is left undelivered (the stream broke before the job's end),
        so the runner keeps it for a re-attach."""
        return self._reader.detach(stream)

    def announce_rendezvous(self, address: str) -> None:
        """Records where the other trainers' ranks of this job meet it (rank 0's provider
        calls it once the rendezvous is bound); streams send it after ``resumed``. A job
        restoring a candidate starts from it now: the other trainers join on it."""
        self._resume.announce()
        state = self._state
        with state.cond:
            state.rendezvous = trainer_service_pb2.Rendezvous(address=address)
            state.notify()
        _LOGGER.info(
            "run %s: rendezvous for the job's ranks on other trainers at %s",
            self.run_id,
            address,
            extra={"run_id": self.run_id},
        )

    # -- what streams read (the ``StreamSource`` of ``job_stream``, see ``job_reader``) ------

    def next_event(self, stream: JobStream[RunningJob]) -> StreamEvent | None:
        """The stream's next event if there is one, else None (see ``job_reader``)."""
        return self._reader.next_event(stream)

    def sent(self, stream: JobStream[RunningJob], episode: int) -> None:
        """``stream``'s RPC wrote ``episode``: moves its cursor and, if attached, the credit."""
        self._reader.sent(stream, episode)

    def heartbeat(self, stream: JobStream[RunningJob]) -> Heartbeat:
        """A heartbeat for ``stream`` now, counted as sent."""
        return self._reader.heartbeat(stream)

    def add_waker(self, waker: Callable[[], None]) -> None:
        """Calls ``waker`` (with the job's condition held) whenever the job changes."""
        self._reader.add_waker(waker)

    def remove_waker(self, waker: Callable[[], None]) -> None:
        """Stops calling ``waker``."""
        self._reader.remove_waker(waker)

    def wake(self) -> None:
        """Wakes the producer and the streams (a checkpoint was committed)."""
        self._reader.wake()
