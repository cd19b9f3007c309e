"""One gateway per database file: an exclusive lock beside the database, held while it runs.

The lock is ``flock`` on ``<db>.lock`` (the database itself is never touched to take it), which
the kernel releases when the process dies, ``kill -9`` included; the file holds the owner's pid
so a refused second gateway can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

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
            OSError: the lock file cannot be created (a read-only directory, ...).
        """
        if self.path == ":memory:" or self._fd is not None or is_postgres_url(self.path):
            return  # PostgreSQL: replicas share it (``gateway.core.replicas``)
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
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
