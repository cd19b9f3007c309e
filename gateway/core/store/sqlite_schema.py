"""The SQLite schema: its versions, how a database is recognised, and the migrations.

A Trainwire database carries ``PRAGMA application_id`` = ``APPLICATION_ID`` ("TWIR") and its
schema version in ``PRAGMA user_version``. The first release wrote neither: a database without
them whose ``runs`` and ``episodes`` tables have the first release's columns is version 1; any
other database with tables is another program's and is refused, never touched.

Versions:

1. The first release.
2. ``runs`` gains ``trainer_episode``, ``creator`` and ``request_hash`` (the fingerprint that
   tells a reused ``request_id`` from a retried one); ``episodes`` becomes a ``WITHOUT ROWID``
   table keyed on (run, episode), so each episode is stored once instead of in the table and
   again in its key's index; ``gateway_meta`` holds the write probe.
3. Checkpoints: ``runs`` gains ``checkpoint_episode`` (the largest recorded checkpoint),
   ``restarts`` and ``parked``; ``checkpoints`` holds one record per complete checkpoint,
   keyed on (run, episode).
4. Long runs: ``episodes.data`` holds an episode without its detail, ``details`` the details
   kept for good and ``recent_details`` those not settled yet (none: the episode has none, or
   it was dropped), so a scalar watch reads no detail and a long run drops most details
   (``gateway.core.details``) by deleting ranges of ``recent_details``, which frees whole pages
   for the next ones. Both are rowid tables: a detail of a few KiB fits in its page, where a
   ``WITHOUT ROWID`` row that large would spill into an overflow page of its own. ``curve``
   holds the complete curve blocks of every run (``gateway.core.curve``), keyed on (run, level,
   block). The migration splits every stored episode and computes the blocks of every run.
5. Experiments: ``runs`` gains ``labels`` (JSON), ``fork_run_id`` and ``fork_episode`` (the
   lineage of a fork), and the columns searches read of the task and config (``kind``,
   ``clip``, ``model``, ``learning_rate``, ``seed``; the migration fills them in), and
   indexes for searches ordered by best reward or creation time.
6. Jobs across trainers: ``runs`` gains ``trainers`` (JSON: every trainer the run's job spans,
   rank 0's first); the migration fills it in from ``trainer`` (one entry, or none while the
   run never started).
7. Episodes' JSON: ``episodes``, ``details`` and ``recent_details`` gain ``json``, the
   episode's JSON in the same parts as its bytes (``gateway.core.episode_json.json_parts``),
   written with the episode so that the HTTP side's event stream replays without encoding. The
   migration leaves it NULL for the episodes already stored: their JSON is written when read.

A database at an older version is migrated only when asked (``migrate=True``): a migration runs
in one transaction (every step from its version to the latest), so a failed one leaves the
database as it was.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from itertools import groupby
from typing import Any

from google.protobuf.message import DecodeError

from gateway.core.curve import CurveBlock, CurveBuilder
from gateway.core.framing import detail_offset
from gateway.core.store.base import DatabaseProblem, SchemaOutdated
from trainwire.v1 import episode_pb2

APPLICATION_ID = 0x54574952  # "TWIR"
SCHEMA_VERSION = 7

_RUNS = """
CREATE TABLE runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    request_id TEXT UNIQUE,
    state INTEGER NOT NULL,
    error_message TEXT NOT NULL,
    speed REAL NOT NULL,
    episodes_per_second REAL NOT NULL,
    episode INTEGER NOT NULL,
    reward REAL NOT NULL,
    best_reward REAL NOT NULL,
    task BLOB NOT NULL,
    config BLOB NOT NULL,
    create_time INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    end_time INTEGER NOT NULL,
    display_name TEXT NOT NULL,
    trainer TEXT NOT NULL,
    trainer_episode INTEGER NOT NULL DEFAULT 0,
    creator TEXT NOT NULL DEFAULT '',
    request_hash TEXT NOT NULL DEFAULT '',
    checkpoint_episode INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    parked INTEGER NOT NULL DEFAULT 0,
    labels TEXT NOT NULL DEFAULT '{}',
    fork_run_id TEXT NOT NULL DEFAULT '',
    fork_episode INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL DEFAULT '',
    clip TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    learning_rate REAL NOT NULL DEFAULT 0,
    seed INTEGER NOT NULL DEFAULT 0,
    trainers TEXT NOT NULL DEFAULT '[]'
)"""
#: The columns version 5 added to ``runs``.
_V5_RUN_COLUMNS = (
    "labels TEXT NOT NULL DEFAULT '{}'",
    "fork_run_id TEXT NOT NULL DEFAULT ''",
    "fork_episode INTEGER NOT NULL DEFAULT 0",
    "kind TEXT NOT NULL DEFAULT ''",
    "clip TEXT NOT NULL DEFAULT ''",
    "model TEXT NOT NULL DEFAULT ''",
    "learning_rate REAL NOT NULL DEFAULT 0",
    "seed INTEGER NOT NULL DEFAULT 0",
)
#: The column version 6 added to ``runs``.
_V6_RUN_COLUMN = "trainers TEXT NOT NULL DEFAULT '[]'"
_EPISODES_V2 = """
CREATE TABLE {name} (
    run_id TEXT NOT NULL,
    episode INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
) WITHOUT ROWID"""
_CHECKPOINTS = """
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL,
    episode INTEGER NOT NULL,
    create_time INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (run_id, episode)
) WITHOUT ROWID"""
_DETAILS = """
CREATE TABLE {name} (
    run_id TEXT NOT NULL,
    episode INTEGER NOT NULL,
    detail BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
)"""
_CURVE = """
CREATE TABLE curve (
    run_id TEXT NOT NULL,
    level INTEGER NOT NULL,
    block INTEGER NOT NULL,
    count INTEGER NOT NULL,
    reward_min REAL NOT NULL,
    reward_max REAL NOT NULL,
    reward_sum REAL NOT NULL,
    best_end REAL NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, level, block)
) WITHOUT ROWID"""
_INDEX = "CREATE INDEX IF NOT EXISTS runs_state ON runs (state, seq)"
#: Version 5's indexes of searches: the orders people ask for most (the best first, by
#: creation time) walk an index instead of sorting every run.
_V5_INDEXES = (
    "CREATE INDEX IF NOT EXISTS runs_best_reward ON runs (best_reward, seq)",
    "CREATE INDEX IF NOT EXISTS runs_create_time ON runs (create_time, seq)",
)
_META = "CREATE TABLE IF NOT EXISTS gateway_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"

#: The first release's columns that identify its ``runs`` table.
_V1_RUN_COLUMNS = frozenset(
    {"seq", "id", "request_id", "state", "task", "config", "episode", "best_reward", "trainer"}
)


INSERT_CURVE = (
    "INSERT OR REPLACE INTO curve (run_id, level, block, count, reward_min, reward_max, "
    "reward_sum, best_end, metrics) VALUES (?,?,?,?,?,?,?,?,?)"
)


def task_search_values(task: bytes, config: bytes) -> tuple[str, str, str, float, int]:
    """The search columns of a stored task and config (``search_values``), tolerant of bytes
    that do not parse (an empty task)."""
    try:
        parsed_task = episode_pb2.TrainTask.FromString(task)
        parsed_config = episode_pb2.TrainConfig.FromString(config)
    except DecodeError:
        return "", "", "", 0.0, 0
    return search_values(parsed_task, parsed_config)


def search_values(
    task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig
) -> tuple[str, str, str, float, int]:
    """The columns searches read of a run's task and config (written with it, never read
    back): kind, clip, model, learning rate, seed."""
    kind = task.WhichOneof("kind") or ""
    imitation, grpo = task.imitation, task.grpo
    clip = imitation.clip_name or (imitation.clip.name if imitation.HasField("clip") else "")
    rate = imitation.learning_rate if kind == "imitation" else grpo.learning_rate
    return kind, clip, grpo.model_path, rate, config.seed


def curve_rows(run_id: str, blocks: Iterable[CurveBlock]) -> list[tuple[Any, ...]]:
    """The rows of ``INSERT_CURVE`` for a run's blocks."""
    return [
        (
            run_id,
            b.level,
            b.index,
            b.count,
            b.reward_min,
            b.reward_max,
            b.reward_sum,
            b.best_end,
            b.metrics,
        )
        for b in blocks
    ]


