"""A job's producer: :class:`Producer`, the thread that runs the provider's generator.

Before it pulls episode ``n`` from the generator the producer waits for *credit*
(``trainer_service.core.job_window``, under the job's condition); while it waits the job's
phase reads ``waiting``. It checks every episode against the stream contract before it holds it
for the streams, so no stream can send an episode that breaks the contract. After the done
episode the generator may only end: no credit is needed for that. A share
(``trainer_service.core.job_share``) takes no credit and produces no episode; its generator
ending is its part done.

The producer opens the provider through an *opener*: the provider's ``run`` for a plain job,
the resume choice (``trainer_service.core.job_resume``) for one with ``resume_from``, the
share's own for a share.

Invariants: once the generator ends, fails or is stopped, the producer closes it (the
provider's cleanup runs, a final checkpoint is written), sets the job's stop event, closes the
job's checkpoint scratch, and only then releases the job's slots (``on_exit``); the job is
``stopped`` with its error after that, and its outcome is recorded, logged and reported once,
before :attr:`Producer.exited` is set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from trainer_service.core.checkpointing import JobCheckpoints
from trainer_service.core.job_share import Share
from trainer_service.core.job_state import JobState
from trainer_service.core.observe import JobObserver, JobOutcome
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

#: Starts the provider: its generator (None: stopped before it ran) and the first episode when
#: opening pulled it.
Opener = Callable[[], tuple[Iterator[episode_pb2.Episode] | None, episode_pb2.Episode | None]]


def outcome_of(state: JobState, error: BaseException | None) -> JobOutcome:
    """How a stopped job ended, from why it stopped and what its provider raised."""
    if state.stop_reason == "shutdown" and not state.finished:
        return JobOutcome.SHUTDOWN
    if error is None:
        return JobOutcome.OK if state.finished else JobOutcome.CANCELLED
    if isinstance(error, contract.ContractViolation):
        return JobOutcome.CONTRACT_VIOLATION
    if isinstance(error, ProviderError):
        return JobOutcome.ERROR
    return JobOutcome.CRASH


class Producer:
    """The thread that pulls one job's episodes, one credited episode at a time.

    Args:
        state: The job's shared state.
        job: What the provider runs (its ``stop_event`` stops the provider).
        kind: The task kind, for logs and metrics.
        opener: Starts the provider.
        share: The job's share, when it is another trainer's share of a job (None: it is not).
        checkpoints: The job's checkpoints, closed once the provider stopped.
        observer: Hears of the job's end and contract violations.
        on_exit: Called once the provider has stopped (releases the job's slots).
    """

    def __init__(
        self,
        state: JobState,
        job: TrainJob,
        kind: str,
        opener: Opener,
        share: Share | None,
        checkpoints: JobCheckpoints | None,
        observer: JobObserver,
        on_exit: Callable[[], None],
    ) -> None:
        self._state = state
        self._job = job
        self._kind = kind
        self._opener = opener
        self._share = share
        self._checkpoints = checkpoints
        self._observer = observer
        self._on_exit = on_exit
        self.outcome: JobOutcome | None = None
        self.exited = threading.Event()
        self._thread = threading.Thread(
            target=self.run, name=f"trainwire-job-{job.run_id}", daemon=True
        )

    def start(self) -> None:
        """Starts the producer thread."""
        self._thread.start()

    def run(self) -> None:
        """The producer thread: pulls the provider's generator, one credited episode at a time."""
        state = self._state
        run_id = state.run_id
        error: BaseException | None = None
        episodes: Iterator[episode_pb2.Episode] | None = None
        try:
            episodes, pending = self._opener()
            while episodes is not None:
                if pending is not None:
                    episode, pending = pending, None
                else:
                    # After the done episode the generator may only end: no credit needed. A
                    # share produces no episode: rank 0's trainer paces the whole job.
                    wait = not (state.checker.done or self._share is not None)
                    if wait and not state.wait_credit(state.window.produced + 1):
                        break
                    try:
                        episode = next(episodes)
                    except StopIteration:
                        if self._job.stop_event.is_set():
                            pass
                        elif self._share is not None:
                            self._share.end()
                        else:
                            state.checker.finish()
                        break
                if self._job.stop_event.is_set():
                    break
                state.checker.check(episode)
                self._hold(episode)
        except contract.ContractViolation as exc:
            _LOGGER.error(
                "CONTRACT VIOLATION run %s rule %s: %s",
                run_id,
                exc.rule,
                exc,
                extra={"run_id": run_id, "rule": exc.rule},
            )
            self._observer.contract_violation(self._kind, exc.rule)
            error = exc
        except BaseException as exc:  # delivered to the stream, which maps it to a status
            error = exc
        finally:
            state.provider_phase = "finishing"
            if episodes is not None and hasattr(episodes, "close"):
                try:
                    # Runs the provider's own cleanup (freeing model memory) before the slot
                    # is given back.
                    episodes.close()
                except Exception:
                    _LOGGER.exception("run %s: provider failed while stopping", run_id)
            self._job.stop_event.set()  # whatever the provider left running stops now
            if self._checkpoints is not None:
                self._checkpoints.close()  # its scratch is gone before its slot is free
            self._on_exit()
            with state.cond:
                state.error = error
                state.stopped = True
                state.notify()
            self._conclude(outcome_of(state, error))
            self.exited.set()

    def _hold(self, episode: episode_pb2.Episode) -> None:
        with self._state.cond:
            self._state.window.hold(episode)
            self._state.notify()

    def _conclude(self, outcome: JobOutcome) -> None:
        """Records the job's outcome once, logs it and reports it."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        run_id = self._state.run_id
        _LOGGER.info(
            "run %s: %s job %s at episode %d",
            run_id,
            self._kind,
            _OUTCOME_VERBS[outcome],
            self._state.window.produced,
            extra={"run_id": run_id, "outcome": outcome.value},
        )
        self._observer.job_ended(run_id, self._kind, outcome)
