"""A trainer process's own scratch directory, and the sweep of those whose trainer is gone.

What a trainer writes to local scratch lives in one directory of its own,
``<base>/trainer-<pid>-<random>`` (``base``: ``$TMPDIR/trainwire-scratch`` by default): its
jobs' checkpoints before they go into the store and the ones they resume from, merged models,
and each GRPO job's folder (the ranks' output directories). ``TMPDIR`` itself is left alone:
multiprocessing puts its sockets in ``pymp-*`` folders there, and a Unix socket's path may not
exceed 107 bytes, which a deeper ``TMPDIR`` would soon pass; those folders hold no data.

Invariants:

- The trainer holds an exclusive ``flock`` on the directory's ``lock`` file for its whole life.
  The kernel releases it when the process ends, however it ends (``kill -9`` included), and no
  child holds it (the descriptor is closed on ``exec``; the trainer never forks without one).
- :func:`sweep` removes a directory only when its lock is free *and* the pid in its name is not
  a running process: a trainer that has created its directory but not yet locked it is alive,
  so it is never swept. Directories of another layout under ``base`` are never touched.
- ``base`` is shared by the trainers of every user (made mode 1777, as ``/tmp``); each
  trainer's directory is its own (0700). A directory the sweep cannot remove is left, logged.
- A trainer removes its own directory when it exits with no job left (:meth:`TrainerScratch.close`);
  otherwise (a job still stopping, or a crash) the next trainer on the machine sweeps it.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import re
import secrets
import shutil

from trainer_service.core.runner_settings import default_scratch_base

_LOGGER = logging.getLogger(__name__)

LOCK_FILE = "lock"
_OWNED = re.compile(r"^trainer-(\d+)-[0-9a-f]{8}$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep(base: pathlib.Path) -> list[pathlib.Path]:
    """Removes the scratch directories under ``base`` whose trainer is gone; returns them."""
    removed: list[pathlib.Path] = []
    try:
        entries = sorted(base.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        owned = _OWNED.match(entry.name)
        if owned is None or not entry.is_dir() or _running(int(owned.group(1))):
            continue
        try:
            fd = os.open(entry / LOCK_FILE, os.O_RDWR)
        except FileNotFoundError:
            fd = None  # the trainer died before it locked: nothing can hold it
        except OSError as exc:
            _LOGGER.warning("scratch %s of a gone trainer left alone: %s", entry, exc)
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # held: a process of another pid namespace owns it
            shutil.rmtree(entry, ignore_errors=True)
            if entry.exists():  # another user's: not ours to remove
                _LOGGER.warning("scratch %s of a gone trainer could not be removed", entry)
            else:
                removed.append(entry)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class TrainerScratch:
    """This process's scratch directory, locked for its life (see the module docstring).

    Args:
        base: Where the trainers of this machine keep their directories (created if missing).
    """

    def __init__(self, base: pathlib.Path | None = None) -> None:
        self.base = base or default_scratch_base()
        if not self.base.is_dir():  # shared by the trainers of every user, as /tmp is
            self.base.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                self.base.chmod(0o1777)
        #: What :meth:`__init__` swept: the directories of trainers that were gone.
        self.swept = sweep(self.base)
        while True:
            path = self.base / f"trainer-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                path.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
        self.path = path
        self._fd: int | None = os.open(
            self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self, remove: bool = True) -> None:
        """Removes the directory (``remove``) and releases its lock; idempotent."""
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
