"""The job runner: starts a job for an admitted training request in the slots it needs; finds live
jobs by run id to grant them credit, cancel them and re-attach streams to them.

Whether a request may start a job (its fields, its provider, the slots it needs, all of them or
none) is ``trainer_service.core.admission``; the runner's settings and the capabilities it
reports are ``trainer_service.core.runner_settings`` (re-exported here). Jobs
(``trainer_service.core.job``) run their providers in threads they own.

The runner keeps one table of job records (the job, its slots, whether it is live, whether its
thread runs, its detach timer). A job is *live* (found by run id) from its start until it is
cancelled, or until it stayed detached (no stream attached) for ``detach_grace_s`` seconds: one
whose end was not delivered is then cancelled; one whose end was delivered (it computes nothing
more, its slots are free) is kept that long too, so a gateway that restarted before storing what
it received can re-attach and have the held episodes and the end again. Only a job with a grant
(one a gateway started) is kept; a job without one (direct use: grpcurl, a script) stops being
live as soon as its stream ends (cancelled if unfinished), as nobody will re-attach to it. The
slots are released by the job's own thread once its provider has stopped, whatever the outcome.

Invariants of the table: at most one live job per run id; only a live job has a detach timer; a
record leaves the table once its job is neither live nor running.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainer_service.core.admission import ProviderLookup, admit, check_request
from trainer_service.core.checkpointing import JobCheckpoints, job_meta
from trainer_service.core.errors import (
    InvalidRequest,
    JobExists,
    JobNotFound,
    NoFreeSlot,
    ShuttingDown,
)
from trainer_service.core.hyperparameters import (
    LiveHyperparameters,
    check_change,
    same_but_hyperparameters,
)
from trainer_service.core.job import RunningJob
from trainer_service.core.job_stream import Heartbeat, JobStream
from trainer_service.core.observe import JobObserver, JobOutcome, NullJobObserver
from trainer_service.core.placement import placement_of
from trainer_service.core.provider import NoCheckpoints, TrainJob
from trainer_service.core.runner_settings import (
    Capabilities,
    Gpu,
    RunnerSettings,
    default_scratch_base,
)
from trainer_service.core.slots import SlotPool
from trainwire import contract
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointInfo, CheckpointStore

__all__ = [
    "Capabilities",
    "FinalCheckpoint",
    "Gpu",
    "Heartbeat",
    "JobObserver",
    "JobOutcome",
    "JobRunner",
    "JobStream",
    "NullJobObserver",
    "RunnerSettings",
    "RunningJob",
]

_LOGGER = logging.getLogger(__name__)


def _package_version(name: str) -> str:
    """The installed version of ``name`` without importing it; empty when not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class FinalCheckpoint:
    """What ``CancelJob`` with a checkpoint achieved.

    Attributes:
        last_episode: The job's last produced episode.
        checkpoint: The checkpoint of that episode, when it is in the store.
        error: Why there is none ("" when there is).
    """

    last_episode: int
    checkpoint: CheckpointInfo | None
    error: str


@dataclass(eq=False)
class _JobRecord:
    """One job the runner keeps, from its start until it is neither live nor running.

    Attributes:
        job: The job.
        slots: The slots it holds (released once its producer thread exited).
        live: Whether it is attachable by run id (grants, cancels, re-attaches find it).
        running: Whether its producer thread has not exited.
        expiry: Its detach grace timer, while it is live, detached and kept for a re-attach.
    """

    job: RunningJob
    slots: tuple[int, ...]
    live: bool = True
    running: bool = True
    expiry: threading.Timer | None = None


def _initial_hyperparameters(
    provider: Any, request: trainer_service_pb2.TrainRequest
) -> Hyperparameters:
    """What a job of ``request`` starts with, as its provider says (none when it does not)."""
    initial = getattr(provider, "hyperparameters", None)
    return initial(request.task) if callable(initial) else Hyperparameters()


def replaceable(stopped: bool, attached: bool) -> bool:
    """Whether a new job of a run may replace the run's live job: only one that stopped and
    that no stream reads (kept for a replay of its end); otherwise the new one is
    ``JobExists``."""
    return stopped and not attached


