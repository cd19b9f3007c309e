"""The PostgreSQL ``Store``: runs and episode histories shared by gateway replicas.

``--db postgresql://USER@HOST:PORT/DB`` (any libpq URL) selects it. This module holds the
store's lifecycle and its queries of runs, episodes and checkpoint records; the rest is split
by responsibility:

- ``gateway.core.store.postgres_db``: the connection pool (psycopg 3 on the event loop),
  transactions with retries, and writability (a write that cannot reach the database raises
  ``StoreWriteFailed`` and turns ``writable`` off until a probe write succeeds; such a read
  raises ``StoreUnavailable``).
- ``gateway.core.store.postgres_episodes``: group commit of the appended episodes.
- ``gateway.core.store.postgres_schema``: the schema and its migrations.
- ``gateway.core.store.postgres_leases``: the queries that coordinate replicas (claims,
  leases, controls, notifications).

Fencing: every write of a run is conditional on this replica owning it (``runs.owner``, or no
owner at all); a stale owner's ``update_run``, ``add_checkpoint`` and ``delete_checkpoints``
raise ``NotOwner``, and its episodes are not inserted (their callbacks get ``NotOwner``). The
checkpoint writes lock the run's row first, so they run one at a time per run and a takeover
either waits for them or makes them write nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
import psycopg.errors

from gateway.core.curve import CurveBlock
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from gateway.core.store.base import (
    CheckpointRecord,
    DuplicateRequest,
    EpisodeRecord,
    NotOwner,
    check_keep,
    stored_episodes,
    stored_json,
)
from gateway.core.store.postgres_db import CHANNEL, PostgresDatabase, is_postgres_url, safe_url
from gateway.core.store.postgres_episodes import GroupCommit
from gateway.core.store.postgres_schema import SCHEMA_VERSION
from gateway.core.store.search_sql import POSTGRES, page_of, select_runs
from gateway.core.store.sqlite import (
    _RUN_COLUMNS,
    _RUN_WIDTH,
    _run_from_row,
    _run_values,
    labels_json,
)
from gateway.core.store.sqlite_schema import search_values, trainers_json

_LOGGER = logging.getLogger(__name__)

#: Vacuum ``recent_details`` once this many of its rows were deleted since the last vacuum
#: (``PostgresStore.settle_details``).
RECENT_VACUUM_ROWS = 2000


class PostgresStore(PostgresDatabase):
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
        super().__init__(url)
        self.replica_id = replica_id
        self._migrate = migrate
        self._episodes = GroupCommit(self, replica_id, on_commit)
        self._recent_deleted = 0
        self._vacuum: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Checks (or migrates) the schema, opens the pool and starts the writer.

        Raises:
            DatabaseProblem: the database cannot be reached or used (``SchemaOutdated`` when
                it needs a migration).
        """
        await self._open(self._migrate)
        self._episodes.start()

    async def close(self) -> None:
        """Commits what is queued and closes the pool."""
        self._episodes.stop()
        await self._writability.close()
        await self._episodes.join()
        if self._vacuum is not None:
            await self._vacuum
        await self._close_pool()

    # -- runs --------------------------------------------------------------------------------

    async def _fetch_runs(self, query: str, args: Sequence[Any]) -> list[TrainingRun]:
        async def go(conn: psycopg.AsyncConnection) -> list[TrainingRun]:
            cur = await conn.execute(query, args)  # type: ignore[arg-type]
            return [_run_from_row(row) for row in await cur.fetchall()]

        return await self.read(go)

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
        """Writes a run's state, speed, times, trainer and trainers, trainer episode, restarts,
        parked and task (with the ``learning_rate`` search column; never its counters nor
        ``checkpoint_episode``), fenced by its owner, and announces it.

        Raises:
            NotOwner: another replica owns the run.
        """

        async def go(conn: psycopg.AsyncConnection) -> None:
            cur = await conn.execute(
                "UPDATE runs SET state=%s, error_message=%s, speed=%s, start_time=%s, "
                "end_time=%s, trainer=%s, trainers=%s, trainer_episode=%s, restarts=%s, "
                "parked=%s, task=%s, learning_rate=%s "
                "WHERE id=%s AND (owner=%s OR owner IS NULL) RETURNING id",
                (
                    int(run.state),
                    run.error_message,
                    run.speed,
                    run.start_time,
                    run.end_time,
                    run.trainer,
                    trainers_json(run.trainers),
                    run.trainer_episode,
                    run.restarts,
                    run.parked,
                    run.task.SerializeToString(),
                    search_values(run.task, run.config)[3],
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

    async def update_metadata(
        self, run_id: str, display_name: str, labels: Mapping[str, str]
    ) -> bool:
        """Sets a run's display name and labels (any replica) and announces it (``m``: the
        owner copies them into the run it drives); False when there is no such run.

        Raises:
            StoreWriteFailed: the database cannot be written.
        """

        async def go(conn: psycopg.AsyncConnection) -> bool:
            cur = await conn.execute(
                "UPDATE runs SET display_name=%s, labels=%s WHERE id=%s RETURNING id",
                (display_name, labels_json(labels), run_id),
            )
            if await cur.fetchone() is None:
                return False
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"m:{run_id}"))
            return True

        return await self.write(go)

    async def delete_run(self, run_id: str) -> None:
        """Deletes a run, its history and its checkpoint records."""

        async def go(conn: psycopg.AsyncConnection) -> None:
            await conn.execute("DELETE FROM episodes WHERE run_id=%s", (run_id,))
            await conn.execute("DELETE FROM details WHERE run_id=%s", (run_id,))
            await conn.execute("DELETE FROM recent_details WHERE run_id=%s", (run_id,))
            await conn.execute("DELETE FROM curve WHERE run_id=%s", (run_id,))
            await conn.execute("DELETE FROM checkpoints WHERE run_id=%s", (run_id,))
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

    async def list_runs(self, query: RunQuery) -> RunPage:
        """A page of the runs a search finds, in its order (see ``Store.list_runs``)."""
        sql, params = select_runs(query, _RUN_COLUMNS, POSTGRES)

        async def go(conn: psycopg.AsyncConnection) -> list[Any]:
            # Never prepared: a prepared search soon gets a generic plan, which cannot see
            # where its keyset starts or how selective its values are.
            cur = await conn.execute(sql, params, prepare=False)  # type: ignore[arg-type]
            return await cur.fetchall()

        return page_of(await self.read(go), query, _RUN_WIDTH, _run_from_row)

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

    # -- checkpoint records ------------------------------------------------------------------

    async def _lock_owned(self, conn: psycopg.AsyncConnection, run_id: str) -> bool:
        """Locks the run's row if this replica owns it (or nobody does); False when there is
        no such run.

        Raises:
            NotOwner: another replica owns it.
        """
        cur = await conn.execute(
            "SELECT 1 FROM runs WHERE id=%s AND (owner=%s OR owner IS NULL) FOR UPDATE",
            (run_id, self.replica_id),
        )
        if await cur.fetchone() is not None:
            return True
        cur = await conn.execute("SELECT 1 FROM runs WHERE id=%s", (run_id,))
        if await cur.fetchone() is not None:
            raise NotOwner(run_id)
        return False

    @staticmethod
    async def _set_checkpoint_episode(conn: psycopg.AsyncConnection, run_id: str) -> None:
        await conn.execute(
            "UPDATE runs SET checkpoint_episode = "
            "(SELECT coalesce(max(episode), 0) FROM checkpoints WHERE run_id=%s) WHERE id=%s",
            (run_id, run_id),
        )
        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"r:{run_id}"))

    async def add_checkpoint(self, record: CheckpointRecord, keep: int) -> list[int]:
        """Records a checkpoint and applies retention in one transaction, fenced by the
        run's owner; returns the episodes whose records were not kept (see
        ``Store.add_checkpoint``).

        Raises:
            ValueError: ``keep`` is below 1.
            NotOwner: another replica owns the run; nothing is written.
            StoreWriteFailed: the database cannot be written.
        """
        check_keep(keep)
        run_id = record.run_id

        async def go(conn: psycopg.AsyncConnection) -> list[int]:
            if not await self._lock_owned(conn, run_id):
                return [record.episode]
            cur = await conn.execute(
                "INSERT INTO checkpoints (run_id, episode, create_time, size_bytes, sha256) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (run_id, episode) DO UPDATE SET "
                "create_time = excluded.create_time, size_bytes = excluded.size_bytes, "
                "sha256 = excluded.sha256 WHERE checkpoints.sha256 <> excluded.sha256 "
                "RETURNING episode",
                (run_id, record.episode, record.create_time, record.size_bytes, record.sha256),
            )
            if await cur.fetchone() is None:
                return []  # recorded already, with the same digest
            cur = await conn.execute(
                "DELETE FROM checkpoints WHERE run_id=%s AND episode NOT IN "
                "(SELECT episode FROM checkpoints WHERE run_id=%s "
                "ORDER BY episode DESC LIMIT %s) "
                "AND episode <> coalesce((SELECT max(c.episode) "
                "FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                "WHERE c.run_id=%s AND c.episode <= r.episode AND c.episode <> %s), -1) "
                "RETURNING episode",
                (run_id, run_id, keep, run_id, record.episode),
            )
            deleted = sorted(int(row[0]) for row in await cur.fetchall())
            await self._set_checkpoint_episode(conn, run_id)
            return deleted

        return await self.write(go)

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """The run's checkpoint records, oldest first."""

        async def go(conn: psycopg.AsyncConnection) -> list[CheckpointRecord]:
            cur = await conn.execute(
                "SELECT run_id, episode, create_time, size_bytes, sha256 FROM checkpoints "
                "WHERE run_id=%s ORDER BY episode",
                (run_id,),
            )
            return [
                CheckpointRecord(row[0], int(row[1]), int(row[2]), int(row[3]), row[4])
                for row in await cur.fetchall()
            ]

        return await self.read(go)

    async def delete_checkpoints(self, run_id: str, episodes: Sequence[int]) -> None:
        """Deletes checkpoint records and moves the run's ``checkpoint_episode``, fenced by
        the run's owner.

        Raises:
            NotOwner: another replica owns the run; nothing is written.
            StoreWriteFailed: the database cannot be written.
        """
        wanted = sorted(set(episodes))

        async def go(conn: psycopg.AsyncConnection) -> None:
            exists = await self._lock_owned(conn, run_id)
            await conn.execute(
                "DELETE FROM checkpoints WHERE run_id=%s AND episode = ANY(%s::bigint[])",
                (run_id, wanted),
            )
            if exists:
                await self._set_checkpoint_episode(conn, run_id)

        await self.write(go)

    # -- episodes ----------------------------------------------------------------------------

    async def read_episodes(
        self, run_id: str, first: int, last: int, scalars: bool = False, json: bool = False
    ) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order, with their kept
        detail or without (``scalars``); or their JSON (``json``). One statement: the details
        joined, each bounded to the range (PostgreSQL does not carry the range over from
        ``episodes``, and would read every detail of the run for each read)."""
        # With ``json``, the JSON and the bytes only where it is missing (``stored_json``).
        numbers = (
            "e.episode, e.json, CASE WHEN e.json IS NULL THEN e.data END"
            if json
            else "e.episode, e.data"
        )
        detail = (
            "CASE WHEN d.detail IS NULL THEN r.json ELSE d.json END, "
            "CASE WHEN (CASE WHEN d.detail IS NULL THEN r.json ELSE d.json END) IS NULL "
            "THEN coalesce(d.detail, r.detail) END"
            if json
            else "coalesce(d.detail, r.detail)"
        )
        query = (
            f"SELECT {numbers} FROM episodes e "
            "WHERE e.run_id = %(run)s AND e.episode BETWEEN %(first)s AND %(last)s "
            "ORDER BY e.episode"
            if scalars
            else f"SELECT {numbers}, {detail} FROM episodes e "
            "LEFT JOIN details d ON d.run_id = e.run_id AND d.episode = e.episode "
            "AND d.run_id = %(run)s AND d.episode BETWEEN %(first)s AND %(last)s "
            "LEFT JOIN recent_details r ON r.run_id = e.run_id AND r.episode = e.episode "
            "AND r.run_id = %(run)s AND r.episode BETWEEN %(first)s AND %(last)s "
            "WHERE e.run_id = %(run)s AND e.episode BETWEEN %(first)s AND %(last)s "
            "ORDER BY e.episode"
        )

        async def go(conn: psycopg.AsyncConnection) -> list[bytes]:
            async with conn.cursor(binary=True) as cur:
                await cur.execute(query, {"run": run_id, "first": first, "last": last})
                rows = await cur.fetchall()
            if scalars:
                return stored_json(rows, None) if json else stored_episodes(rows, {})
            if not json:
                return stored_episodes(rows, {r[0]: r[2] for r in rows if r[2] is not None})
            kept = {r[0]: (r[3], r[4]) for r in rows if r[3] is not None or r[4] is not None}
            return stored_json([r[:3] for r in rows], kept)

        return await self.read(go)

    async def read_curve_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        """The stored curve blocks of ``(level, first_index, last_index)`` spans."""

        async def go(conn: psycopg.AsyncConnection) -> list[CurveBlock]:
            out: list[CurveBlock] = []
            for level, lo, hi in spans:
                cur = await conn.execute(
                    "SELECT level, block, count, reward_min, reward_max, reward_sum, best_end, "
                    "metrics FROM curve WHERE run_id=%s AND level=%s AND block BETWEEN %s AND "
                    "%s ORDER BY block",
                    (run_id, level, lo, hi),
                )
                out.extend(CurveBlock(*row) for row in await cur.fetchall())
            return out

        return await self.read(go)

    async def settle_details(self, run_id: str, first: int, last: int, keep: Sequence[int]) -> int:
        """Keeps or drops the recent details of a range (see ``Store.settle_details``), fenced
        by the run's owner.

        Every ``RECENT_VACUUM_ROWS`` rows deleted from ``recent_details`` (by any of this
        store's runs), the table is vacuumed in the background, so the space of the dropped
        details is reused by the next ones while a run goes on. Autovacuum (the table's own
        thresholds are set by the schema) visits a database only once a minute by default:
        an unpaced run drops ~270 MB of motions per million episodes, and between two visits
        the table would grow by what a minute drops.

        Raises:
            NotOwner: another replica owns the run; nothing is written.
            StoreWriteFailed: the database cannot be written.
        """

        async def go(conn: psycopg.AsyncConnection) -> tuple[int, int]:
            if not await self._lock_owned(conn, run_id):
                return 0, 0
            moved = await conn.execute(
                "INSERT INTO details (run_id, episode, detail, json) SELECT run_id, episode, "
                "detail, json FROM recent_details WHERE run_id=%s AND episode BETWEEN %s AND %s "
                "AND episode = ANY(%s::int[]) ON CONFLICT DO NOTHING",
                (run_id, first, last, list(keep)),
            )
            cur = await conn.execute(
                "DELETE FROM recent_details WHERE run_id=%s AND episode BETWEEN %s AND %s",
                (run_id, first, last),
            )
            return cur.rowcount, cur.rowcount - moved.rowcount

        deleted, dropped = await self.write(go)
        self._recent_deleted += deleted
        if self._recent_deleted >= RECENT_VACUUM_ROWS and (
            self._vacuum is None or self._vacuum.done()
        ):
            self._recent_deleted = 0
            self._vacuum = asyncio.get_running_loop().create_task(
                self._vacuum_recent(), name="gateway-vacuum-recent-details"
            )
        return dropped

    async def _vacuum_recent(self) -> None:
        """``VACUUM`` of ``recent_details`` (and its TOAST, where the details are), skipped
        while another vacuum of it (autovacuum) holds its lock. Best effort: a failure (the
        database is gone, the role may not vacuum the table) is logged, and the next
        ``RECENT_VACUUM_ROWS`` try again."""
        assert self.pool is not None
        try:
            async with self.pool.connection() as conn:
                await conn.execute("VACUUM (SKIP_LOCKED) recent_details")
        except Exception as exc:  # autovacuum still reclaims it later
            _LOGGER.warning("could not vacuum the recent details' table (%s)", exc)

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        """Queues an episode; ``callback(error)`` runs on the loop once it is committed
        (``gateway.core.store.postgres_episodes``)."""
        self._episodes.append(record, callback)


__all__ = ["CHANNEL", "SCHEMA_VERSION", "PostgresStore", "is_postgres_url", "safe_url"]
