"""The job runner: validates a training request, takes a slot and runs the provider in a thread.

Each job's provider generator runs in a thread the runner owns. Episodes reach the RPC handler
through a small bounded channel, so a client that reads slowly (or a paused gateway) throttles the
provider through gRPC flow control: the handler blocks sending, the channel fills, the provider
blocks in ``yield``. The handler side checks every episode against the stream contract before
handing it on and produces a heartbeat whenever nothing went out for the heartbeat interval.

The slot is released by the job thread itself once the provider has stopped (its generator
closed), whatever the outcome: success, provider error, crash or cancellation.

A :class:`JobObserver` hears of job starts and ends, episodes and heartbeats sent and contract
violations (the metrics hang off it); the core knows nothing of how they are recorded. Each job's
outcome is decided once, on the handler side, and logged as one INFO line with the run id.
"""

from __future__ import annotations

import collections
import enum
import importlib.metadata
import logging
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from trainer_service.core.errors import InvalidRequest, NoFreeSlot, ShuttingDown
from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.core.slots import SlotPool
from trainwire import contract
from trainwire.v1 import episode_pb2, trainer_service_pb2

_LOGGER = logging.getLogger(__name__)

#: Episodes buffered between a provider and its RPC handler. Small, so that flow control reaches
#: the provider quickly, but more than one so the provider can compute ahead of a slow send.
DEFAULT_QUEUE_SIZE = 4


class ProviderLookup(Protocol):
    """What the runner needs of a provider registry."""

    def get(self, name: str) -> Any | None:  # pragma: no cover - protocol
        """The provider module for ``name``, or ``None``."""
        ...

    def unavailable_reason(self, name: str) -> str:  # pragma: no cover - protocol
        """Why ``name`` is not available."""
        ...

    def available(self) -> list[str]:  # pragma: no cover - protocol
        """Names of the importable providers."""
        ...


class JobOutcome(enum.StrEnum):
    """How a job ended, as its stream's consumer saw it."""

    OK = "ok"  #: the done episode went out
    ERROR = "error"  #: the provider failed with a message for users (``ProviderError``)
    CRASH = "crash"  #: the provider raised something unexpected
    CONTRACT_VIOLATION = "contract_violation"  #: the stream broke the contract
    CANCELLED = "cancelled"  #: the client went away (cancel, deadline, disconnect)
    SHUTDOWN = "shutdown"  #: the trainer shut down under it


_OUTCOME_VERBS = {
    JobOutcome.OK: "finished",
    JobOutcome.ERROR: "failed",
    JobOutcome.CRASH: "failed unexpectedly",
    JobOutcome.CONTRACT_VIOLATION: "failed (contract violation)",
    JobOutcome.CANCELLED: "cancelled",
    JobOutcome.SHUTDOWN: "stopped by shutdown",
}


class JobObserver(Protocol):
    """Hears what the runner does; implementations must be cheap and must not raise.

    ``episode_sent`` and ``heartbeat_sent`` run on the streaming hot path, once per message.
    ``kind`` is the task kind (``imitation``, ``grpo``).
    """

    def job_started(self, run_id: str, kind: str) -> None:  # pragma: no cover - protocol
        """A job took a slot and its thread started."""
        ...

    def job_ended(
        self, run_id: str, kind: str, outcome: JobOutcome
    ) -> None:  # pragma: no cover - protocol
        """A job's outcome was decided (called exactly once per started job)."""
        ...

    def episode_sent(self, kind: str) -> None:  # pragma: no cover - protocol
        """An episode was written to the RPC (its handler asked for the next event)."""
        ...

    def heartbeat_sent(self, kind: str) -> None:  # pragma: no cover - protocol
        """A heartbeat was written to the RPC."""
        ...

    def contract_violation(self, kind: str, rule: str) -> None:  # pragma: no cover - protocol
        """The stream broke contract rule ``rule``."""
        ...


class NullJobObserver:
    """The observer that ignores everything (the default)."""

    def job_started(self, run_id: str, kind: str) -> None:
        """Ignored."""

    def job_ended(self, run_id: str, kind: str, outcome: JobOutcome) -> None:
        """Ignored."""

    def episode_sent(self, kind: str) -> None:
        """Ignored."""

    def heartbeat_sent(self, kind: str) -> None:
        """Ignored."""

    def contract_violation(self, kind: str, rule: str) -> None:
        """Ignored."""


