"""The gateway's store: runs and their episode histories, durably.

``Store`` (``gateway.core.store.base``) is what the core uses; ``open_store`` picks the backend
from ``--db``: a file path or ``:memory:`` is SQLite (``sqlite_backend``, the embedded default).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.store.base import (
    STORE_MESSAGE,
    DatabaseProblem,
    EpisodeRecord,
    SchemaOutdated,
    Store,
    StoreWriteFailed,
)
from gateway.core.store.sqlite import SqliteStore
from gateway.core.store.sqlite_backend import SqliteBackend
from gateway.core.store.sqlite_thread import WAL_LIMIT_BYTES, StoreThread

__all__ = [
    "STORE_MESSAGE",
    "WAL_LIMIT_BYTES",
    "DatabaseProblem",
    "EpisodeRecord",
    "SchemaOutdated",
    "SqliteBackend",
    "SqliteStore",
    "Store",
    "StoreThread",
    "StoreWriteFailed",
    "open_store",
]


def open_store(
    db: str,
    *,
    migrate: bool = False,
    on_commit: Callable[[int, float], None] | None = None,
) -> Store:
    """The store of ``--db`` (not started).

    Raises:
        DatabaseProblem: it cannot be used (``SchemaOutdated`` when it needs a migration).
    """
    return SqliteBackend(db, migrate=migrate, on_commit=on_commit)
