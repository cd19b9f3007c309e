"""The gateway's store: runs, their episode histories and checkpoint records, durably.

``Store`` (``gateway.core.store.base``) is what the core uses; ``open_store`` picks the backend
from ``--db``: a file path or ``:memory:`` is SQLite (``sqlite_backend``, the embedded default,
one gateway), a ``postgresql://`` URL is PostgreSQL (``postgres``, shared by gateway replicas).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from gateway.core.store.base import (
    STORE_MESSAGE,
    CheckpointRecord,
    DatabaseProblem,
    DuplicateRequest,
    EpisodeRecord,
    NotOwner,
    SchemaOutdated,
    Store,
    StoreWriteFailed,
)
from gateway.core.store.postgres import PostgresStore, is_postgres_url
from gateway.core.store.sqlite import SqliteStore
from gateway.core.store.sqlite_backend import SqliteBackend
from gateway.core.store.sqlite_thread import WAL_LIMIT_BYTES, StoreThread

__all__ = [
    "STORE_MESSAGE",
    "WAL_LIMIT_BYTES",
    "CheckpointRecord",
    "DatabaseProblem",
    "DuplicateRequest",
    "EpisodeRecord",
    "NotOwner",
    "PostgresStore",
    "SchemaOutdated",
    "SqliteBackend",
    "SqliteStore",
    "Store",
    "StoreThread",
    "StoreWriteFailed",
    "is_postgres_url",
    "open_store",
]


def open_store(
    db: str,
    *,
    migrate: bool = False,
    on_commit: Callable[[int, float], None] | None = None,
    replica_id: str = "",
) -> Store:
    """The store of ``--db`` (not started). ``replica_id`` names the gateway replica that
    writes through it (PostgreSQL: the owner of the runs it drives).

    Raises:
        DatabaseProblem: it cannot be used (``SchemaOutdated`` when it needs a migration; a
            PostgreSQL database is checked when the store starts).
    """
    if is_postgres_url(db):
        return PostgresStore(
            db, replica_id or uuid.uuid4().hex, migrate=migrate, on_commit=on_commit
        )
    return SqliteBackend(db, migrate=migrate, on_commit=on_commit)
