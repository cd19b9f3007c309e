"""The ``grpo`` provider as the trainer runs it: every job in a process group of its own.

A GRPO job used to run in a thread of the trainer. A CUDA out-of-memory, a crash in a kernel or a
leak then hit the whole service, forking DataLoader workers next to gRPC's threads crashed them,
and a job could use one device only. Here a job is ``num_processes`` processes
(``python -m trainer_service.providers.grpo.worker``, one per device, rank 0 first), started by
the job's producer thread in a new process group led by rank 0. :func:`run` looks like any other
provider to the service's ``RunningJob``: a generator of episodes, pulled one credited episode at
a time. Each pull sends ``STEP n`` to every rank (:mod:`.wire`) and returns the episode rank 0
sends back, so a job computes exactly the steps it has credit for; grants, detach/re-attach and
the contract check stay where they were (``trainer_service.core.job``).

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

This module imports neither torch nor grpc: the trainer process no longer loads the training
stack for GRPO.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pathlib
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.grpo import wire
from trainer_service.providers.grpo.library_output import WorkerLogging
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: After STOP, how long the ranks get to finish the step in flight before the group is killed.
STOP_GRACE_S = 5.0
#: After the done episode, how long the ranks get to report END.
DONE_GRACE_S = 60.0
#: After the first failure, how long the trainer keeps listening for its cause.
SETTLE_S = 2.0
#: A rank silent this long (no frame, not even a BEAT) is named in the job's phase.
SILENT_S = 15.0
#: Seconds between a rank's BEAT frames.
BEAT_S = 1.0
_POLL_S = 0.1
_WORKER_MODULE = "trainer_service.providers.grpo.worker"
# Launcher variables a trainer may itself have been started with; a job sets its own.
_DISTRIBUTED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
)


def processes_of(task: episode_pb2.TrainTask) -> int:
    """How many processes (and trainer slots) a GRPO task runs on: ``num_processes``, 1 if 0."""
    return max(1, task.grpo.num_processes)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class _Rank:
    """What the trainer knows of one rank."""

    rank: int
    popen: subprocess.Popen[bytes]
    frames: wire.FrameSocket
    last_heard: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    ended: bool = False  #: sent END
    last_step: int | None = None  #: the last step it finished, as its END said
    closed: bool = False  #: its channel reached end of file
    error: dict[str, Any] | None = None  #: its ERROR report
    exit_status: int | None = None  #: its exit, peeked before any reaping (negative: signal)
    failed_at: float | None = None  #: when the trainer first saw it fail

    @property
    def pid(self) -> int:
        return self.popen.pid


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
        self.ranks: list[_Rank] = []
        self.pgid: int | None = None
        self.scratch: pathlib.Path | None = None
        self._selector = selectors.DefaultSelector()
        self._episode: episode_pb2.Episode | None = None
        self._stopping = False
        self._killed = False
        self._phase = "starting"
        self._silence_shown = False

    # -- starting ----------------------------------------------------------------------------

    def _devices(self) -> tuple[list[str], str, dict[str, str]]:
        """(device of each rank as the rank sees it, backend, environment for every rank)."""
        devices = list(self.job.devices) if len(self.job.devices) == self.processes else []
        devices = devices or [self.job.device] * self.processes
        env: dict[str, str] = {}
        if not devices[0].startswith("cuda"):
            # A CPU job never touches a GPU, and one torch thread per process (measured on a
            # small box: more threads stall it); OMP_NUM_THREADS also silences accelerate.
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            return ["cpu"] * self.processes, "gloo", env
        # Each rank sees the job's GPUs only, as cuda:0..n-1 in rank order.
        indices = [int(d.split(":", 1)[1]) if ":" in d else 0 for d in devices]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = visible.split(",") if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            names[i] if names is not None and i < len(names) else str(i) for i in indices
        )
        return [f"cuda:{rank}" for rank in range(self.processes)], "nccl", env

    def _base_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
        env.update(extra)
        import trainer_service
        import trainwire

        roots = {
            str(pathlib.Path(trainer_service.__file__).resolve().parents[1]),
            str(pathlib.Path(trainwire.__file__).resolve().parents[1]),
        }
        env["PYTHONPATH"] = os.pathsep.join(
            [*sorted(roots), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        )
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def _spec(self, rank: int, device: str, backend: str) -> dict[str, Any]:
        assert self.scratch is not None
        logging_like = WorkerLogging.like_this_process(None)
        formatter = None
        if logging_like.formatter is not None:
            formatter = base64.b64encode(pickle.dumps(logging_like.formatter)).decode()
        output = self.scratch / f"rank{rank}"
        output.mkdir(exist_ok=True)
        job = self.job
        return {
            "run_id": job.run_id,
            "rank": rank,
            "world_size": self.processes,
            "device": device,
            "backend": backend if self.processes > 1 else "",
            "rendezvous": (self.scratch / "rendezvous").as_uri(),
            "task": base64.b64encode(job.task.SerializeToString()).decode(),
            "config": base64.b64encode(job.config.SerializeToString()).decode(),
            "data_root": str(job.data_root),
            "image_cache_dir": str(job.image_cache_dir) if job.image_cache_dir else None,
            "output_dir": str(output),
            "log": {"formatter": formatter, "level": logging_like.level},
            "beat_s": BEAT_S,
        }

    def start(self) -> None:
        """Starts every rank in one new process group and sends each its job spec.

        Raises:
            ProviderError: A process could not be started.
        """
        devices, backend, extra = self._devices()
        self.scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"grpo-{self.job.run_id}-"))
        for rank in range(self.processes):
            env = self._base_env(extra)
            if self.processes > 1:
                world = str(self.processes)
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world)
                env.update(LOCAL_WORLD_SIZE=world)
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                popen = subprocess.Popen(
                    [
                        *(sys.executable, "-m", _WORKER_MODULE),
                        *("--fd", str(child.fileno()), "--parent-pid", str(os.getpid())),
                    ],
                    pass_fds=(child.fileno(),),
                    # Rank 0 leads a new group; the others join it. Everything they start
                    # stays in it, so one killpg ends the whole job.
                    process_group=0 if self.pgid is None else self.pgid,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=2,  # the trainer's stdout carries its announcements only
                )
            except OSError as exc:
                parent.close()
                raise ProviderError(
                    "The trainer could not start a training process.",
                    detail=f"{type(exc).__name__}: {exc}",
                    code="INTERNAL",
                    reason="PROCESS_DIED",
                ) from exc
            finally:
                child.close()
            if self.pgid is None:
                self.pgid = popen.pid
            frames = wire.FrameSocket(parent)
            self.ranks.append(_Rank(rank, popen, frames))
            self._selector.register(frames.sock, selectors.EVENT_READ, self.ranks[-1])
            frames.send_json(wire.JOB, self._spec(rank, devices[rank], backend))
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
        for rank in self.ranks:  # the same frame to every rank, in rank order
            rank.frames.send_step(step)
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
        for key, _ in self._selector.select(timeout):
            rank: _Rank = key.data
            try:
                frames, closed = rank.frames.read_available()
            except ValueError as exc:  # an oversized frame: the rank is broken
                frames, closed = [], True
                _LOGGER.error("run %s: rank %d: %s", self.job.run_id, rank.rank, exc)
            now = time.monotonic()
            rank.last_heard = now
            for kind, payload in frames:
                self._handle(rank, kind, payload)
            if closed:
                rank.closed = True
                self._selector.unregister(rank.frames.sock)
                if not rank.ended and rank.failed_at is None:
                    rank.failed_at = now
        for rank in self.ranks:
            if rank.exit_status is None:
                rank.exit_status = _peek_exit(rank.pid)
                if rank.exit_status is not None and not rank.ended and rank.failed_at is None:
                    rank.failed_at = time.monotonic()
        self._show_silence()

    def _handle(self, rank: _Rank, kind: bytes, payload: bytes) -> None:
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
                rank.exit_status = _peek_exit(rank.pid, wait_s=0.5)
        error = self.diagnose()
        self._kill()
        raise error

    def diagnose(self) -> ProviderError:
        """What went wrong, as the user should read it (call once a rank failed)."""
        n = len(self.ranks)

        def who(rank: _Rank) -> str:
            return "The training process" if n == 1 else f"Training process rank {rank.rank} of {n}"

        killed = [r for r in self.ranks if r.exit_status is not None and r.exit_status < 0]
        if killed:
            rank = min(killed, key=lambda r: r.failed_at or 0.0)
            assert rank.exit_status is not None
            name = _signal_name(-rank.exit_status)
            if -rank.exit_status == signal.SIGKILL:
                text = (
                    f"{who(rank)} was killed ({name}). If the machine ran out of memory, try a "
                    "smaller batch_size or max_completion_length."
                )
            else:
                text = f"{who(rank)} crashed ({name})."
            return ProviderError(
                text, detail=f"pid {rank.pid}", code="INTERNAL", reason="PROCESS_DIED"
            )
        reported = [r for r in self.ranks if r.error is not None]
        if reported:
            rank = min(reported, key=lambda r: float((r.error or {}).get("at", 0.0)))
            error = rank.error or {}
            detail = f"rank {rank.rank}: {error.get('detail', '')}"
            if error.get("kind") == "provider":
                return ProviderError(
                    str(error.get("user_message", "")),
                    detail=detail,
                    code=str(error.get("code", "FAILED_PRECONDITION")),
                    reason=str(error.get("reason", "PROVIDER_FAILED")),
                )
            return ProviderError(
                f"{who(rank)} failed with {error.get('exception') or 'an error'}; the trainer's "
                "log has the details.",
                detail=detail,
                code="INTERNAL",
                reason="PROVIDER_FAILED",
            )
        failed = [r for r in self.ranks if r.failed_at is not None]
        rank = min(failed, key=lambda r: r.failed_at or 0.0) if failed else self.ranks[0]
        if rank.exit_status is not None:
            text = f"{who(rank)} exited unexpectedly (exit code {rank.exit_status})."
        else:
            text = f"{who(rank)} stopped responding."
        return ProviderError(text, detail=f"pid {rank.pid}", code="INTERNAL", reason="PROCESS_DIED")

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
                    rank.frames.send(wire.STOP)
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
            rank.frames.close()
        self._selector.close()
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


def _peek_exit(pid: int, wait_s: float = 0.0) -> int | None:
    """How process ``pid`` (a child) exited, without reaping it: the exit code, or minus the
    signal that killed it; ``None`` while it runs."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if result is not None:
            if result.si_code == os.CLD_EXITED:
                return int(result.si_status)
            return -int(result.si_status)
        if time.monotonic() >= deadline:
            return None
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
