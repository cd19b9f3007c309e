"""The PostgreSQL database under the store: its URL, the connection pool, transactions and
writability.

psycopg 3 on the event loop with a connection pool (``AsyncConnectionPool``), opened once the
schema is checked (or migrated: ``gateway.core.store.postgres_schema``). Each read or write runs
in one transaction, retried when it lost a deadlock or a serialization race.

A server restart (or failover) is ridden out: the pool checks a connection before it lends it
(a restart leaves every pooled connection dead), and a transaction that failed on its
connection before its commit was sent (so it did nothing) is tried again, on a fresh
connection, for up to ``RIDE_OUT_S``. One that failed during its commit is tried again only when
it is idempotent (``write(fn, idempotent=True)``: the episodes' group commit, whose inserts skip
rows already there and whose update sets values): it may have been committed.

Writability as SQLite's backend: a write that fails because the database cannot be written or
reached (disk full, read-only, server gone) raises ``StoreWriteFailed`` and turns ``writable``
off until a probe write succeeds (every ``PROBE_INTERVAL_S``). A read that cannot reach the
database raises ``StoreUnavailable`` (UNAVAILABLE to clients).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from gateway.core.errors import StoreUnavailable
from gateway.core.store.base import (
    DatabaseProblem,
    StoreWriteFailed,
    Writability,
    WritableStore,
)
from gateway.core.store.postgres_schema import upgrade

T = TypeVar("T")

#: The channel every replica listens on; payloads are ``KIND:RUN_ID``
#: (``gateway.core.store.postgres_leases``).
CHANNEL = "trainwire"
#: Seconds between two write probes while the store cannot be written.
PROBE_INTERVAL_S = 2.0
#: Retries of a transaction that lost a deadlock or a serialization race.
RETRIES = 3
#: Seconds a transaction that lost its connection before its commit is tried again (a server
#: restart), and the pause between two tries.
RIDE_OUT_S = 15.0
RIDE_OUT_PAUSE_S = 0.25
POOL_SIZE = 8
CONNECT_TIMEOUT_S = 5


def is_postgres_url(db: str) -> bool:
    """Whether ``--db`` names a PostgreSQL database."""
    return db.startswith(("postgresql://", "postgres://"))


def safe_url(url: str) -> str:
    """The URL without its password (for logs and messages)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"


def write_failure(exc: BaseException) -> StoreWriteFailed | None:
    """The ``StoreWriteFailed`` of an error that means the database cannot be written or
    reached, else None (a bug, a constraint)."""
    if isinstance(exc, psycopg.errors.DiskFull):
        return StoreWriteFailed("the disk is full")
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return StoreWriteFailed("it is read-only")
    if isinstance(exc, PoolTimeout):
        return StoreWriteFailed("no connection to the database")
    if isinstance(exc, psycopg.OperationalError):
        return StoreWriteFailed(f"the database cannot be reached ({_first_line(exc)})")
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _connection_lost(exc: BaseException) -> bool:
    """Whether a transaction failed because its connection or the server went away (not
    because of what it did): the server shut down or restarted, or no connection could be
    had."""
    if isinstance(
        exc,
        PoolTimeout
        | psycopg.errors.AdminShutdown
        | psycopg.errors.CrashShutdown
        | psycopg.errors.CannotConnectNow,
    ):
        return True
    return type(exc) is psycopg.OperationalError  # libpq: the connection broke or was refused


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure)


class PostgresDatabase(WritableStore):
    """The database under a ``PostgresStore``, its base class (see the module docstring).

    Args:
        url: libpq URL of the database.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = safe_url(url)
        self.pool: AsyncConnectionPool | None = None
        self._writability = Writability(self.where, self._probe_write, PROBE_INTERVAL_S)

    async def _open(self, migrate: bool) -> None:
        """Checks (or migrates) the schema and opens the pool.

        Raises:
            DatabaseProblem: the database cannot be reached or used (``SchemaOutdated`` when
                it needs a migration and ``migrate`` is not set).
        """
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
            )
        except psycopg.Error as exc:
            problem = f"it cannot be reached ({_first_line(exc)})"
            raise DatabaseProblem(self.where, problem) from None
        try:
            await upgrade(conn, self.where, migrate)
        except psycopg.Error as exc:
            raise DatabaseProblem(self.where, _first_line(exc)) from None
        finally:
            await conn.close()
        self.pool = AsyncConnectionPool(
            self.url,
            min_size=2,
            max_size=POOL_SIZE,
            open=False,
            timeout=10,
            kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
            name="trainwire",
            check=AsyncConnectionPool.check_connection,
        )
        await self.pool.open(wait=True, timeout=10)

    async def _close_pool(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    # -- transactions ------------------------------------------------------------------------

    async def _run(
        self,
        fn: Callable[[psycopg.AsyncConnection], Awaitable[T]],
        read: bool,
        idempotent: bool = False,
    ) -> T:
        """Runs ``fn(conn)`` in a transaction, retrying deadlocks and, for a while, a lost
        connection (during the commit too where ``fn`` is ``idempotent``); maps connection
        failures (``StoreUnavailable`` for reads, ``StoreWriteFailed`` for writes)."""
        assert self.pool is not None, "the store is not started"
        attempt = 0
        ride_out_until: float | None = None
        while True:
            committing = False
            try:
                async with self.pool.connection() as conn, conn.transaction():
                    result = await fn(conn)
                    committing = True  # leaving the block commits
                return result
            except Exception as exc:
                if _retryable(exc) and attempt < RETRIES:
                    attempt += 1
                    continue
                if _connection_lost(exc) and (idempotent or not committing):
                    # Nothing was committed, or the same again changes nothing: try again on
                    # a fresh connection for a while.
                    now = time.monotonic()
                    if ride_out_until is None:
                        ride_out_until = now + RIDE_OUT_S
                    if now < ride_out_until:
                        await asyncio.sleep(RIDE_OUT_PAUSE_S)
                        continue
                failed = write_failure(exc)
                if failed is None:
                    raise
                if read:
                    raise StoreUnavailable(f"the store cannot be read: {failed}") from None
                self._writability.set(False, str(failed))
                raise failed from None

    async def read(self, fn: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        """Runs a read in a transaction (see ``_run``)."""
        return await self._run(fn, read=True)

    async def write(
        self, fn: Callable[[psycopg.AsyncConnection], Awaitable[T]], idempotent: bool = False
    ) -> T:
        """Runs a write in a transaction (see ``_run``); ``idempotent``: running it twice
        leaves what running it once does."""
        return await self._run(fn, read=False, idempotent=idempotent)

    # -- writability -------------------------------------------------------------------------

    async def _probe_write(self) -> bool:
        try:
            assert self.pool is not None
            async with self.pool.connection(timeout=PROBE_INTERVAL_S) as conn:
                await conn.execute(
                    "UPDATE trainwire_meta SET value = value WHERE key = 'schema_version'"
                )
        except Exception:
            return False
        return True