@dataclass(frozen=True)
class Heartbeat:
    """A sign of life while no episode is ready.

    Attributes:
        last_episode: The last episode handed out on this stream, 0 before the first.
        phase: What the job is doing (``loading``, ``training``, ``finishing``).
        time_ns: When it was produced, nanoseconds since the epoch.
    """

    last_episode: int
    phase: str
    time_ns: int


@dataclass(frozen=True)
class Capabilities:
    """What this trainer offers and how busy it is."""

    providers: tuple[str, ...]
    device: str
    slots_total: int
    slots_free: int
    torch_version: str
    trl_version: str
    server_version: str


@dataclass(frozen=True)
class RunnerSettings:
    """How the runner runs jobs.

    Attributes:
        device: The torch device jobs run on (``cpu``, ``cuda:0``).
        device_description: The device for humans (``cuda:0 NVIDIA H200``).
        data_root: Root of task-relative paths.
        image_cache_dir: Image cache for providers that decode images; ``None`` = off.
        heartbeat_s: Seconds without an episode after which a heartbeat goes out.
        queue_size: Episodes buffered between a provider and its handler.
    """

    device: str = "cpu"
    device_description: str = "cpu"
    data_root: pathlib.Path = pathlib.Path("var/data")
    image_cache_dir: pathlib.Path | None = None
    heartbeat_s: float = 5.0
    queue_size: int = DEFAULT_QUEUE_SIZE


def _package_version(name: str) -> str:
    """The installed version of ``name`` without importing it; empty when not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


# -- the channel between a job thread and its handler ----------------------------------------


class _Empty:
    """Returned by ``_Channel.get`` on timeout."""


_EMPTY = _Empty()


@dataclass(frozen=True)
class _Finished:
    """Terminal item: the provider stopped; ``error`` is what it raised, if anything."""

    error: BaseException | None


class _Channel:
    """A bounded FIFO whose ``close`` wakes every waiter (``queue.Queue`` cannot be closed)."""

    def __init__(self, capacity: int) -> None:
        self._items: collections.deque[object] = collections.deque()
        self._capacity = capacity
        self._closed = False
        self._cond = threading.Condition()

    def put(self, item: object) -> bool:
        """Appends ``item``, blocking while full; False when the channel is closed."""
        with self._cond:
            while len(self._items) >= self._capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def put_final(self, item: object) -> None:
        """Appends the terminal item regardless of capacity (the job thread must never block)."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def get(self, timeout: float) -> object:
        """Takes the next item, waiting at most ``timeout`` seconds; ``_EMPTY`` on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                return _EMPTY
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """Rejects further ``put`` s and wakes a blocked producer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# -- one job -----------------------------------------------------------------------------------