def _tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"
    )
    return {name for (name,) in rows}


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def schema_version(conn: sqlite3.Connection, where: str) -> int:
    """The schema version of the database (0: empty).

    Raises:
        DatabaseProblem: another program's database.
    """
    application = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = _tables(conn)
    if application == APPLICATION_ID:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    if application != 0:
        raise DatabaseProblem(
            where, f"it belongs to another program (application id {application:#010x})"
        )
    if not tables:
        return 0
    if {"runs", "episodes"} <= tables and _columns(conn, "runs") >= _V1_RUN_COLUMNS:
        return 1
    shown = ", ".join(sorted(tables)[:8])
    raise DatabaseProblem(where, f"it is not a Trainwire database (its tables: {shown})")


def check(conn: sqlite3.Connection, where: str, migrate: bool) -> int:
    """The database's schema version, refusing what this gateway must not use; reads only, so
    a refused database is left exactly as it was.

    Raises:
        DatabaseProblem: another program's database, or one from a newer gateway.
        SchemaOutdated: an older schema and ``migrate`` not set.
    """
    version = schema_version(conn, where)
    if version > SCHEMA_VERSION:
        raise DatabaseProblem(
            where,
            f"it was written by a newer gateway (schema version {version}; this one knows "
            f"up to {SCHEMA_VERSION})",
        )
    if 0 < version < SCHEMA_VERSION and not migrate:
        raise SchemaOutdated(where, version, SCHEMA_VERSION)
    return version


