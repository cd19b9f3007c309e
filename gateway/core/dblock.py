"""One gateway per database file: an exclusive lock beside the database, held while it runs.

The lock is ``flock`` on ``<db>.lock`` (the database itself is never touched to take it), which
the kernel releases when the process dies, ``kill -9`` included; the file holds the owner's pid
so a refused second gateway can name it. A lock file that cannot be created (a directory the
gateway cannot write, a path through a regular file) is ``DatabasePathProblem``: one line that
names the path and what is wrong with it, never a bare ``[Errno 13]``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from gateway.core.store.base import DatabaseProblem
from gateway.core.store.postgres import is_postgres_url


class DatabaseLocked(Exception):
    """Another process holds the database.

    Attributes:
        path: The database file.
        pid: The holder's process id (0 when unknown).
    """

    def __init__(self, path: str, pid: int) -> None:
        holder = f"process {pid}" if pid else "another process"
        super().__init__(
            f"database {path} is in use by {holder} (another gateway); "
            "stop it or give this one another --db"
        )
        self.path = path
        self.pid = pid


class DatabasePathProblem(DatabaseProblem):
    """The database's directory or its lock file cannot be created or opened; ``problem``
    names the file or directory at fault."""


def describe_path_error(path: str, exc: OSError) -> str:
    """What ``exc``, raised while creating the directory or lock file of database ``path``,
    means for people: the file or directory at fault and why, without an errno number."""
    lock = f"{path}.lock"
    directory = os.path.dirname(os.path.abspath(path))
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _first_non_directory(directory)
        if blocker == directory:
            return f"{directory} is not a directory"
        if blocker is not None:
            return f"{blocker} is not a directory, so {directory} cannot be created"
    if exc.errno in (errno.EACCES, errno.EPERM):
        if exc.filename is not None and os.fspath(exc.filename) != lock:
            return f"the directory {os.fspath(exc.filename)} cannot be created (permission denied)"
        if os.path.lexists(lock):
            return f"its lock file {lock} cannot be opened for writing (permission denied)"
        return (
            f"the directory {directory} is not writable for this user (permission denied "
            f"creating the lock file {os.path.basename(lock)})"
        )
    if exc.errno == errno.EROFS:
        return f"the directory {directory} is on a read-only file system"
    what = exc.strerror or str(exc)
    return f"its lock file {lock} cannot be created ({what[:1].lower()}{what[1:]})"


def _first_non_directory(directory: str) -> str | None:
    """The nearest existing ancestor of ``directory`` (itself included) when it is not a
    directory; ``None`` when it is one."""
    current = directory
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current


class DatabaseLock:
    """The lock of one database file (a no-op for ``:memory:`` and PostgreSQL).

    Args:
        path: The database file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
            DatabaseLocked: another process holds it.
            DatabasePathProblem: its directory or the lock file cannot be created (a directory
                this user cannot write, a path through a regular file, ...).
        """
        if self.path == ":memory:" or self._fd is not None or is_postgres_url(self.path):
            return  # PostgreSQL: replicas share it (``gateway.core.replicas``)
        parent = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(parent, exist_ok=True)
            fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DatabasePathProblem(self.path, describe_path_error(self.path, exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise DatabaseLocked(self.path, pid) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Gives the lock back (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0