class RunningJob:
    """One training job: its provider thread and the handler-side event stream.

    Created by :meth:`JobRunner.start` with a slot already taken. Iterate :meth:`events` in the
    RPC handler; call :meth:`cancel` when the RPC ends for any reason.
    """

    def __init__(
        self,
        job: TrainJob,
        provider: Any,
        heartbeat_s: float,
        queue_size: int,
        on_exit: Callable[[RunningJob], None],
        kind: str = "",
        observer: JobObserver | None = None,
    ) -> None:
        self.run_id = job.run_id
        self.kind = kind
        self._observer: JobObserver = observer or NullJobObserver()
        self._outcome: JobOutcome | None = None
        self._consuming = False
        self._job = job
        self._provider = provider
        self._heartbeat_s = heartbeat_s
        self._channel = _Channel(queue_size)
        self._checker = contract.StreamChecker.for_task(job.task, job.config, job.run_id)
        self._on_exit = on_exit
        self._phase = "loading"
        self._stop_reason = ""
        self._lock = threading.Lock()
        self.exited = threading.Event()
        self._thread = threading.Thread(
            target=self._work, name=f"trainwire-job-{job.run_id}", daemon=True
        )

    @property
    def phase(self) -> str:
        """What the job is doing now."""
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Records the provider's phase (for heartbeats)."""
        self._phase = phase

    def start(self) -> None:
        """Starts the job thread."""
        self._thread.start()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stops the job at its next episode; idempotent, callable from any thread.

        Args:
            reason: ``cancelled`` (the client went away) or ``shutdown`` (the trainer stops; the
                stream, if still read, ends with ``UNAVAILABLE``).
        """
        with self._lock:
            if not self._stop_reason:
                self._stop_reason = reason
            consuming = self._consuming
        self._job.stop_event.set()
        self._channel.close()
        if not consuming:
            # Nobody iterates events(), so nobody else will decide the outcome.
            self._conclude(JobOutcome.SHUTDOWN if reason == "shutdown" else JobOutcome.CANCELLED)

    @property
    def outcome(self) -> JobOutcome | None:
        """How the job ended; ``None`` while it is still undecided."""
        return self._outcome

    def _conclude(self, outcome: JobOutcome) -> None:
        """Records the job's outcome once (the first caller wins), logs it and reports it."""
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = outcome
        _LOGGER.info(
            "run %s: %s job %s at episode %d",
            self.run_id,
            self.kind,
            _OUTCOME_VERBS[outcome],
            self._checker.last_episode,
            extra={"run_id": self.run_id, "outcome": outcome.value},
        )
        self._observer.job_ended(self.run_id, self.kind, outcome)

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the job thread to exit; returns whether it did."""
        return self.exited.wait(timeout)

    def _work(self) -> None:
        """The job thread: drives the provider generator into the channel."""
        error: BaseException | None = None
        episodes: Iterator[episode_pb2.Episode] | None = None
        try:
            episodes = self._provider.run(self._job)
            for episode in episodes:
                if not self._channel.put(episode) or self._job.stop_event.is_set():
                    break
        except BaseException as exc:  # handed to the handler, which maps and logs it
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
            self._channel.put_final(_Finished(error))
            self.exited.set()

    def events(self) -> Iterator[episode_pb2.Episode | Heartbeat]:
        """Yields contract-checked episodes and heartbeats until the job ends.

        Returns normally after the done episode, or when the job was cancelled by the client.

        Raises:
            ProviderError: The provider failed with a message for users.
            ContractViolation: An episode (or the end of the stream) broke the contract; it is
                logged as ``CONTRACT VIOLATION`` first.
            ShuttingDown: The trainer is shutting down.
            Exception: Whatever else the provider raised (an unexpected failure).
        """
        with self._lock:
            self._consuming = True
        last_sent = time.monotonic()
        try:
            while True:
                if self._stop_reason == "shutdown":
                    raise ShuttingDown(self.run_id)
                wait = self._heartbeat_s - (time.monotonic() - last_sent)
                item = self._channel.get(max(0.0, wait))
                if item is _EMPTY:
                    yield Heartbeat(self._checker.last_episode, self._phase, time.time_ns())
                    # Resumed: the handler wrote it and asks for more.
                    self._observer.heartbeat_sent(self.kind)
                    last_sent = time.monotonic()
                elif isinstance(item, _Finished):
                    self._finish(item)
                    self._conclude(JobOutcome.OK if self._checker.done else JobOutcome.CANCELLED)
                    return
                else:
                    assert isinstance(item, episode_pb2.Episode)
                    self._check(item)
                    yield item
                    # Resumed: the handler wrote it and asks for more.
                    self._observer.episode_sent(self.kind)
                    last_sent = time.monotonic()
        except ShuttingDown:
            self._conclude(JobOutcome.SHUTDOWN)
            raise
        except contract.ContractViolation:
            self._conclude(JobOutcome.CONTRACT_VIOLATION)
            raise
        except ProviderError:
            self._conclude(JobOutcome.ERROR)
            raise
        except Exception:
            self._conclude(JobOutcome.CRASH)
            raise
        finally:
            # Still undecided: the handler stopped reading (GeneratorExit), the client left.
            self._conclude(
                JobOutcome.SHUTDOWN if self._stop_reason == "shutdown" else JobOutcome.CANCELLED
            )
            self.cancel()

    def _check(self, episode: episode_pb2.Episode) -> None:
        try:
            self._checker.check(episode)
        except contract.ContractViolation as exc:
            self._violated(exc)
            raise

    def _violated(self, exc: contract.ContractViolation) -> None:
        _LOGGER.error(
            "CONTRACT VIOLATION run %s rule %s: %s",
            self.run_id,
            exc.rule,
            exc,
            extra={"run_id": self.run_id, "rule": exc.rule},
        )
        self._observer.contract_violation(self.kind, exc.rule)

    def _finish(self, finished: _Finished) -> None:
        if self._stop_reason == "shutdown" and not self._checker.done:
            raise ShuttingDown(self.run_id)
        if finished.error is not None:
            raise finished.error
        if self._stop_reason and not self._checker.done:
            return  # cancelled by the client: nobody reads the rest
        try:
            self._checker.finish()
        except contract.ContractViolation as exc:
            self._violated(exc)
            raise


# -- the runner --------------------------------------------------------------------------------


class JobRunner:
    """Starts training jobs in slots and tracks them until their threads exit.

    Args:
        registry: Provider name -> provider module (see ``trainer_service.providers``).
        slots: The trainer's job slots.
        settings: Device, paths and stream settings.
        server_version: Reported by :meth:`capabilities`.
        observer: Hears of job starts and ends, episodes, heartbeats and contract violations
            (the trainer's metrics); ignored by default.
    """

    def __init__(
        self,
        registry: ProviderLookup,
        slots: SlotPool,
        settings: RunnerSettings | None = None,
        server_version: str = "",
        observer: JobObserver | None = None,
    ) -> None:
        self._registry = registry
        self.observer: JobObserver = observer or NullJobObserver()
        self.slots = slots
        self.settings = settings or RunnerSettings()
        self._server_version = server_version
        self._jobs: set[RunningJob] = set()
        self._cond = threading.Condition()
        self._shutting_down = False

    def start(self, request: trainer_service_pb2.TrainRequest) -> RunningJob:
        """Validates a request, takes a slot and starts its job.

        Raises:
            InvalidRequest: Bad fields (every one of them).
            ProviderError: The task's provider is not available on this trainer.
            NoFreeSlot: Every slot is busy.
            ShuttingDown: The trainer is shutting down.
        """
        run_id = request.run_id
        if self._shutting_down:
            raise ShuttingDown(run_id)
        violations = contract.check_train_request(request)
        if violations:
            raise InvalidRequest(run_id, violations)
        kind = contract.task_kind(request.task)
        provider = self._registry.get(kind)
        if provider is None:
            raise ProviderError(
                f"This trainer cannot run {kind} training.",
                detail=f"run {run_id}: provider {kind!r} unavailable: "
                f"{self._registry.unavailable_reason(kind)}",
                reason="PROVIDER_UNAVAILABLE",
            )
        validate = getattr(provider, "validate", None)
        if validate is not None:
            violations = validate(request.task, self.settings.data_root)
            if violations:
                raise InvalidRequest(run_id, violations)
        if not self.slots.try_acquire():
            raise NoFreeSlot(run_id, self.slots.total)
        try:
            job = self._make_job(request, provider, kind)
        except BaseException:
            self.slots.release()
            raise
        with self._cond:
            if self._shutting_down:
                # Lost the race with shutdown: nothing started yet.
                self.slots.release()
                raise ShuttingDown(run_id)
            self._jobs.add(job)
        _LOGGER.info(
            "run %s: %s job started on %s (%d/%d slots busy)",
            run_id,
            kind,
            self.settings.device,
            self.slots.total - self.slots.free,
            self.slots.total,
            extra={"run_id": run_id},
        )
        self.observer.job_started(run_id, kind)
        job.start()
        return job

    def _make_job(
        self, request: trainer_service_pb2.TrainRequest, provider: Any, kind: str
    ) -> RunningJob:
        holder: list[RunningJob] = []
        train_job = TrainJob(
            run_id=request.run_id,
            task=request.task,
            config=request.config,
            device=self.settings.device,
            data_root=self.settings.data_root,
            image_cache_dir=self.settings.image_cache_dir,
            stop_event=threading.Event(),
            set_phase=lambda phase: holder[0].set_phase(phase),
        )
        job = RunningJob(
            train_job,
            provider,
            self.settings.heartbeat_s,
            self.settings.queue_size,
            self._exited,
            kind=kind,
            observer=self.observer,
        )
        holder.append(job)
        return job

    def _exited(self, job: RunningJob) -> None:
        """Called by a job thread once its provider has stopped."""
        self.slots.release()
        with self._cond:
            self._jobs.discard(job)
            self._cond.notify_all()
        # The outcome line (INFO) comes from the handler side; this is bookkeeping.
        _LOGGER.debug("run %s: job thread exited, slot released", job.run_id)

    @property
    def active_jobs(self) -> int:
        """Number of jobs whose threads have not exited yet."""
        with self._cond:
            return len(self._jobs)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no job thread is left; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs, timeout)

    def shutdown(self) -> None:
        """Refuses new jobs and stops the running ones at their next episode."""
        with self._cond:
            self._shutting_down = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel("shutdown")
        if jobs:
            _LOGGER.info("shutting down: stopping %d job(s)", len(jobs))

    def capabilities(self) -> Capabilities:
        """What this trainer offers and how busy it is (imports the providers on first call)."""
        return Capabilities(
            providers=tuple(self._registry.available()),
            device=self.settings.device_description,
            slots_total=self.slots.total,
            slots_free=self.slots.free,
            torch_version=_package_version("torch"),
            trl_version=_package_version("trl"),
            server_version=self._server_version,
        )
