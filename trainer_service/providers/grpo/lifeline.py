"""Keeps a GRPO job's processes from outliving the trainer that started them.

A job's ranks share one process group that the trainer creates (rank 0 leads it); every process
they start (their DataLoader workers, multiprocessing's resource tracker) is in
it too. The trainer kills that group when the job ends, fails or is cancelled. When the trainer
itself dies (``kill -9`` included) nobody is left to do that, so each rank does it:

- :func:`arm_rank`: the rank asks the kernel for ``SIGTERM`` when its parent dies
  (``PR_SET_PDEATHSIG``) and answers it by killing its group. Its parent is the trainer's rank
  launcher (:func:`.launch.launcher`), which exits as soon as the trainer is gone (no rank holds
  the trainer's "alive" pipe to it, see :func:`.launch.spawn_rank`). The signal is handled in
  the main thread, which may be busy in C for a while, so a second path does not wait for it: the
  rank's channel reader sees end of file on the trainer's socket and kills the group from its
  own thread (:func:`kill_own_group`). A rank never kills a group that holds its parent.
- :class:`WorkerWatchdog`: a ``worker_init_fn`` wrapper for DataLoader workers. A rank's
  workers fork from the rank (:func:`.settings.worker_start_method`) and take ``SIGKILL`` when
  it dies (``PR_SET_PDEATHSIG``); the watchdog also waits on the rank's pid (a pidfd) and exits
  the worker when the rank is gone, which holds where a worker's parent is a fork server (a
  process with gRPC starts its workers from one: they would otherwise outlive a killed trainer
  for minutes, holding the fork server's "alive" pipe). It also names the worker in ``ps``
  after its rank: ``... (GRPO rank 0, DataLoader worker 1, trainer 1234)``, never the rank's
  own title, which a forked worker would otherwise show.

Outside a job's process group (a test that builds a trainer in its own process) every function
here is a no-op: ``TRAINWIRE_GRPO_GROUP`` names the group a process may kill.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import setproctitle

_LOGGER = logging.getLogger(__name__)

#: The process group of the job this process belongs to (set by the rank, inherited below it).
GROUP_ENV = "TRAINWIRE_GRPO_GROUP"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int) -> bool:
    """Asks Linux to send ``signum`` to this process when the thread that forked it exits.

    Returns:
        Whether it is set (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        return False


def job_group() -> int | None:
    """The job's process group when this process may kill it, else ``None``."""
    value = os.environ.get(GROUP_ENV, "")
    if not value.isdigit():
        return None
    group = int(value)
    return group if group > 1 and os.getpgrp() == group else None


def kill_own_group(why: str) -> NoReturn:
    """Kills this job's whole process group (this process included) with ``SIGKILL``.

    Outside a job's group it exits this process only.
    """
    group = job_group()
    with contextlib.suppress(Exception):  # logging must not keep the group alive
        _LOGGER.warning("%s: killing the job's process group %s", why, group)
    if group is not None:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    os._exit(1)


def arm_rank(parent_pid: int) -> None:
    """Makes this rank take its process group down when the trainer ``parent_pid`` dies.

    Records the group in ``TRAINWIRE_GRPO_GROUP`` for the processes the rank starts. A rank
    whose group is its parent's (started by something other than the trainer's job code) is
    left alone: killing that group would kill the trainer.
    """
    group = os.getpgrp()
    try:
        parents_group = os.getpgid(parent_pid)
    except OSError:
        parents_group = -1
    if group == parents_group or group <= 1:
        _LOGGER.warning("rank shares its parent's process group; no group kill on parent death")
        return
    os.environ[GROUP_ENV] = str(group)

    def on_parent_death(signum: int, frame: Any) -> None:
        del signum, frame
        kill_own_group("the trainer died")

    signal.signal(signal.SIGTERM, on_parent_death)
    set_parent_death_signal(signal.SIGTERM)
    # The parent may have died before the request above was made.
    if os.getppid() != parent_pid:
        kill_own_group("the trainer died before the rank started")


def wait_for_exit(pid: int, stop: threading.Event | None = None) -> None:
    """Blocks until process ``pid`` has exited (or ``stop`` is set)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            while stop is None or not stop.is_set():
                ready, _, _ = select.select([fd], [], [], 1.0)
                if ready:
                    return
        finally:
            os.close(fd)
        return
    while stop is None or not stop.is_set():  # pragma: no cover - kernels without pidfd
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.5)


def release_in_child(fd: int) -> None:
    """In a child forked from a rank (``os.register_at_fork``): lets go of the rank's descriptor
    ``fd`` (its channel to the trainer), keeping the number taken by ``/dev/null`` so nothing
    in the child can reuse it by accident."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd, inheritable=False)
        os.close(null)


def worker_title(rank_title: str, worker_id: int) -> str:
    """A DataLoader worker's process title, from its rank's (``launch.RANK_TITLE``): ``(GRPO
    rank 0, trainer 1234)`` becomes ``(GRPO rank 0, DataLoader worker 1, trainer 1234)``; a
    title that names no trainer (a fork server's command line) is kept."""
    return rank_title.replace(", trainer ", f", DataLoader worker {worker_id}, trainer ", 1)


class WorkerWatchdog:
    """A ``worker_init_fn`` wrapper: the DataLoader worker exits when its rank is gone.

    Picklable (a process with gRPC starts its workers from a fork server). Does nothing outside
    a job's process group.

    Args:
        wrapped: The ``worker_init_fn`` to call afterwards (``None``: none).
        rank_pid: The rank whose DataLoader this is (the process creating the watchdog).
    """

    def __init__(self, wrapped: Callable[[int], Any] | None, rank_pid: int | None = None) -> None:
        self.wrapped = wrapped
        self.rank_pid = os.getpid() if rank_pid is None else rank_pid

    @classmethod
    def wrap(cls, wrapped: Callable[[int], Any] | None) -> Callable[[int], Any] | None:
        """``wrapped`` with a watchdog when this process is a job's rank, else as it is."""
        return cls(wrapped) if job_group() is not None else wrapped

    def __call__(self, worker_id: int) -> None:
        if job_group() is not None:
            # The worker's parent: the rank, or a fork server (a second line of defence then).
            set_parent_death_signal(signal.SIGKILL)
            setproctitle.setproctitle(worker_title(setproctitle.getproctitle(), worker_id))
            # A worker forked from the rank inherits its answer to SIGTERM (kill the job's group).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

            def watch() -> None:
                wait_for_exit(self.rank_pid)
                os._exit(0)

            threading.Thread(target=watch, name="trainwire-rank-watch", daemon=True).start()
        if self.wrapped is not None:
            self.wrapped(worker_id)
