"""The ``grpo`` provider as the trainer runs it: every job in a process group of its own.

A job in processes of its own keeps a CUDA out-of-memory, a crash in a kernel or a leak from
hitting the whole service, keeps the forking of DataLoader workers away from gRPC's threads, and
lets a job use several devices. A job is ``num_processes`` processes
(``python -m trainer_service.providers.grpo.worker``, one per device, rank 0 first), started by
the job's producer thread in a new process group led by rank 0. :func:`run` looks like any other
provider to the service's ``RunningJob``: a generator of episodes, pulled one credited episode at
a time. Each pull sends ``STEP n`` to every rank (:mod:`.wire`) and returns the episode rank 0
sends back, so a job computes exactly the steps it has credit for; grants, detach/re-attach and
the contract check are the service's (``trainer_service.core.job``).

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
import subprocess
import tempfile
import time
from collections.abc import Iterator

from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.grpo import launch, wire
from trainer_service.providers.grpo.ranks import Rank, diagnose, peek_exit
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: After STOP, how long the ranks get to finish the step in flight before the group is killed.
STOP_GRACE_S = 5.0
#: After the done episode, how long the ranks get to report END.
DONE_GRACE_S = 60.0
#: After the first failure, how long the trainer keeps listening for its cause.
SETTLE_S = 2.0
#: A rank silent this long (no message, not even a BEAT) is named in the job's phase.
SILENT_S = 15.0
_POLL_S = 0.1


def processes_of(task: episode_pb2.TrainTask) -> int:
    """How many processes (and trainer slots) a GRPO task runs on: ``num_processes``, 1 if 0."""
    return max(1, task.grpo.num_processes)


class JobProcesses:
    """The processes of one GRPO job: started, stepped, watched, stopped and reaped.

    Args:
        job: The job (its ``devices`` name one device per process; with fewer, every process
            runs on ``job.device``).
        processes: How many processes.
    """

    def __init__(self, job: TrainJob, processes: int) -> None:
        self.job = job
        self.processes = processes
        self.ranks: list[Rank] = []
        self.pgid: int | None = None
        self.scratch: pathlib.Path | None = None
        self._episode: episode_pb2.Episode | None = None
        self._stopping = False
        self._killed = False
        self._phase = "starting"
        self._silence_shown = False

    # -- starting ----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts every rank in one new process group and sends each its job spec.

        Raises:
            ProviderError: A process could not be started.
        """
        devices, backend, extra = launch.rank_devices(self.job, self.processes)
        scratch = self.scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"grpo-{self.job.run_id}-"))
        for rank in range(self.processes):
            env = launch.rank_env(extra, rank, self.processes)
            popen, channel = launch.spawn_rank(env, self.pgid)
            if self.pgid is None:
                self.pgid = popen.pid
            self.ranks.append(Rank(rank, popen, channel))
            spec = launch.job_spec(self.job, rank, self.processes, devices[rank], backend, scratch)
            channel.send_json(wire.JOB, spec)
        _LOGGER.info(
            "run %s: GRPO job started in %d process(es) %s on %s",
            self.job.run_id,
            self.processes,
            [r.pid for r in self.ranks],
            ", ".join(devices),
            extra={"run_id": self.job.run_id},
        )

    # -- running -----------------------------------------------------------------------------

    def step(self, step: int) -> episode_pb2.Episode | None:
        """Lets every rank run optimizer step ``step``; returns rank 0's episode of it.

        Returns:
            The episode, or ``None`` once the job's stop event is set.

        Raises:
            ProviderError: A rank failed, or training ended before this step.
        """
        for rank in self.ranks:  # the same message to every rank, in rank order
            rank.channel.send_step(step)
        self._episode = None
        while self._episode is None:
            if self.job.stop_event.is_set():
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
        return self._episode

    def finish(self) -> None:
        """After the done episode: waits (bounded) for every rank to report ``END``."""
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
                rank.exit_status = peek_exit(rank.pid)
                if rank.exit_status is not None and not rank.ended and rank.failed_at is None:
                    rank.failed_at = time.monotonic()
        self._show_silence()

    def _handle(self, rank: Rank, kind: bytes, payload: bytes) -> None:
        if kind == wire.EPISODE and rank.rank == 0:
            self._episode = episode_pb2.Episode.FromString(payload)
        elif kind == wire.PHASE:
            rank.phase = payload.decode(errors="replace")
            if rank.rank == 0:
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
                rank.exit_status = peek_exit(rank.pid, wait_s=0.5)
        error = self.diagnose()
        self._kill()
        raise error

    def diagnose(self) -> ProviderError:
        """What went wrong, as the user should read it (call once a rank failed)."""
        return diagnose(self.ranks)

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
        """SIGKILL to the job's process group (its leader is not reaped yet, so the group id
        cannot have been reused)."""
        if self._killed or self.pgid is None:
            return
        self._killed = True
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
            try:
                rank.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
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


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` in its own processes; yields one episode per optimizer step, each step
    run only when the consumer asks for its episode (see the module docstring).

    Raises:
        ProviderError: A rank failed (named in the message) or training ended early.
    """
    processes = processes_of(job.task)
    group = JobProcesses(job, processes)
    job.set_phase(f"starting {processes} process{'es' if processes > 1 else ''}")
    try:
        group.start()
        for step in range(1, job.config.max_episodes + 1):
            episode = group.step(step)
            if episode is None:
                return  # stopped
            yield episode
            if episode.done:
                break
        group.finish()
    finally:
        group.close()
