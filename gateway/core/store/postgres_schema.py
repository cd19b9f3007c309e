"""The PostgreSQL schema: its versions, how a database is recognised, and the migrations.

A Trainwire database has a ``trainwire_meta`` table whose row ``application`` is
``trainwire`` and whose row ``schema_version`` is the version of its tables (in the
connection's current schema, ``public`` unless the URL's ``options`` say otherwise). A database
with tables but no such row is another program's and is refused, never touched; so is one of a
newer version.

Versions (``MIGRATIONS[v - 1]`` takes a database from ``v - 1`` to ``v``):

1. The store: ``runs`` (as SQLite's version 2) and ``episodes`` (pre-encoded episodes keyed on
   (run, episode), stored uncompressed: they do not compress, and a replay reads them back
   without inflating anything).
2. Gateway replicas: a run's ``owner`` (the replica that drives it) and ``lease_until`` (the
   database's clock), and the controls sent to a replica that does not drive the run: the
   desired state and speed, ``control_seq`` (bumped by each request) and ``applied_seq`` /
   ``control_error`` (written by the owner once it applied them); a partial index of the active
   runs, which every replica scans.
3. Checkpoints: a run's ``checkpoint_episode`` (the largest recorded checkpoint), ``restarts``
   and ``parked``; ``checkpoints`` holds one record per complete checkpoint, keyed on (run,
   episode).
4. Long runs: ``episodes.data`` holds an episode without its detail, ``details`` the details
   kept for good and ``recent_details`` those not settled yet (as SQLite's version 4; a
   dropped detail is a deleted row, whose space vacuum gives back to the table); ``curve``
   holds the complete curve blocks of every run (``gateway.core.curve``). The migration splits
   every stored episode and computes the blocks of every run (``_split_and_backfill``).
5. Experiments: ``runs`` gains ``labels`` (JSON text), ``fork_run_id`` and ``fork_episode``,
   and the columns searches read of the task and config (``kind``, ``clip``, ``model``,
   ``learning_rate``, ``seed``; ``_fill_search_columns`` fills them in), as SQLite's version 5,
   with the indexes of searches (best reward, creation time, and a GIN index of the labels).
6. Jobs across trainers: ``runs`` gains ``trainers`` (JSON text: every trainer the run's job
   spans, rank 0's first), filled in from ``trainer`` (as SQLite's version 6).
7. Episodes' JSON: ``episodes``, ``details`` and ``recent_details`` gain ``json`` (as SQLite's
   version 7; NULL for the episodes stored before, whose JSON is written when read).

A migration runs in one transaction under an advisory lock, so replicas started together with
``--migrate`` migrate once, and a failed migration leaves the database as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from gateway.core.curve import CurveBlock
from gateway.core.store.base import DatabaseProblem, SchemaOutdated
from gateway.core.store.sqlite_schema import split_stored_episodes, task_search_values

APPLICATION = "trainwire"
SCHEMA_VERSION = 7
#: ``pg_advisory_xact_lock`` key of schema changes ("TWIR").
MIGRATION_LOCK = 0x54574952

_V1 = (
    "CREATE TABLE trainwire_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE runs (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        request_id TEXT UNIQUE,
        state SMALLINT NOT NULL,
        error_message TEXT NOT NULL,
        speed DOUBLE PRECISION NOT NULL,
        episodes_per_second DOUBLE PRECISION NOT NULL,
        episode INTEGER NOT NULL,
        reward DOUBLE PRECISION NOT NULL,
        best_reward DOUBLE PRECISION NOT NULL,
        task BYTEA NOT NULL,
        config BYTEA NOT NULL,
        create_time BIGINT NOT NULL,
        start_time BIGINT NOT NULL,
        end_time BIGINT NOT NULL,
        display_name TEXT NOT NULL,
        trainer TEXT NOT NULL,
        trainer_episode INTEGER NOT NULL DEFAULT 0,
        creator TEXT NOT NULL DEFAULT '',
        request_hash TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX runs_state ON runs (state, seq)",
    """CREATE TABLE episodes (
        run_id TEXT NOT NULL,
        episode INTEGER NOT NULL,
        data BYTEA NOT NULL,
        PRIMARY KEY (run_id, episode)
    )""",
    "ALTER TABLE episodes ALTER COLUMN data SET STORAGE EXTERNAL",
)
_V2 = (
    """ALTER TABLE runs
        ADD COLUMN owner TEXT,
        ADD COLUMN lease_until TIMESTAMPTZ,
        ADD COLUMN desired_state SMALLINT,
        ADD COLUMN desired_speed DOUBLE PRECISION,
        ADD COLUMN control_seq BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN applied_seq BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN control_error TEXT NOT NULL DEFAULT ''""",
    "CREATE INDEX runs_active ON runs (seq) WHERE state IN (1, 2, 3)",
)
_V3 = (
    """ALTER TABLE runs
        ADD COLUMN checkpoint_episode BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0,
        ADD COLUMN parked BOOLEAN NOT NULL DEFAULT false""",
    """CREATE TABLE checkpoints (
        run_id TEXT NOT NULL,
        episode BIGINT NOT NULL,
        create_time BIGINT NOT NULL,
        size_bytes BIGINT NOT NULL,
        sha256 TEXT NOT NULL,
        PRIMARY KEY (run_id, episode)
    )""",
)
_V4 = (
    """CREATE TABLE details (
        run_id TEXT NOT NULL,
        episode INTEGER NOT NULL,
        detail BYTEA NOT NULL,
        PRIMARY KEY (run_id, episode)
    )""",
    "ALTER TABLE details ALTER COLUMN detail SET STORAGE EXTERNAL",
    """CREATE TABLE recent_details (
        run_id TEXT NOT NULL,
        episode INTEGER NOT NULL,
        detail BYTEA NOT NULL,
        PRIMARY KEY (run_id, episode)
    )""",
    "ALTER TABLE recent_details ALTER COLUMN detail SET STORAGE EXTERNAL",
    # Recent details are deleted a chunk at a time as a run goes on: vacuum the table (and its
    # TOAST, where the details are) after every few thousand dead rows instead of after a
    # fifth of the table, so their space is reused while the run goes on, not after.
    "ALTER TABLE recent_details SET (autovacuum_vacuum_scale_factor = 0, "
    "autovacuum_vacuum_threshold = 2000, toast.autovacuum_vacuum_scale_factor = 0, "
    "toast.autovacuum_vacuum_threshold = 2000)",
    """CREATE TABLE curve (
        run_id TEXT NOT NULL,
        level SMALLINT NOT NULL,
        block BIGINT NOT NULL,
        count BIGINT NOT NULL,
        reward_min DOUBLE PRECISION NOT NULL,
        reward_max DOUBLE PRECISION NOT NULL,
        reward_sum DOUBLE PRECISION NOT NULL,
        best_end DOUBLE PRECISION NOT NULL,
        metrics TEXT NOT NULL,
        PRIMARY KEY (run_id, level, block)
    )""",
)
_V5 = (
    """ALTER TABLE runs
        ADD COLUMN labels TEXT NOT NULL DEFAULT '{}',
        ADD COLUMN fork_run_id TEXT NOT NULL DEFAULT '',
        ADD COLUMN fork_episode BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN kind TEXT NOT NULL DEFAULT '',
        ADD COLUMN clip TEXT NOT NULL DEFAULT '',
        ADD COLUMN model TEXT NOT NULL DEFAULT '',
        ADD COLUMN learning_rate DOUBLE PRECISION NOT NULL DEFAULT 0,
        ADD COLUMN seed BIGINT NOT NULL DEFAULT 0""",
    # Searches: the orders asked for most walk an index; label filters (jsonb @> and ?, as
    # gateway.core.store.search_sql writes them) read the GIN index.
    "CREATE INDEX runs_best_reward ON runs (best_reward, seq)",
    "CREATE INDEX runs_create_time ON runs (create_time, seq)",
    "CREATE INDEX runs_labels ON runs USING gin ((labels::jsonb))",
)
_V6 = (
    "ALTER TABLE runs ADD COLUMN trainers TEXT NOT NULL DEFAULT '[]'",
    # One entry for a run that started (json_build_array writes what json.dumps reads).
    "UPDATE runs SET trainers = json_build_array(trainer)::text WHERE trainer <> ''",
)
_V7 = (
    "ALTER TABLE episodes ADD COLUMN json bytea",
    "ALTER TABLE details ADD COLUMN json bytea",
    "ALTER TABLE recent_details ADD COLUMN json bytea",
)
MIGRATIONS: tuple[tuple[str, ...], ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7)

#: Inserts curve blocks given as arrays of their columns.
INSERT_CURVE = (
    "INSERT INTO curve (run_id, level, block, count, reward_min, reward_max, reward_sum, "
    "best_end, metrics) SELECT * FROM unnest(%s::text[], %s::smallint[], %s::bigint[], "
    "%s::bigint[], %s::float8[], %s::float8[], %s::float8[], %s::float8[], %s::text[]) "
    "ON CONFLICT DO NOTHING"
)


def curve_columns(rows: Sequence[tuple[str, CurveBlock]]) -> tuple[list[Any], ...]:
    """``INSERT_CURVE``'s arrays for ``(run_id, block)`` rows."""
    return (
        [r for r, _ in rows],
        [b.level for _, b in rows],
        [b.index for _, b in rows],
        [b.count for _, b in rows],
        [b.reward_min for _, b in rows],
        [b.reward_max for _, b in rows],
        [b.reward_sum for _, b in rows],
        [b.best_end for _, b in rows],
        [b.metrics for _, b in rows],
    )