def upgrade(conn: sqlite3.Connection, version: int) -> None:
    """Creates the schema in an empty database (version 0) or migrates an older one to
    ``SCHEMA_VERSION``, in one transaction."""
    if version == 0:
        _in_transaction(conn, _create)
    elif version < SCHEMA_VERSION:

        def migrate(conn: sqlite3.Connection) -> None:
            for target in range(version + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[target](conn)

        _in_transaction(conn, migrate)


def _in_transaction(conn: sqlite3.Connection, step: Callable[[sqlite3.Connection], None]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        step(conn)
        conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _create(conn: sqlite3.Connection) -> None:
    conn.execute(_RUNS)
    conn.execute(_INDEX)
    for ddl in _V5_INDEXES:
        conn.execute(ddl)
    conn.execute(_EPISODES_V2.format(name="episodes"))
    conn.execute(_DETAILS.format(name="details"))
    conn.execute(_DETAILS.format(name="recent_details"))
    conn.execute(_CHECKPOINTS)
    conn.execute(_META)
    conn.execute(_CURVE)
    _migrate_6_to_7(conn)


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    columns = _columns(conn, "runs")
    for name, ddl in (
        ("trainer_episode", "trainer_episode INTEGER NOT NULL DEFAULT 0"),
        ("creator", "creator TEXT NOT NULL DEFAULT ''"),
        ("request_hash", "request_hash TEXT NOT NULL DEFAULT ''"),
    ):
        if name not in columns:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {ddl}")
    conn.execute(_INDEX)
    conn.execute(_EPISODES_V2.format(name="episodes_v2"))
    conn.execute("INSERT INTO episodes_v2 SELECT run_id, episode, data FROM episodes")
    conn.execute("DROP TABLE episodes")
    conn.execute("ALTER TABLE episodes_v2 RENAME TO episodes")
    conn.execute(_META)


def _migrate_2_to_3(conn: sqlite3.Connection) -> None:
    for ddl in (
        "checkpoint_episode INTEGER NOT NULL DEFAULT 0",
        "restarts INTEGER NOT NULL DEFAULT 0",
        "parked INTEGER NOT NULL DEFAULT 0",
    ):
        conn.execute(f"ALTER TABLE runs ADD COLUMN {ddl}")
    conn.execute(_CHECKPOINTS)


def split_stored_episodes(
    rows: Iterable[tuple[str, int, bytes]],
) -> tuple[list[tuple[str, int, bytes, bytes]], list[tuple[str, CurveBlock]]]:
    """Version 4's data of version 3's episodes, ``(run_id, episode, data)`` ordered by run and
    episode (both stores' migrations): ``(run_id, episode, numbers, detail)`` of each episode
    that has a detail, and every run's complete curve blocks. A run whose bytes are not
    episodes (or have a gap) gets no curve."""
    split: list[tuple[str, int, bytes, bytes]] = []
    blocks: list[tuple[str, CurveBlock]] = []
    for run_id, episodes in groupby(rows, key=lambda row: row[0]):
        builder: CurveBuilder | None = CurveBuilder()
        for _, number, raw in episodes:
            data = bytes(raw)
            at = detail_offset(data)
            if at < len(data):
                split.append((run_id, number, data[:at], data[at:]))
            if builder is None:
                continue
            try:
                episode = episode_pb2.Episode.FromString(data)
                done = builder.add(number, episode.reward, episode.best_reward, episode.metrics)
            except (DecodeError, ValueError):
                builder = None
                continue
            blocks.extend((run_id, b) for b in done)
    return split, blocks


def _migrate_3_to_4(conn: sqlite3.Connection) -> None:
    conn.execute(_DETAILS.format(name="details"))
    conn.execute(_DETAILS.format(name="recent_details"))
    conn.execute(_CURVE)
    rows = conn.execute("SELECT run_id, episode, data FROM episodes ORDER BY run_id, episode")
    split, blocks = split_stored_episodes(rows)
    conn.executemany(
        "UPDATE episodes SET data=? WHERE run_id=? AND episode=?",
        [(d, r, n) for r, n, d, _ in split],
    )
    conn.executemany(
        "INSERT INTO details (run_id, episode, detail) VALUES (?,?,?)",
        [(r, n, x) for r, n, _, x in split],
    )
    conn.executemany(INSERT_CURVE, [row for r, b in blocks for row in curve_rows(r, (b,))])


def _migrate_4_to_5(conn: sqlite3.Connection) -> None:
    for ddl in _V5_RUN_COLUMNS:
        conn.execute(f"ALTER TABLE runs ADD COLUMN {ddl}")
    for ddl in _V5_INDEXES:
        conn.execute(ddl)
    rows = conn.execute("SELECT id, task, config FROM runs").fetchall()
    conn.executemany(
        "UPDATE runs SET kind=?, clip=?, model=?, learning_rate=?, seed=? WHERE id=?",
        [(*task_search_values(task, config), run_id) for run_id, task, config in rows],
    )


def trainers_json(trainers: Iterable[str]) -> str:
    """A run's trainers as the ``trainers`` column holds them (a JSON array)."""
    return json.dumps(list(trainers), separators=(",", ":"))


def _migrate_5_to_6(conn: sqlite3.Connection) -> None:
    if "trainers" not in _columns(conn, "runs"):  # a column already there is kept
        conn.execute(f"ALTER TABLE runs ADD COLUMN {_V6_RUN_COLUMN}")
    rows = conn.execute("SELECT id, trainer FROM runs WHERE trainer != ''").fetchall()
    conn.executemany(
        "UPDATE runs SET trainers=? WHERE id=?",
        [(trainers_json([trainer]), run_id) for run_id, trainer in rows],
    )


def _migrate_6_to_7(conn: sqlite3.Connection) -> None:
    for table in ("episodes", "details", "recent_details"):
        if "json" not in _columns(conn, table):  # a column already there is kept
            conn.execute(f"ALTER TABLE {table} ADD COLUMN json BLOB")


#: ``MIGRATIONS[v]`` takes a database from version ``v - 1`` to ``v``.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    2: _migrate_1_to_2,
    3: _migrate_2_to_3,
    4: _migrate_3_to_4,
    5: _migrate_4_to_5,
    6: _migrate_5_to_6,
    7: _migrate_6_to_7,
}
