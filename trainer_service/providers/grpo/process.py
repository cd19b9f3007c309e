"""The ``grpo`` provider as the trainer runs it: every job in a process group of its own.

A job in processes of its own keeps a CUDA out-of-memory, a crash in a kernel or a leak from
hitting the whole service, keeps the forking of DataLoader workers away from gRPC's threads, and
lets a job use several devices. A job is ``num_processes`` processes (:mod:`.worker`, one per
device, rank 0 first), forked by the trainer's rank launcher (:mod:`.launch`) for the job's
producer thread, in a new process group led by rank 0. :func:`run` looks like any other provider
to the service's ``RunningJob``: a generator of episodes, pulled one credited episode at a time.
Each pull sends ``STEP n`` to every rank (:mod:`.wire`) and returns the episode rank 0 sends
back, so a job computes exactly the steps it has credit for; grants, detach/re-attach and the
contract check are the service's (``trainer_service.core.job``). A change of the job's
hyperparameters (``job.hyperparameters``) goes to every rank as ``HYPER`` right before the
``STEP`` it applies to.

Stopping (cancel, shutdown, a closed generator): ``STOP`` to every rank (each finishes the step
in flight, so the stop reaches every rank within one optimizer step), up to
:data:`STOP_GRACE_S` for them to say ``END``, then ``SIGKILL`` to the whole process group (the
fork servers, DataLoader workers and resource trackers below the ranks included), then every
rank is reaped. Only then does the generator return, and the runner frees the job's slots.

Failures: a rank that reports ``ERROR``, closes its channel without ``END`` or exits ends the
job. The trainer keeps listening for :data:`SETTLE_S` (a rank's death makes its peers fail in
their next collective, and the first failure is the cause), kills the group, reaps it, and
raises a :class:`ProviderError` naming what happened: a rank killed by a signal (for
``SIGKILL``, the out-of-memory advice), a ``ProviderError`` of a rank as the rank raised it (a
bad dataset row, GPU out of memory), another exception by its type (traceback in the log), or
an exit code. The service and its other jobs go on.

The trainer dying (``kill -9`` included): see :mod:`.lifeline`; every rank kills its group.

A job whose ranks span trainers (``job.placement``) is one process group per trainer, each
trainer starting, watching and reaping its own share of ranks as above. Rank 0's trainer binds
the job's rendezvous on its ``--rendezvous-host`` (:func:`.launch.rendezvous_listener`),
announces it (``job.announce_rendezvous``), starts its ranks from rank 0 and drives them as any
job: its ``STEP``, ``STOP``, ``SAVE`` and ``HYPER`` reach the other trainers' ranks through rank
0 (:mod:`.rendezvous`), and it yields the episodes and writes the checkpoints. Another
trainer's share (:func:`run` with ``placement.first_rank`` > 0) starts its ranks, sends them
nothing but their job spec (and ``STOP`` when it is cancelled), yields no episode and returns
once all of them said ``END``; one that fails fails it (:class:`ProviderError`). Its ranks
send their part of a checkpoint to rank 0 and write nothing: the share writes, commits and
deletes no checkpoint. A share resumed from a checkpoint restores it from this trainer's
checkpoint store (every trainer of such a job must share one store) or fails with
``FAILED_PRECONDITION``. When any trainer of the job dies, its ranks die with it, and the
others fail within seconds: rank 0 in its next collective or when a follower's heartbeat
stops, the other trainers' ranks when the store is gone.

Checkpoints (``job.checkpoints``; what one holds: :mod:`.checkpoint_files`): the ranks can only
checkpoint the step at whose end they wait, so the trainer asks (``SAVE``) between a step's
episode and the next ``STEP``: after yielding episode ``n`` (the consumer has it: only then may
the checkpoint be committed), when it is pulled again or closed, if ``due(n)`` (true for the
last step too), or at a stop if ``final_wanted()``. A stop that comes while a step runs lets the
step finish and yields its episode when a final checkpoint is wanted (the ranks are past the
previous boundary: only this step can be checkpointed), else returns at once as before. A
write that fails (a full disk) is logged and reported (``fail``), never committed; training
goes on. Resuming
(``job.resume``) is checked here first (:func:`.checkpoint_files.check_resume`, no rank
started); what only loading shows, the ranks report as :class:`CheckpointUnusable` before the
first episode.

Starting a rank (command line, environment, job spec) is :mod:`.launch`; the per-rank record and
the reading of a failure are :mod:`.ranks`; this module drives the job: steps, watching,
stopping, killing and reaping.

This module imports neither torch nor grpc: the trainer process never loads the training stack
for GRPO.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import os
import pathlib
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

from trainer_service.core.placement import Placement
from trainer_service.core.provider import CheckpointUnusable, ProviderError, TrainJob
from trainer_service.providers.defaults import GRPO
from trainer_service.providers.grpo import checkpoint_files, launch, wire
from trainer_service.providers.grpo.ranks import Rank, diagnose, exit_of
from trainer_service.providers.grpo.validation import resolve_in_roots
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2
from trainwire_ops.addresses import host_port

_LOGGER = logging.getLogger(__name__)

#: After STOP, how long the ranks get to finish the step in flight before the group is killed.
STOP_GRACE_S = 5.0
#: After the done episode, how long the ranks get to report END.
DONE_GRACE_S = 60.0
#: After the first failure, how long the trainer keeps listening for its cause.
SETTLE_S = 2.0
#: A rank silent this long (no message, not even a BEAT) is named in the job's phase.
SILENT_S = 15.0
#: After a stop that wants a final checkpoint, how long the step in flight may take to finish.
FINAL_STEP_S = 300.0
_POLL_S = 0.1


def processes_of(task: episode_pb2.TrainTask) -> int:
    """How many processes (and trainer slots) a GRPO task runs on: ``num_processes``, the
    default if 0."""
    return max(1, task.grpo.num_processes or GRPO.num_processes)


class JobProcesses:
    """The processes of one GRPO job: started, stepped, watched, stopped and reaped.

    Args:
        job: The job (its ``devices`` name one device per process; with fewer, every process
            runs on ``job.device``).
        processes: How many processes (this trainer's share of a job that spans trainers).
    """

    def __init__(self, job: TrainJob, processes: int) -> None:
        self.job = job
        self.processes = processes
        placement = job.placement
        #: The job's ranks in all (more than this trainer's for a job that spans trainers).
        self.world_size = placement.world_size if placement is not None else processes
        self.first_rank = placement.first_rank if placement is not None else 0
        self.ranks: list[Rank] = []
        self.pgid: int | None = None
        self.scratch: pathlib.Path | None = None
        #: The step at whose end every rank waits (None while one runs, or after a failure).
        self.boundary: int | None = None
        self._episode: episode_pb2.Episode | None = None
        self._saved: dict[str, object] | None = None
        self._stopping = False
        self._killed = False
        self._phase = "starting"
        self._silence_shown = False

    # -- starting ----------------------------------------------------------------------------

    def start(self, resume: dict[str, object] | None = None) -> None:
        """Starts every rank in one new process group and sends each its job spec.

        Args:
            resume: The checked checkpoint to resume from (see :func:`launch.job_spec`).

        Raises:
            ProviderError: A process could not be started.
        """
        devices, backend, extra = launch.rank_devices(self.job, self.processes)
        placement = self.job.placement
        listener, address = None, ""
        if placement is not None:
            if placement.hosts_rendezvous:
                listener = launch.rendezvous_listener(self.job.rendezvous_host)
                address = host_port(self.job.rendezvous_host, listener.getsockname()[1])
            else:
                address = placement.rendezvous
        try:
            if placement is not None:
                extra = {**extra, **launch.meeting_env(self.job, address, backend)}
                if listener is not None:
                    self.job.announce_rendezvous(address)
            if self.job.scratch_dir is not None:
                self.job.scratch_dir.mkdir(parents=True, exist_ok=True)
            scratch = self.scratch = pathlib.Path(
                tempfile.mkdtemp(prefix=f"grpo-{self.job.run_id}-", dir=self.job.scratch_dir)
            )
            for rank in range(self.processes):
                env = launch.rank_env(extra, rank, self.processes, placement)
                meeting: dict[str, object] | None = None
                if placement is not None:
                    meeting = launch.meeting_spec(placement, rank, address)
                started, channel = launch.spawn_rank(env, self.pgid, rank, listener)
                if listener is not None:
                    # Rank 0 holds it now: once rank 0 is gone, nothing answers there.
                    listener.close()
                    listener = None
                if self.pgid is None:
                    self.pgid = started.pid
                self.ranks.append(Rank(self.first_rank + rank, started, channel))
                spec = launch.job_spec(
                    self.job, rank, self.processes, devices[rank], backend, scratch, resume, meeting
                )
                channel.send_json(wire.JOB, spec)
        finally:
            if listener is not None:
                listener.close()
        where = f" of {self.world_size}, meeting at {address}" if placement is not None else ""
        _LOGGER.info(
            "run %s: GRPO job started in %d process(es)%s %s on %s",
            self.job.run_id,
            self.processes,
            where,
            {r.rank: r.pid for r in self.ranks},
            ", ".join(devices),
            extra={"run_id": self.job.run_id},
        )

    # -- running -----------------------------------------------------------------------------

    def step(self, step: int) -> episode_pb2.Episode | None:
        """Lets every rank run optimizer step ``step``; returns rank 0's episode of it.

        Returns:
            The episode, or ``None`` once the job's stop event is set (after the step in flight
            when a final checkpoint is wanted, see the module docstring).

        Raises:
            ProviderError: A rank failed, or training ended before this step.
            CheckpointUnusable: The checkpoint the job resumes from did not load.
        """
        if self.job.stop_event.is_set():
            return None
        for rank in self.ranks:  # the same message to every rank, in rank order
            rank.channel.send_step(step)
        self.boundary = None
        self._episode = None
        finish_by: float | None = None
        while self._episode is None:
            if self.job.stop_event.is_set():
                if finish_by is None:
                    if not self.job.checkpoints.final_wanted():
                        return None
                    finish_by = time.monotonic() + FINAL_STEP_S
                elif time.monotonic() > finish_by:
                    return None
            self._pump(_POLL_S)
            self._raise_on_failure()
            if self.ranks[0].ended and self._episode is None:
                raise ProviderError(
                    "Training ended before the requested number of steps.",
                    detail=f"rank 0 ended before step {step} of {self.job.config.max_episodes}",
                    code="INTERNAL",
                    reason="ENDED_EARLY",
                )
        self.boundary = step
        return self._episode

    def set_hyperparameters(self, change: Hyperparameters) -> None:
        """Has every rank train its next step with ``change`` (``HYPER``, sent before that
        step's ``STEP``: all ranks apply it at the same boundary)."""
        values = change.as_dict()
        for rank in self.ranks:
            rank.channel.send_json(wire.HYPER, values)
        _LOGGER.info(
            "run %s: the next step trains with %s",
            self.job.run_id,
            change.describe(),
            extra={"run_id": self.job.run_id},
        )

    def checkpoint(self, step: int, directory: pathlib.Path) -> dict[str, object]:
        """Has the ranks checkpoint step ``step`` (they wait at its end) into ``directory``.

        Returns:
            Rank 0's ``SAVED`` report (:func:`wire.saved_payload`): ``error`` is set when the
            checkpoint could not be written.

        Raises:
            ProviderError: A rank failed.
        """
        if self.boundary != step:
            raise RuntimeError(f"the ranks are not at the end of step {step}")
        request = {"step": step, "directory": str(directory)}
        for rank in self.ranks:
            rank.channel.send_json(wire.SAVE, request)
        self._saved = None
        try:
            while self._saved is None:
                self._pump(_POLL_S)
                self._raise_on_failure()
                if self.ranks[0].ended:
                    raise ProviderError(
                        "Training ended while a checkpoint was written.",
                        detail=f"rank 0 ended before it saved step {step}",
                        code="INTERNAL",
                        reason="ENDED_EARLY",
                    )
        except BaseException:
            self.boundary = None
            raise
        return self._saved

    def follow(self) -> None:
        """Another trainer's share of a job: waits until every rank of it said ``END`` (rank 0
        drives them, see the module docstring), or the job's stop event is set.

        Raises:
            ProviderError: A rank failed.
            CheckpointUnusable: The checkpoint the job resumes from did not load.
        """
        while not all(r.ended for r in self.ranks):
            if self.job.stop_event.is_set():
                return
            self._pump(_POLL_S)
            self._raise_on_failure()

    def finish(self) -> None:
        """After the done episode: lets every rank end and waits (bounded) for their ``END``."""
        for rank in self.ranks:
            if not (rank.ended or rank.closed):
                rank.channel.send(wire.STOP)
        deadline = time.monotonic() + DONE_GRACE_S
        while not all(r.ended or r.closed for r in self.ranks) and time.monotonic() < deadline:
            self._pump(_POLL_S)
        for rank in self.ranks:
            if rank.error is not None:  # every episode is out: the job is done regardless
                _LOGGER.warning(
                    "run %s: rank %d failed after the last step: %s",
                    self.job.run_id,
                    rank.rank,
                    rank.error.get("detail") or rank.error.get("user_message"),
                    extra={"run_id": self.job.run_id},
                )

    def _pump(self, timeout: float) -> None:
        """Reads what the ranks sent within ``timeout`` seconds and notes who exited."""
        listening = [r.channel.connection for r in self.ranks if not r.closed]
        ready = multiprocessing.connection.wait(listening, timeout)
        for rank in self.ranks:
            if rank.closed or rank.channel.connection not in ready:
                continue
            messages, closed = rank.channel.read_available()
            now = time.monotonic()
            rank.last_heard = now
            for kind, payload in messages:
                self._handle(rank, kind, payload)
            if closed:
                rank.closed = True
                if rank.channel.failure is not None:  # a broken peer, not a plain exit
                    _LOGGER.error(
                        "run %s: rank %d: %s", self.job.run_id, rank.rank, rank.channel.failure
                    )
                if not rank.ended and rank.failed_at is None:
                    rank.failed_at = now
        for rank in self.ranks:
            if rank.exit_status is None:
                rank.exit_status = exit_of(rank.process)
                if rank.exit_status is not None and not rank.ended and rank.failed_at is None:
                    rank.failed_at = time.monotonic()
        self._show_silence()

    def _handle(self, rank: Rank, kind: bytes, payload: bytes) -> None:
        if kind == wire.EPISODE and rank.rank == 0:
            self._episode = episode_pb2.Episode.FromString(payload)
        elif kind == wire.SAVED and rank.rank == 0:
            self._saved = dict(json.loads(payload))
        elif kind == wire.PHASE:
            rank.phase = payload.decode(errors="replace")
            if rank is self.ranks[0]:
                self._phase = rank.phase
                self.job.set_phase(rank.phase)
        elif kind == wire.ERROR:
            if rank.error is None:
                rank.error = dict(json.loads(payload))
                rank.failed_at = rank.failed_at or time.monotonic()
        elif kind == wire.END:
            rank.ended = True
            rank.last_step = wire.step_of(payload) if payload else None

    def _show_silence(self) -> None:
        now = time.monotonic()
        silent = [(now - r.last_heard, r.rank) for r in self.ranks if not (r.closed or r.ended)]
        quiet = max(silent, default=(0.0, 0))
        if quiet[0] >= SILENT_S:
            self.job.set_phase(f"{self._phase} (process rank {quiet[1]} silent {quiet[0]:.0f} s)")
            self._silence_shown = True
        elif self._silence_shown:
            self.job.set_phase(self._phase)
            self._silence_shown = False

    # -- failures ----------------------------------------------------------------------------

    def _raise_on_failure(self) -> None:
        if self._stopping or not any(r.failed_at is not None for r in self.ranks):
            return
        # One rank's death makes its peers fail in their next collective: listen a little
        # longer so the cause (the first failure) is known, then end the whole group.
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and not all(
            r.exit_status is not None or r.closed for r in self.ranks
        ):
            self._pump(_POLL_S)
        for rank in self.ranks:
            if rank.closed and rank.exit_status is None:
                rank.exit_status = exit_of(rank.process, wait_s=0.5)
        error = self.diagnose()
        self._kill()
        raise error

    def diagnose(self) -> ProviderError | CheckpointUnusable:
        """What went wrong, as the user should read it (call once a rank failed)."""
        return diagnose(self.ranks, self.world_size)

    # -- stopping ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the job (``STOP``, a grace, then ``SIGKILL`` to the group) and reaps it.

        Idempotent; every process of the job is gone when it returns.
        """
        if not self.ranks and self.scratch is None:
            return
        self._stopping = True
        if not self._killed:
            for rank in self.ranks:
                if not (rank.ended or rank.closed):
                    rank.channel.send(wire.STOP)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and not all(r.ended or r.closed for r in self.ranks):
                self._pump(_POLL_S)
        self._kill()
        self._reap()
        _LOGGER.info(
            "run %s: GRPO training ended after %d steps, every process of the job is gone "
            "(last step of each rank: %s)",
            self.job.run_id,
            max((r.last_step or 0 for r in self.ranks), default=0),
            {r.rank: r.last_step for r in self.ranks},
            extra={"run_id": self.job.run_id},
        )
        for rank in self.ranks:
            rank.channel.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        self.ranks = []

    def _kill(self) -> None:
        """SIGKILL to the job's process group. Its id stays reserved while any member lives (the
        launcher may have reaped the leader); once none does, the kill finds nothing, unless the
        id was handed out again, which takes the machine's pids wrapping around meanwhile."""
        if self._killed or self.pgid is None:
            return
        self._killed = True
        self.boundary = None
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - a group we do not own: never expected
            _LOGGER.error("run %s: may not kill process group %d", self.job.run_id, self.pgid)

    def _reap(self) -> None:
        """Waits for every rank; then for any other member of the group that became our child
        (a trainer that is PID 1 or a subreaper adopts the orphaned fork servers and workers)."""
        for rank in self.ranks:
            rank.process.join(30)
            if rank.process.exitcode is None:  # pragma: no cover - SIGKILL cannot be ignored
                _LOGGER.error("run %s: rank %d did not exit", self.job.run_id, rank.rank)
        if self.pgid is None:
            return
        deadline = time.monotonic() + 2.0
        while True:
            try:
                pid, _ = os.waitpid(-self.pgid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def _checked_resume(job: TrainJob, processes: int) -> dict[str, object] | None:
    """The resume part of the ranks' job spec, once ``job.resume`` is checked (None: none).

    Raises:
        CheckpointUnusable: It does not fit this job.
    """
    resume = job.resume
    if resume is None:
        return None
    if resume.episode >= job.config.max_episodes:
        raise CheckpointUnusable(
            f"it was taken after step {resume.episode}, and this job ends at step "
            f"{job.config.max_episodes}"
        )
    model_dir = resolve_in_roots(job.data_roots, job.task.grpo.model_path)
    lora = job.task.grpo.HasField("lora")
    record = checkpoint_files.check_resume(resume, model_dir, processes, lora=lora)
    return {
        "directory": str(resume.directory),
        "episode": resume.episode,
        "best_reward": resume.best_reward,
        "last_reward": record.get("last_reward"),
    }


class _Committer:
    """When the job's checkpoints are written, and their commit after their episode."""

    def __init__(self, job: TrainJob, group: JobProcesses, start: int) -> None:
        self.job = job
        self.group = group
        self.last: episode_pb2.Episode | None = None  #: the last episode yielded
        self.saved = start  #: the last step checkpointed (or resumed from)

    def after(self, episode: episode_pb2.Episode) -> None:
        """Called once ``episode`` is yielded and the consumer is back: writes its checkpoint
        if it is due (``due`` says so for the last step too)."""
        if self.job.checkpoints.due(episode.episode):
            self.write(episode)

    def final(self) -> None:
        """Called as the job ends: checkpoints the last episode yielded if that is due or a
        final checkpoint is wanted, the ranks still wait at its end and it was not done yet.
        A failure is logged: the job ends either way."""
        last = self.last
        if last is None or last.episode <= self.saved or self.group.boundary != last.episode:
            return
        if not (self.job.checkpoints.due(last.episode) or self.job.checkpoints.final_wanted()):
            return
        try:
            self.write(last)
        except ProviderError as exc:
            _LOGGER.error(
                "run %s: the final checkpoint (step %d) failed: %s",
                self.job.run_id,
                last.episode,
                exc,
                extra={"run_id": self.job.run_id},
            )

    def write(self, episode: episode_pb2.Episode) -> None:
        """Checkpoints ``episode``'s step and commits it (``commit`` never raises)."""
        step = episode.episode
        self.saved = step
        directory = self.job.checkpoints.scratch(step)
        report = self.group.checkpoint(step, directory)
        if report.get("error"):
            _LOGGER.error(
                "run %s: the checkpoint of step %d could not be written, training goes on: %s",
                self.job.run_id,
                step,
                report["error"],
                extra={"run_id": self.job.run_id},
            )
            self.job.checkpoints.fail(step, str(report["error"]), directory)
            return
        _LOGGER.info(
            "run %s: checkpoint of step %d written in %.2f s (%d bytes)",
            self.job.run_id,
            step,
            float(report.get("seconds") or 0.0),  # type: ignore[arg-type]
            int(report.get("size") or 0),  # type: ignore[call-overload]
            extra={"run_id": self.job.run_id},
        )
        self.job.checkpoints.commit(step, episode.best_reward, directory)


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` in its own processes; yields one episode per optimizer step, each step
    run only when the consumer asks for its episode, and writes the job's checkpoints (see the
    module docstring). Another trainer's share of a job that spans trainers yields nothing
    and returns once its ranks are done.

    Raises:
        ProviderError: A rank failed (named in the message) or training ended early.
        CheckpointUnusable: ``job.resume`` does not fit or load (before the first episode).
    """
    placement = job.placement
    if placement is not None and not placement.hosts_rendezvous:
        _run_share(job, placement)
        return
    processes = placement.processes if placement is not None else processes_of(job.task)
    # A checkpoint holds the state of every rank of the job, wherever they run.
    resume = _checked_resume(job, processes_of(job.task))
    start = job.resume.episode if job.resume is not None else 0
    group = JobProcesses(job, processes)
    committer = _Committer(job, group, start)
    job.set_phase(f"starting {processes} process{'es' if processes > 1 else ''}")
    try:
        group.start(resume)
        for step in range(start + 1, job.config.max_episodes + 1):
            change = job.hyperparameters.take()
            if change is not None:
                group.set_hyperparameters(change)
            episode = group.step(step)
            if episode is None:
                return  # stopped
            committer.last = episode  # closed at the yield, the job still ends with it
            yield episode
            committer.after(episode)
            if episode.done:
                break
        group.finish()
    finally:
        committer.final()
        group.close()


def _run_share(job: TrainJob, placement: Placement) -> None:
    """Runs another trainer's share of a job that spans trainers until its ranks are done (see
    the module docstring).

    Raises:
        ProviderError: A rank failed, or the checkpoint the job resumes from does not fit or
            load here (``FAILED_PRECONDITION``: a share never trains from scratch beside a
            resumed rank 0).
    """
    ranks = placement.ranks
    job.set_phase(f"starting ranks {ranks.start}..{ranks.stop - 1} of {placement.world_size}")
    group = JobProcesses(job, placement.processes)
    try:
        group.start(_checked_resume(job, placement.world_size))
        group.follow()
    except CheckpointUnusable as exc:
        episode = job.resume.episode if job.resume is not None else 0
        raise ProviderError(
            f"This trainer cannot restore the checkpoint at episode {episode} that the job "
            f"resumes from: {exc}",
            detail=f"run {job.run_id}: ranks {ranks.start}..{ranks.stop - 1}",
        ) from exc
    finally:
        group.close()