async def _split_and_backfill(conn: psycopg.AsyncConnection) -> None:
    """Version 4's data: every episode split from its detail, every run's curve blocks."""
    async with conn.cursor(binary=True) as cur:
        await cur.execute("SELECT run_id, episode, data FROM episodes ORDER BY run_id, episode")
        rows = await cur.fetchall()
    split, blocks = split_stored_episodes(rows)
    async with conn.cursor() as cur:
        await cur.executemany(
            "UPDATE episodes SET data=%s WHERE run_id=%s AND episode=%s",
            [(d, r, n) for r, n, d, _ in split],
        )
        await cur.executemany(
            "INSERT INTO details (run_id, episode, detail) VALUES (%s, %s, %s)",
            [(r, n, x) for r, n, _, x in split],
        )
    if blocks:
        await conn.execute(INSERT_CURVE, curve_columns(blocks))


async def _fill_search_columns(conn: psycopg.AsyncConnection) -> None:
    """Version 5's data: the search columns of every run."""
    cur = await conn.execute("SELECT id, task, config FROM runs")
    rows = await cur.fetchall()
    async with conn.cursor() as update:
        await update.executemany(
            "UPDATE runs SET kind=%s, clip=%s, model=%s, learning_rate=%s, seed=%s WHERE id=%s",
            [(*task_search_values(bytes(t), bytes(c)), run_id) for run_id, t, c in rows],
        )