class JobRunner:
    """Starts training jobs in slots and keeps the live ones by run id.

    Args:
        registry: Provider name -> provider module (see ``trainer_service.providers``).
        slots: The trainer's job slots.
        settings: Device, paths and stream settings.
        server_version: Reported by :meth:`capabilities`.
        observer: Hears of job starts and ends, episodes, heartbeats, contract violations and
            checkpoints (the trainer's metrics); ignored by default.
        checkpoint_store: Where jobs write their checkpoints and find the ones they resume
            from; None: jobs write none and resume from none.
        gpus: Reads the GPUs the jobs may use, for :meth:`capabilities` (called on every
            call: it caches what it must); none by default.
    """

    def __init__(
        self,
        registry: ProviderLookup,
        slots: SlotPool,
        settings: RunnerSettings | None = None,
        server_version: str = "",
        observer: JobObserver | None = None,
        checkpoint_store: CheckpointStore | None = None,
        gpus: Callable[[], Sequence[Gpu]] = tuple,
    ) -> None:
        self._registry = registry
        self._gpus = gpus
        self.checkpoint_store = checkpoint_store
        self.observer: JobObserver = observer or NullJobObserver()
        self.slots = slots
        self.settings = settings or RunnerSettings()
        self._server_version = server_version
        self._jobs: dict[RunningJob, _JobRecord] = {}  # every live or running job (see above)
        self._cond = threading.Condition()
        self._shutting_down = False

    # -- starting and attaching --------------------------------------------------------------

    def open(self, request: trainer_service_pb2.TrainRequest) -> JobStream[RunningJob]:
        """A stream for a ``Train`` call: a new job, or a re-attach when the request asks.

        Raises:
            See :meth:`start` and :meth:`attach`.
        """
        if request.HasField("attach_after_episode"):
            return self.attach(request)
        return self.start(request)

    def start(self, request: trainer_service_pb2.TrainRequest) -> JobStream[RunningJob]:
        """Validates a request, takes a slot and starts its job; returns its stream.

        Raises:
            InvalidRequest: Bad fields (every one of them).
            ProviderError: The task's provider is not available on this trainer.
            JobExists: A job of this run is live.
            NoFreeSlot: Every slot is busy.
            ShuttingDown: The trainer is shutting down.
        """
        run_id = request.run_id
        if self._shutting_down:
            raise ShuttingDown(run_id)
        admitted = admit(
            request,
            self._registry,
            self.slots,
            self.settings.data_roots,
            self.settings.reward_modules,
        )
        kind = admitted.kind
        with self._cond:
            existing = self._live_record(run_id)
            if existing is not None:
                if not replaceable(existing.job.stopped, existing.job.attached):
                    raise JobExists(run_id)
                self._retire(existing)  # a finished job kept for a replay: a new one replaces it
            slots = self.slots.try_acquire(admitted.slots_needed)
            if slots is None:
                raise NoFreeSlot(run_id, self.slots.total)
            try:
                job = self._make_job(request, admitted.provider, kind, slots)
            except BaseException:
                self.slots.release(slots)
                raise
            self._jobs[job] = _JobRecord(job, slots)
            stream = job.attach(0, request.grant_through_episode)
        _LOGGER.info(
            "run %s: %s job started on %s (%d/%d slots busy)",
            run_id,
            kind,
            ", ".join(job.devices),
            self.slots.total - self.slots.free,
            self.slots.total,
            extra={"run_id": run_id},
        )
        self.observer.job_started(run_id, kind)
        job.start()
        return stream

    def attach(self, request: trainer_service_pb2.TrainRequest) -> JobStream[RunningJob]:
        """Re-attaches a stream to the live job of ``request.run_id`` after
        ``attach_after_episode``; a larger ``grant_through_episode`` moves its grant.

        Raises:
            InvalidRequest: Bad fields, or a task/config other than the job's.
            JobNotFound: No job of this run is live.
            EpisodesNotHeld: The job no longer holds the episodes asked for.
            ShuttingDown: The trainer is shutting down.
        """
        run_id = request.run_id
        if self._shutting_down:
            raise ShuttingDown(run_id)
        violations = check_request(request)
        after = request.attach_after_episode
        if after < 0:
            violations.append(
                contract.FieldViolation("attach_after_episode", f"{after}; need >= 0")
            )
        if violations:
            raise InvalidRequest(run_id, violations)
        with self._cond:
            record = self._live_record(run_id)
            if record is None:
                raise JobNotFound(run_id)
            job = record.job
            # The gateway sends the run's task, with the hyperparameters it changed since.
            if not same_but_hyperparameters(job.task, request.task) or (
                job.config != request.config
            ):
                raise InvalidRequest(
                    run_id,
                    [contract.FieldViolation("task", "differs from the live job's task/config")],
                )
            stream = job.attach(after, request.grant_through_episode)
            timer, record.expiry = record.expiry, None
        if timer is not None:
            timer.cancel()
        _LOGGER.info(
            "run %s: stream re-attached after episode %d (job at %d, grant %d)",
            run_id,
            after,
            job.produced,
            job.grant,
            extra={"run_id": run_id},
        )
        return stream

    def _make_job(
        self,
        request: trainer_service_pb2.TrainRequest,
        provider: Any,
        kind: str,
        slots: tuple[int, ...],
    ) -> RunningJob:
        holder: list[RunningJob] = []
        devices = tuple(self.slots.devices[i] or self.settings.device for i in slots)
        checkpoints = self._job_checkpoints(request, provider, kind, holder)
        train_job = TrainJob(
            run_id=request.run_id,
            task=request.task,
            config=request.config,
            device=devices[0],
            data_root=self.settings.data_roots[0],
            more_data_roots=self.settings.data_roots[1:],
            image_cache_dir=self.settings.image_cache_dir,
            stop_event=threading.Event(),
            set_phase=lambda phase: holder[0].set_phase(phase),
            devices=devices,
            checkpoints=checkpoints if checkpoints is not None else NoCheckpoints(),
            hyperparameters=LiveHyperparameters(_initial_hyperparameters(provider, request)),
            placement=placement_of(request),
            rendezvous_host=self.settings.rendezvous_host,
            announce_rendezvous=lambda address: holder[0].announce_rendezvous(address),
            reward_modules=self.settings.reward_modules,
            scratch_dir=self.settings.scratch_dir,
        )
        job = RunningJob(
            train_job,
            provider,
            kind,
            heartbeat_s=self.settings.heartbeat_s,
            queue_size=self.settings.queue_size,
            retain=self.settings.retain,
            grant=request.grant_through_episode,
            on_exit=self._exited,
            observer=self.observer,
            checkpoints=checkpoints,
            resume_from=request.resume_from,
        )
        holder.append(job)
        return job

    def _job_checkpoints(
        self,
        request: trainer_service_pb2.TrainRequest,
        provider: Any,
        kind: str,
        holder: list[RunningJob],
    ) -> JobCheckpoints | None:
        """The job's ``Checkpoints`` over the store (None without a store)."""
        if self.checkpoint_store is None:
            return None
        scratch_base = self.settings.scratch_dir or default_scratch_base()
        return JobCheckpoints(
            self.checkpoint_store,
            request.run_id,
            kind,
            every=request.config.checkpoint_every
            or int(getattr(provider, "DEFAULT_CHECKPOINT_EVERY", 0)),
            max_episodes=request.config.max_episodes,
            scratch_root=scratch_base / f"{request.run_id}-{uuid.uuid4().hex[:8]}",
            meta=job_meta(request.task, request.config),
            on_change=lambda: holder[0].wake() if holder else None,
            observer=self.observer,
        )

    # -- live jobs ---------------------------------------------------------------------------

    def _live_record(self, run_id: str) -> _JobRecord | None:
        """The record of the live job of ``run_id`` (call with ``_cond`` held)."""
        for record in self._jobs.values():
            if record.live and record.job.run_id == run_id:
                return record
        return None

    def _find(self, run_id: str) -> _JobRecord:
        """The record of the live job of ``run_id`` (call with ``_cond`` held).

        Raises:
            InvalidRequest: A bad run id.
            JobNotFound: No job of this run is live.
        """
        violations = contract.check_run_id(run_id)
        if violations:
            raise InvalidRequest(run_id, violations)
        record = self._live_record(run_id)
        if record is None:
            raise JobNotFound(run_id)
        return record

    def grant(self, run_id: str, through_episode: int) -> int:
        """Moves a job's grant forward; returns its last produced episode.

        Raises:
            InvalidRequest: A negative ``through_episode``.
            JobNotFound: No job of this run is live.
        """
        if through_episode < 0:
            raise InvalidRequest(
                run_id,
                [contract.FieldViolation("through_episode", f"{through_episode}; need >= 0")],
            )
        with self._cond:
            job = self._find(run_id).job
        return job.move_grant(through_episode)

    def set_hyperparameters(
        self, run_id: str, change: Hyperparameters
    ) -> tuple[Hyperparameters, int]:
        """Changes a live job's hyperparameters from its next optimizer step; returns the values
        that step trains with and the job's last produced episode.

        Raises:
            InvalidRequest: None set, a value out of range, one the job's kind does not have,
                or one its provider refuses (beta for a GRPO job without a reference model).
            JobNotFound: No job of this run is live.
            JobFinished: The job produced its last episode, or stopped.
        """
        with self._cond:
            job = self._find(run_id).job
        check_change(run_id, job.provider, job.kind, job.task, change)
        return job.set_hyperparameters(change)

    def cancel_job(self, run_id: str) -> int:
        """Cancels a live job at once (attached or not); returns its last produced episode.

        Raises:
            JobNotFound: No job of this run is live.
        """
        with self._cond:
            record = self._find(run_id)
            self._retire(record)
        job = record.job
        job.cancel("cancelled")
        _LOGGER.info(
            "run %s: job cancelled at episode %d", run_id, job.produced, extra={"run_id": run_id}
        )
        return job.produced

    def cancel_with_checkpoint(self, run_id: str, timeout: float) -> FinalCheckpoint:
        """Cancels a live job after a final checkpoint of its last episode (stop, park): the
        episode in flight is finished, the provider writes the checkpoint as it stops. Blocks
        until the job stopped, at most ``timeout`` seconds (run it in a thread). A job that had
        not trained an episode stops at once, with no checkpoint.

        Raises:
            JobNotFound: No job of this run is live.
        """
        with self._cond:
            record = self._find(run_id)
            self._retire(record)
        job = record.job
        _LOGGER.info(
            "run %s: job cancelled at episode %d, after a final checkpoint",
            run_id,
            job.produced,
            extra={"run_id": run_id},
        )
        job.cancel("cancelled", checkpoint=True)
        if not job.join(timeout):
            return FinalCheckpoint(
                job.produced,
                None,
                f"the final checkpoint was not written within {timeout:g} s",
            )
        info, error = job.final_checkpoint()
        if info is None:
            _LOGGER.warning(
                "run %s: no final checkpoint: %s", run_id, error, extra={"run_id": run_id}
            )
        return FinalCheckpoint(job.produced, info, error)

    def detach(self, stream: JobStream[RunningJob]) -> None:
        """Called when a stream's RPC ended for any reason. A job with a grant stays in the
        table for ``detach_grace_s`` seconds for a re-attach: one left undelivered (its stream
        broke) is then cancelled; a delivered one (its end went out) computes nothing more, but
        its held episodes and its end can still be replayed, for a gateway that received them
        and restarted before it had stored them all (a paced run's last episodes wait in the
        gateway's memory until their time comes). Any other job leaves the table at once."""
        job = stream.job
        undelivered = job.detach(stream)
        if undelivered is None:
            return  # detached before, or replaced by a re-attach
        with self._cond:
            record = self._jobs.get(job)
            if record is None or not record.live:
                return
            grace = self.settings.detach_grace_s
            # A job without a grant is direct use (grpcurl, a script): nobody will re-attach.
            if grace <= 0 or self._shutting_down or not job.grant:
                self._retire(record)
            else:
                timer = threading.Timer(grace, self._expire, args=(job,))
                timer.daemon = True
                if record.expiry is not None:
                    record.expiry.cancel()
                record.expiry = timer
                timer.start()
                if undelivered:
                    _LOGGER.info(
                        "run %s: stream broke at episode %d; job kept %g s for a re-attach",
                        job.run_id,
                        stream.cursor,
                        grace,
                        extra={"run_id": job.run_id},
                    )
                return
        if undelivered:
            job.cancel("cancelled")

    def _expire(self, job: RunningJob) -> None:
        with self._cond:
            record = self._jobs.get(job)
            if record is None or not record.live or job.attached:
                return
            self._retire(record)
        if not job.stopped:
            _LOGGER.info(
                "run %s: nobody re-attached within %g s; job cancelled",
                job.run_id,
                self.settings.detach_grace_s,
                extra={"run_id": job.run_id},
            )
        job.cancel("cancelled")

    def _retire(self, record: _JobRecord) -> None:
        """Makes a live job no longer live: it cannot be found by run id any more (call with
        ``_cond`` held)."""
        record.live = False
        if record.expiry is not None:
            record.expiry.cancel()
            record.expiry = None
        self._forget_if_done(record)

    def _forget_if_done(self, record: _JobRecord) -> None:
        """Drops a record that is neither live nor running (call with ``_cond`` held)."""
        if not (record.live or record.running):
            del self._jobs[record.job]

    def _exited(self, job: RunningJob) -> None:
        """Called by a job thread once its provider has stopped."""
        with self._cond:
            record = self._jobs[job]
        slots = record.slots
        self.slots.release(slots)
        with self._cond:
            record.running = False
            self._forget_if_done(record)
            self._cond.notify_all()
        _LOGGER.debug("run %s: job thread exited, slots %s released", job.run_id, slots)

    @property
    def providers(self) -> ProviderLookup:
        """The provider registry jobs start from (merged downloads find their provider there)."""
        return self._registry

    def job(self, run_id: str) -> RunningJob | None:
        """The live job of ``run_id``, if any."""
        with self._cond:
            record = self._live_record(run_id)
            return record.job if record is not None else None

    @property
    def active_jobs(self) -> int:
        """Number of jobs whose threads have not exited yet."""
        with self._cond:
            return sum(record.running for record in self._jobs.values())

    @property
    def live_jobs(self) -> int:
        """Number of jobs that can be granted, cancelled or re-attached."""
        with self._cond:
            return sum(record.live for record in self._jobs.values())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no job thread is left; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(record.running for record in self._jobs.values()), timeout
            )

    def shutdown(self) -> None:
        """Refuses new jobs and stops every job at its next episode."""
        with self._cond:
            self._shutting_down = True
            records = list(self._jobs.values())  # every live or running job
            for record in records:
                if record.live:
                    self._retire(record)
        jobs = [record.job for record in records]
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
            gpus=tuple(self._gpus()),
            reward_functions=self._reward_functions(),
            provider_defaults=self._provider_defaults(),
        )

    def _provider_defaults(self) -> dict[str, trainer_service_pb2.ProviderDefaults]:
        """Each available provider's defaults (those that say them), by name."""
        found: dict[str, trainer_service_pb2.ProviderDefaults] = {}
        for kind in self._registry.available():
            defaults = getattr(self._registry.get(kind), "defaults", None)
            if defaults is not None:
                found[kind] = defaults()
        return found

    def _reward_functions(self) -> tuple[str, ...]:
        """Every reward name the providers offer here (those that have rewards), in order."""
        names: list[str] = []
        for kind in self._registry.available():
            offered = getattr(self._registry.get(kind), "reward_functions", None)
            if offered is not None:
                names.extend(n for n in offered(self.settings.reward_modules) if n not in names)
        return tuple(names)
