"""The PostgreSQL ``Store``: runs and episode histories shared by gateway replicas.

``--db postgresql://USER@HOST:PORT/DB`` (any libpq URL) selects it. psycopg 3 on the event loop
with a connection pool (``AsyncConnectionPool``); the schema and its migrations are
``gateway.core.store.postgres_schema``, the queries that coordinate replicas (claims, leases,
controls, notifications) ``gateway.core.store.postgres_leases``.

- Episodes are kept as in SQLite: the serialized ``Episode`` (deterministic, so the same
  episode is the same bytes wherever it is written), in ``episodes`` keyed on (run, episode).
- Group commit: ``append_episode`` queues; one writer task commits whatever is queued in one
  transaction (one counter ``UPDATE`` for all the runs in it, one ``INSERT`` of all the
  episodes, one ``NOTIFY`` per run), and only then calls each callback. Nothing is visible to a
  reader, on any replica, before its commit.
- Fencing: every write of a run is conditional on this replica owning it (``runs.owner``, or
  no owner at all). The counter update runs first and locks the runs' rows, so a replica that
  took a run over (which updates the same row) either waits for this commit or makes it write
  nothing: the stale owner's episodes are not inserted and its callbacks get ``NotOwner``.
- Writability as SQLite's backend: a write that fails because the database cannot be written
  or reached (disk full, read-only, server gone) raises ``StoreWriteFailed`` and turns
  ``writable`` off until a probe write succeeds (every ``PROBE_INTERVAL_S``). A read that
  cannot reach the database raises ``StoreUnavailable`` (UNAVAILABLE to clients).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from gateway.core.errors import StoreUnavailable
from gateway.core.runs import RunState, TrainingRun
from gateway.core.store.base import (
    DatabaseProblem,
    DuplicateRequest,
    EpisodeRecord,
    NotOwner,
    StoreWriteFailed,
    Writability,
)
from gateway.core.store.postgres_schema import SCHEMA_VERSION, upgrade
from gateway.core.store.sqlite import _RUN_COLUMNS, _run_from_row, _run_values

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

#: The channel every replica listens on; payloads are ``KIND:RUN_ID``
#: (``gateway.core.store.postgres_leases``).
CHANNEL = "trainwire"
#: Seconds between two write probes while the store cannot be written.
PROBE_INTERVAL_S = 2.0
#: The most episodes one group commit takes.
MAX_BATCH = 4096
#: Retries of a transaction that lost a deadlock or a serialization race.
RETRIES = 3
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


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure)


class PostgresStore:
    """The shared store (see the module docstring).

    Args:
        url: libpq URL of the database.
        replica_id: The replica this store writes for (owner of the runs it drives).
        migrate: Migrate a database of an older schema on start (otherwise it is refused).
        on_commit: Called after each group commit with its size and duration (metrics).
    """

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        migrate: bool = False,
        on_commit: Callable[[int, float], None] | None = None,
    ) -> None:
        self.url = url
        self.where = safe_url(url)
        self.replica_id = replica_id
        self._migrate = migrate
        self._on_commit = on_commit
        self.pool: AsyncConnectionPool | None = None
        self._queue: list[tuple[EpisodeRecord, Callable[[BaseException | None], None]]] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._writability = Writability(self.where, self._probe_write, PROBE_INTERVAL_S)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Checks (or migrates) the schema, opens the pool and starts the writer.

        Raises:
            DatabaseProblem: the database cannot be reached or used (``SchemaOutdated`` when
                it needs a migration).
        """
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
            )
        except psycopg.Error as exc:
            problem = f"it cannot be reached ({_first_line(exc)})"
            raise DatabaseProblem(self.where, problem) from None
        try:
            await upgrade(conn, self.where, self._migrate)
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
        )
        await self.pool.open(wait=True, timeout=10)
        self._writer = asyncio.create_task(self._write_loop(), name="gateway-store-writer")

    async def close(self) -> None:
        """Commits what is queued and closes the pool."""
        self._closing = True
        self._wake.set()
        await self._writability.close()
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    # -- plumbing ----------------------------------------------------------------------------

    async def _run(self, fn: Callable[[psycopg.AsyncConnection], Awaitable[T]], read: bool) -> T:
        """Runs ``fn(conn)`` in a transaction, retrying deadlocks; maps connection failures
        (``StoreUnavailable`` for reads, ``StoreWriteFailed`` for writes)."""
        assert self.pool is not None, "the store is not started"
        for attempt in range(RETRIES + 1):
            try:
                async with self.pool.connection() as conn, conn.transaction():
                    return await fn(conn)
            except Exception as exc:
                if _retryable(exc) and attempt < RETRIES:
                    continue
                failed = write_failure(exc)
                if failed is None:
                    raise
                if read:
                    raise StoreUnavailable(f"the store cannot be read: {failed}") from None
                self._set_writable(False, str(failed))
                raise failed from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def read(self, fn: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        """Runs a read in a transaction (see ``_run``)."""
        return await self._run(fn, read=True)

    async def write(self, fn: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        """Runs a write in a transaction (see ``_run``)."""
        return await self._run(fn, read=False)

    async def _fetch_runs(self, query: str, args: Sequence[Any]) -> list[TrainingRun]:
        async def go(conn: psycopg.AsyncConnection) -> list[TrainingRun]:
            cur = await conn.execute(query, args)  # type: ignore[arg-type]
            return [_run_from_row(row) for row in await cur.fetchall()]

        return await self.read(go)

    # -- writability -------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """False after a write failed, until a probe write succeeds."""
        return self._writability.writable

    def on_writable(self, callback: Callable[[bool], None]) -> None:
        """Registers ``callback(writable)`` for every change."""
        self._writability.on_change(callback)

    def _set_writable(self, writable: bool, why: str = "") -> None:
        self._writability.set(writable, why)

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

    # -- runs --------------------------------------------------------------------------------

    async def insert_run(self, run: TrainingRun) -> int:
        """Inserts a new run (no owner) and announces it; returns its sequence number.

        Raises:
            DuplicateRequest: another run has its ``request_id``.
        """
        values = _run_values(run)
        columns = _RUN_COLUMNS.removeprefix("seq, ")

        async def go(conn: psycopg.AsyncConnection) -> int:
            cur = await conn.execute(
                f"INSERT INTO runs ({columns}) VALUES ({', '.join(['%s'] * len(values))}) "  # type: ignore[arg-type]
                "RETURNING seq",
                values,
            )
            row = await cur.fetchone()
            assert row is not None
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"c:{run.id}"))
            return int(row[0])

        try:
            return await self.write(go)
        except psycopg.errors.UniqueViolation as exc:
            if run.request_id and "request_id" in (exc.diag.constraint_name or ""):
                raise DuplicateRequest(run.request_id) from None
            raise

    async def update_run(self, run: TrainingRun) -> None:
        """Writes a run's state, speed, times, trainer and trainer episode (never its
        counters), fenced by its owner, and announces it.

        Raises:
            NotOwner: another replica owns the run.
        """

        async def go(conn: psycopg.AsyncConnection) -> None:
            cur = await conn.execute(
                "UPDATE runs SET state=%s, error_message=%s, speed=%s, start_time=%s, "
                "end_time=%s, trainer=%s, trainer_episode=%s "
                "WHERE id=%s AND (owner=%s OR owner IS NULL) RETURNING id",
                (
                    int(run.state),
                    run.error_message,
                    run.speed,
                    run.start_time,
                    run.end_time,
                    run.trainer,
                    run.trainer_episode,
                    run.id,
                    self.replica_id,
                ),
            )
            if await cur.fetchone() is not None:
                await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"r:{run.id}"))
                return
            cur = await conn.execute("SELECT 1 FROM runs WHERE id=%s", (run.id,))
            if await cur.fetchone() is not None:
                raise NotOwner(run.id)

        await self.write(go)

    async def delete_run(self, run_id: str) -> None:
        """Deletes a run and its history."""

        async def go(conn: psycopg.AsyncConnection) -> None:
            await conn.execute("DELETE FROM episodes WHERE run_id=%s", (run_id,))
            await conn.execute("DELETE FROM runs WHERE id=%s", (run_id,))
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"d:{run_id}"))

        await self.write(go)

    async def get_run(self, run_id: str) -> TrainingRun | None:
        """The run with this id, or None."""
        runs = await self._fetch_runs(f"SELECT {_RUN_COLUMNS} FROM runs WHERE id=%s", (run_id,))
        return runs[0] if runs else None

    async def find_request(self, request_id: str) -> TrainingRun | None:
        """The run created with this request id, or None."""
        runs = await self._fetch_runs(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE request_id=%s", (request_id,)
        )
        return runs[0] if runs else None

    async def list_runs(
        self, state: RunState | None, before_seq: int | None, limit: int
    ) -> list[TrainingRun]:
        """Runs newest first, optionally in one state, created before ``before_seq``."""
        where: list[str] = []
        args: list[Any] = []
        if state is not None:
            where.append("state=%s")
            args.append(int(state))
        if before_seq is not None:
            where.append("seq<%s")
            args.append(before_seq)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        return await self._fetch_runs(
            f"SELECT {_RUN_COLUMNS} FROM runs {clause} ORDER BY seq DESC LIMIT %s",
            (*args, limit),
        )

    async def count_by_state(self) -> dict[RunState, int]:
        """How many runs are in each state (states without runs are left out)."""

        async def go(conn: psycopg.AsyncConnection) -> dict[RunState, int]:
            cur = await conn.execute("SELECT state, COUNT(*) FROM runs GROUP BY state")
            return {RunState(state): int(n) for state, n in await cur.fetchall()}

        return await self.read(go)

    async def active_runs(self) -> list[TrainingRun]:
        """Every PENDING, RUNNING or PAUSED run, oldest first."""
        return await self._fetch_runs(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE state IN (1, 2, 3) ORDER BY seq", ()
        )

    # -- episodes ----------------------------------------------------------------------------

    async def read_episodes(self, run_id: str, first: int, last: int) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order."""

        async def go(conn: psycopg.AsyncConnection) -> list[bytes]:
            async with conn.cursor(binary=True) as cur:
                await cur.execute(
                    "SELECT data FROM episodes WHERE run_id=%s AND episode BETWEEN %s AND %s "
                    "ORDER BY episode",
                    (run_id, first, last),
                )
                return [bytes(row[0]) for row in await cur.fetchall()]

        return await self.read(go)

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        """Queues an episode; ``callback(error)`` runs on the loop once it is committed."""
        if self._writer is None or self._closing:
            raise RuntimeError("the store is not running")
        self._queue.append((record, callback))
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            batch = self._queue[:MAX_BATCH]
            del self._queue[:MAX_BATCH]
            if self._queue:
                self._wake.set()
            began = time.perf_counter()
            error: BaseException | None = None
            owned: set[str] = set()
            try:
                owned = await self.write(functools.partial(self._commit, batch=batch))
            except Exception as exc:  # delivered to every callback of the batch
                error = exc
                if not isinstance(exc, StoreWriteFailed):
                    _LOGGER.exception("storing %d episodes failed", len(batch))
            if self._on_commit is not None:
                self._on_commit(len(batch), time.perf_counter() - began)
            for record, callback in batch:
                if error is None and record.run_id not in owned:
                    outcome: BaseException | None = NotOwner(record.run_id)
                else:
                    outcome = error
                try:
                    callback(outcome)
                except Exception:
                    _LOGGER.exception("store callback failed")

    async def _commit(
        self,
        conn: psycopg.AsyncConnection,
        *,
        batch: list[tuple[EpisodeRecord, Callable[[BaseException | None], None]]],
    ) -> set[str]:
        """One group commit (see the module docstring); returns the runs it wrote."""
        last: dict[str, EpisodeRecord] = {}
        for record, _ in batch:
            last[record.run_id] = record
        ids = sorted(last)  # one lock order for every writer
        cur = await conn.execute(
            "UPDATE runs AS r SET episode = v.episode, reward = v.reward, "
            "best_reward = v.best FROM unnest(%s::text[], %s::int[], %s::float8[], "
            "%s::float8[]) AS v(id, episode, reward, best) "
            "WHERE r.id = v.id AND (r.owner = %s OR r.owner IS NULL) RETURNING r.id",
            (
                ids,
                [last[i].episode for i in ids],
                [last[i].reward for i in ids],
                [last[i].best_reward for i in ids],
                self.replica_id,
            ),
        )
        owned = {row[0] for row in await cur.fetchall()}
        rows = [record for record, _ in batch if record.run_id in owned]
        if rows:
            await conn.execute(
                "INSERT INTO episodes (run_id, episode, data) "
                "SELECT * FROM unnest(%s::text[], %s::int[], %s::bytea[]) "
                "ON CONFLICT DO NOTHING",
                ([r.run_id for r in rows], [r.episode for r in rows], [r.data for r in rows]),
            )
            await conn.execute(
                "SELECT pg_notify(%s, 'e:' || id) FROM unnest(%s::text[]) AS id",
                (CHANNEL, sorted(owned)),
            )
        return owned


__all__ = ["CHANNEL", "SCHEMA_VERSION", "PostgresStore", "is_postgres_url", "safe_url"]