#: Data steps of a migration, after its statements: ``DATA_MIGRATIONS[v]`` for version ``v``.
DATA_MIGRATIONS = {4: _split_and_backfill, 5: _fill_search_columns}


async def _tables(conn: psycopg.AsyncConnection) -> list[str]:
    cur = await conn.execute(
        "SELECT table_name FROM information_schema.tables "
        "WHERE table_schema = current_schema() ORDER BY table_name"
    )
    return [row[0] for row in await cur.fetchall()]


async def schema_version(conn: psycopg.AsyncConnection, where: str) -> int:
    """The schema version of the database (0: no tables).

    Raises:
        DatabaseProblem: another program's database.
    """
    tables = await _tables(conn)
    if not tables:
        return 0
    if "trainwire_meta" not in tables:
        shown = ", ".join(tables[:8])
        raise DatabaseProblem(where, f"it is not a Trainwire database (its tables: {shown})")
    cur = await conn.execute("SELECT key, value FROM trainwire_meta")
    meta: dict[str, str] = dict(await cur.fetchall())
    if meta.get("application") != APPLICATION or not meta.get("schema_version", "").isdigit():
        raise DatabaseProblem(where, "it is not a Trainwire database (its trainwire_meta differs)")
    return int(meta["schema_version"])


async def check(conn: psycopg.AsyncConnection, where: str, migrate: bool) -> int:
    """The database's schema version, refusing what this gateway must not use; reads only.

    Raises:
        DatabaseProblem: another program's database, or one from a newer gateway.
        SchemaOutdated: an older schema and ``migrate`` not set.
    """
    version = await schema_version(conn, where)
    if version > SCHEMA_VERSION:
        raise DatabaseProblem(
            where,
            f"it was written by a newer gateway (schema version {version}; this one knows "
            f"up to {SCHEMA_VERSION})",
        )
    if 0 < version < SCHEMA_VERSION and not migrate:
        raise SchemaOutdated(where, version, SCHEMA_VERSION)
    return version


async def upgrade(
    conn: psycopg.AsyncConnection, where: str, migrate: bool, target: int = SCHEMA_VERSION
) -> int:
    """Creates the schema in an empty database or migrates an older one to ``target``, in one
    transaction under ``MIGRATION_LOCK``; returns the version found before.

    Raises:
        DatabaseProblem, SchemaOutdated: as ``check`` (checked again under the lock).
    """
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        found = await check(conn, where, migrate)
        for version in range(found + 1, target + 1):
            for statement in MIGRATIONS[version - 1]:
                await conn.execute(sql.SQL(statement))  # type: ignore[arg-type]
            if version in DATA_MIGRATIONS and found > 0:
                await DATA_MIGRATIONS[version](conn)
        if target > found:
            await conn.execute(
                "INSERT INTO trainwire_meta (key, value) VALUES ('application', %s), "
                "('schema_version', %s) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (APPLICATION, str(target)),
            )
    return found
