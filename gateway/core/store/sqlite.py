"""SQLite queries of the gateway's store: ``SqliteStore``, the synchronous runs, episodes and
checkpoint records of one database file (the schema and its migrations are
``gateway.core.store.sqlite_schema``; the thread that owns the connection and group-commits is
``gateway.core.store.sqlite_thread``).

Durability: WAL with ``synchronous=NORMAL``: a committed transaction survives a crash of the
process (``kill -9``); a power loss may lose the last commits, never corrupt the database.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.curve import CurveBlock
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from gateway.core.store.base import (
    CheckpointRecord,
    DatabaseProblem,
    EpisodeRecord,
    StoreWriteFailed,
    stored_episodes,
    stored_json,
)
from gateway.core.store.search_sql import SQLITE, page_of, select_runs
from gateway.core.store.sqlite_schema import (
    INSERT_CURVE,
    check,
    curve_rows,
    search_values,
    trainers_json,
    upgrade,
)
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: The page size of a new database (an existing one keeps its own).
PAGE_SIZE = 16384

#: What the write probe writes: room for a few hundred episodes before the store is trusted again.
PROBE_BYTES = 256 << 10


_RUN_COLUMNS = (
    "seq, id, request_id, state, error_message, speed, episodes_per_second, episode, reward, "
    "best_reward, task, config, create_time, start_time, end_time, display_name, trainer, "
    "trainer_episode, creator, request_hash, checkpoint_episode, restarts, parked, labels, "
    "fork_run_id, fork_episode, kind, clip, model, learning_rate, seed, trainers"
)
#: How many columns ``_RUN_COLUMNS`` names.
_RUN_WIDTH = _RUN_COLUMNS.count(",") + 1


def _describe(exc: BaseException) -> str:
    """What a SQLite error means for people."""
    text = str(exc)
    lowered = text.lower()
    if "not a database" in lowered:
        return "it is not a SQLite database (corrupt, or another kind of file)"
    if "readonly" in lowered or "read-only" in lowered:
        return "it is read-only"
    if "unable to open" in lowered:
        return "it cannot be opened (missing directory, or no permission)"
    if "full" in lowered:
        return "the disk is full"
    if "disk i/o" in lowered:
        return "the disk cannot be written (I/O error)"
    return text


def _check_path(path: str) -> None:
    """Refuses paths SQLite would fail on with a vaguer message."""
    if os.path.isdir(path):
        raise DatabaseProblem(path, "it is a directory")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise DatabaseProblem(path, "this user cannot read and write it")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise DatabaseProblem(path, f"its directory cannot be created ({exc.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DatabaseProblem(path, f"its directory {parent} is not writable")


def write_failure(exc: BaseException) -> StoreWriteFailed | None:
    """The ``StoreWriteFailed`` of a SQLite error that means the database cannot be written
    (disk full, read-only, I/O error), else None (a bug, a constraint)."""
    if not isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError) or isinstance(
        exc, sqlite3.IntegrityError
    ):
        return None
    lowered = str(exc).lower()
    if any(word in lowered for word in ("full", "disk i/o", "readonly", "read-only", "unable")):
        return StoreWriteFailed(_describe(exc))
    return None


def _checkpoint(conn: sqlite3.Connection) -> tuple[int, int, int]:
    busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(busy), int(frames), int(copied)


def labels_json(labels: Mapping[str, str]) -> str:
    """Labels as the ``labels`` column holds them (JSON, keys sorted)."""
    return json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def _run_values(run: TrainingRun) -> tuple[Any, ...]:
    """A run's row in the order of ``_RUN_COLUMNS`` without ``seq`` (the inverse of
    ``_run_from_row``), for an INSERT or a COPY."""
    return (
        run.id,
        run.request_id or None,
        int(run.state),
        run.error_message,
        run.speed,
        run.episodes_per_second,
        run.episode,
        run.reward,
        run.best_reward,
        run.task.SerializeToString(),
        run.config.SerializeToString(),
        run.create_time,
        run.start_time,
        run.end_time,
        run.display_name,
        run.trainer,
        run.trainer_episode,
        run.creator,
        run.request_hash,
        run.checkpoint_episode,
        run.restarts,
        run.parked,
        labels_json(run.labels),
        run.fork_run_id,
        run.fork_episode,
        *search_values(run.task, run.config),
        trainers_json(run.trainers),
    )


def _run_from_row(row: Sequence[Any]) -> TrainingRun:
    task = episode_pb2.TrainTask.FromString(row[10])
    config = episode_pb2.TrainConfig.FromString(row[11])
    return TrainingRun(
        seq=row[0],
        id=row[1],
        request_id=row[2] or "",
        state=RunState(row[3]),
        error_message=row[4],
        speed=row[5],
        episodes_per_second=row[6],
        episode=row[7],
        reward=row[8],
        best_reward=row[9],
        task=task,
        config=config,
        create_time=row[12],
        start_time=row[13],
        end_time=row[14],
        display_name=row[15],
        trainer=row[16],
        trainer_episode=row[17],
        creator=row[18],
        request_hash=row[19],
        checkpoint_episode=row[20],
        restarts=row[21],
        parked=bool(row[22]),
        labels=json.loads(row[23]) if row[23] else {},
        fork_run_id=row[24],
        fork_episode=row[25],
        trainers=tuple(json.loads(row[31])) if row[31] else (),
    )


class SqliteStore:
    """The gateway's SQLite database. Not thread-safe: use it from one thread at a time.

    Args:
        path: Database file, or ``:memory:``.
    """

    def __init__(self, path: str, migrate: bool = False) -> None:
        self.path = path
        self._in_tx = False
        self._checkpoint_conn: sqlite3.Connection | None = None
        if path != ":memory:":
            _check_path(path)
        try:
            # Autocommit mode: transactions are explicit (BEGIN ... COMMIT) so one can span a
            # batch.
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise DatabaseProblem(path, _describe(exc)) from None
        try:
            # Checked before anything is set: a refused database is left exactly as it was.
            self.found_version = check(self._conn, path, migrate)
            if self.found_version == 0:
                # A new database: 16 KiB pages hold six motions of a few KiB each, where 4 KiB
                # pages would hold one and leave the rest of the page empty.
                self._conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            # Checkpoints (which fsync) run on the store thread's checkpointer, not inside a
            # commit: an automatic checkpoint would stall publication for as long as the disk
            # takes.
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            # Whenever the WAL starts again, its file is cut back to what it holds (without
            # this it keeps its largest size for ever): the file's size is the WAL's (see
            # StoreThread).
            self._conn.execute("PRAGMA journal_size_limit=0")
            self._conn.execute("PRAGMA foreign_keys=OFF")
            upgrade(self._conn, self.found_version)
            self._analyze_runs()
        except DatabaseProblem:
            self._conn.close()
            raise
        except sqlite3.Error as exc:
            self._conn.close()
            raise DatabaseProblem(path, _describe(exc)) from None

    def _analyze_runs(self) -> None:
        """Samples the runs' indexes for the query planner (a bounded sample: milliseconds at
        any size), so a search picks its index from the data (``best_reward desc`` walks
        ``runs_best_reward`` rather than sorting every finished run). A database that cannot
        be written opens without it."""
        try:
            self._conn.execute("PRAGMA analysis_limit=1000")
            self._conn.execute("ANALYZE runs")
        except sqlite3.OperationalError as exc:
            _LOGGER.warning("could not sample the runs' indexes of %s: %s", self.path, exc)

    @property
    def is_file(self) -> bool:
        """False for an in-memory database."""
        return self.path != ":memory:"

    def journal_size_limit(self, limit_bytes: int) -> None:
        """Sets the size the WAL file is cut back to when the WAL restarts (0, what it holds,
        by default; -1: never cut, the file keeps its largest size)."""
        self._conn.execute(f"PRAGMA journal_size_limit={int(limit_bytes)}")

    def checkpoint(self) -> tuple[int, int, int]:
        """Copies the WAL into the database without blocking the writer (PASSIVE), on a second
        connection of this store; call it from one thread at a time.

        Returns:
            ``PRAGMA wal_checkpoint``'s row: busy (1 when another checkpoint ran), frames in
            the WAL when it started, frames now copied into the database.
        """
        if self._checkpoint_conn is None:
            self._checkpoint_conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False
            )
        return _checkpoint(self._checkpoint_conn)

    def checkpoint_writer(self) -> tuple[int, int, int]:
        """The same on this (the writer's) connection, outside a transaction: with no write in
        flight it copies the whole WAL, and the next commit writes the WAL from its start."""
        assert not self._in_tx
        return _checkpoint(self._conn)

    def begin(self) -> None:
        """Opens a transaction (no-op inside one)."""
        if not self._in_tx:
            self._conn.execute("BEGIN")
            self._in_tx = True

    def commit(self) -> None:
        """Commits the open transaction (no-op outside one)."""
        if self._in_tx:
            self._in_tx = False
            self._conn.execute("COMMIT")

    def rollback(self) -> None:
        """Rolls back the open transaction (no-op outside one, including one SQLite already
        rolled back itself after a failed write)."""
        self._in_tx = False
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def probe_write(self) -> None:
        """A write of ``PROBE_BYTES``: succeeds once the database has room again (a small write
        may fit in pages the database already has while it cannot grow)."""
        self._conn.execute(
            "INSERT OR REPLACE INTO gateway_meta (key, value) VALUES ('write_probe', ?)",
            (f"{time.time_ns()}:{'x' * PROBE_BYTES}",),
        )
        self._conn.execute("DELETE FROM gateway_meta WHERE key='write_probe'")

    def close(self) -> None:
        """Commits and closes the connections (the writer's last: closing the last connection
        copies the WAL into the database and deletes it)."""
        self.commit()
        if self._checkpoint_conn is not None:
            self._checkpoint_conn.close()
        self._conn.close()

    def insert_run(self, run: TrainingRun) -> int:
        """Inserts a new run; returns its creation sequence number."""
        cur = self._conn.execute(
            f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (NULL{',?' * (_RUN_COLUMNS.count(','))})",
            _run_values(run),
        )
        seq = cur.lastrowid
        assert seq is not None
        return seq

    def update_run(self, run: TrainingRun) -> None:
        """Writes a run's state, speed, times, trainer and trainers, trainer episode, restarts,
        parked and task (its live hyperparameters change, with the ``learning_rate`` search
        column).

        The episode counters are not written: ``append_episodes`` owns them, and a snapshot
        taken before the last group commit must not rewind them; nor is
        ``checkpoint_episode``, which the checkpoint records own.
        """
        self._conn.execute(
            "UPDATE runs SET state=?, error_message=?, speed=?, start_time=?, end_time=?, "
            "trainer=?, trainers=?, trainer_episode=?, restarts=?, parked=?, task=?, "
            "learning_rate=? WHERE id=?",
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
            ),
        )

    def update_metadata(self, run_id: str, display_name: str, labels: Mapping[str, str]) -> bool:
        """Sets a run's display name and labels; False when there is no such run."""
        cur = self._conn.execute(
            "UPDATE runs SET display_name=?, labels=? WHERE id=?",
            (display_name, labels_json(labels), run_id),
        )
        return cur.rowcount > 0

    def append_episodes(self, records: Sequence[EpisodeRecord]) -> None:
        """Appends episodes and moves each run's counters to its last appended episode."""
        self._conn.executemany(
            "INSERT INTO episodes (run_id, episode, data, json) VALUES (?,?,?,?)",
            [(r.run_id, r.episode, r.scalars, r.numbers_json or None) for r in records],
        )
        for table, keep in (("details", True), ("recent_details", False)):
            details = [
                (r.run_id, r.episode, r.detail, r.detail_json)
                for r in records
                if r.detail_at >= 0 and r.keep_detail is keep
            ]
            if details:
                self._conn.executemany(
                    f"INSERT INTO {table} (run_id, episode, detail, json) VALUES (?,?,?,?)",
                    details,
                )
        last: dict[str, EpisodeRecord] = {}
        for r in records:
            last[r.run_id] = r
            if r.blocks:
                self._conn.executemany(INSERT_CURVE, curve_rows(r.run_id, r.blocks))
        self._conn.executemany(
            "UPDATE runs SET episode=?, reward=?, best_reward=? WHERE id=?",
            [(r.episode, r.reward, r.best_reward, r.run_id) for r in last.values()],
        )

    def get_run(self, run_id: str) -> TrainingRun | None:
        """The run with this id, or None."""
        row = self._conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE id=?", (run_id,)
        ).fetchone()
        return None if row is None else _run_from_row(row)

    def find_request(self, request_id: str) -> TrainingRun | None:
        """The run created with this request id, or None."""
        row = self._conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE request_id=?", (request_id,)
        ).fetchone()
        return None if row is None else _run_from_row(row)

    def list_runs(self, query: RunQuery) -> RunPage:
        """A page of the runs a search finds, in its order (see ``Store.list_runs``)."""
        sql, params = select_runs(query, _RUN_COLUMNS, SQLITE)
        rows = self._conn.execute(sql, params).fetchall()
        return page_of(rows, query, _RUN_WIDTH, _run_from_row)

    def read_episodes(
        self, run_id: str, first: int, last: int, scalars: bool = False, json: bool = False
    ) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order, with their kept
        detail or without (``scalars``); or their JSON (``json``).

        The details are read by range, apart from the numbers, and matched in Python: details
        are few (one in tens to thousands of episodes), and a join probed both detail tables
        for every episode, a third of a replay's time."""
        where = (run_id, first, last)
        rows = self._conn.execute(
            # The JSON, and the bytes only where it is missing (``stored_json``).
            (
                "SELECT episode, json, CASE WHEN json IS NULL THEN data END"
                if json
                else "SELECT episode, data"
            )
            + " FROM episodes WHERE run_id=? AND episode BETWEEN ? AND ? ORDER BY episode",
            where,
        ).fetchall()
        if scalars:
            return stored_json(rows, None) if json else [r[1] for r in rows]
        columns = (
            "episode, json, CASE WHEN json IS NULL THEN detail END" if json else "episode, detail"
        )
        details: dict[int, Any] = {}
        # Recent first: a detail in both tables (settled, not yet deleted) is the kept one.
        for table in ("recent_details", "details"):
            found = self._conn.execute(
                f"SELECT {columns} FROM {table} WHERE run_id=? AND episode BETWEEN ? AND ?",
                where,
            )
            if json:
                details.update((n, (text, detail)) for n, text, detail in found)
            else:
                details.update(found)
        return stored_json(rows, details) if json else stored_episodes(rows, details)

    def read_curve_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        """The stored curve blocks of ``(level, first_index, last_index)`` spans."""
        out: list[CurveBlock] = []
        for level, lo, hi in spans:
            rows = self._conn.execute(
                "SELECT level, block, count, reward_min, reward_max, reward_sum, best_end, "
                "metrics FROM curve WHERE run_id=? AND level=? AND block BETWEEN ? AND ? "
                "ORDER BY block",
                (run_id, level, lo, hi),
            )
            out.extend(CurveBlock(*row) for row in rows)
        return out

    def settle_details(self, run_id: str, first: int, last: int, keep: Sequence[int]) -> int:
        """Keeps the recent details of ``keep`` among episodes ``first..last`` for good and
        drops the others; returns how many it dropped."""
        kept = ",".join(str(int(k)) for k in keep) or "0"
        moved = self._conn.execute(
            "INSERT OR IGNORE INTO details (run_id, episode, detail, json) SELECT run_id, "
            "episode, detail, json FROM recent_details WHERE run_id=? AND episode BETWEEN ? AND ? "
            f"AND episode IN ({kept})",
            (run_id, first, last),
        )
        cur = self._conn.execute(
            "DELETE FROM recent_details WHERE run_id=? AND episode BETWEEN ? AND ?",
            (run_id, first, last),
        )
        return cur.rowcount - moved.rowcount

    def delete_run(self, run_id: str) -> None:
        """Deletes a run, its history and its checkpoint records."""
        self._conn.execute("DELETE FROM episodes WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM details WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM recent_details WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM curve WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM checkpoints WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM runs WHERE id=?", (run_id,))

    def add_checkpoint(self, record: CheckpointRecord, keep: int) -> list[int]:
        """Records a checkpoint (a new digest for an episode recorded before replaces the old
        one: the files were written again), keeps the run's ``keep`` largest episodes and moves
        its ``checkpoint_episode`` (see ``Store.add_checkpoint``); returns the episodes whose
        records are not kept, in order (the record itself when the run does not exist)."""
        run = self._conn.execute("SELECT 1 FROM runs WHERE id=?", (record.run_id,)).fetchone()
        if run is None:
            return [record.episode]
        cur = self._conn.execute(
            "INSERT INTO checkpoints (run_id, episode, create_time, size_bytes, sha256) "
            "VALUES (?,?,?,?,?) ON CONFLICT (run_id, episode) DO UPDATE SET "
            "create_time=excluded.create_time, size_bytes=excluded.size_bytes, "
            "sha256=excluded.sha256 WHERE sha256 <> excluded.sha256",
            (record.run_id, record.episode, record.create_time, record.size_bytes, record.sha256),
        )
        if cur.rowcount == 0:
            return []  # recorded already, with the same digest
        rows = self._conn.execute(
            "DELETE FROM checkpoints WHERE run_id=? AND episode NOT IN "
            "(SELECT episode FROM checkpoints WHERE run_id=? ORDER BY episode DESC LIMIT ?) "
            "AND episode <> coalesce((SELECT max(c.episode) FROM checkpoints c JOIN runs r "
            "ON r.id = c.run_id WHERE c.run_id=? AND c.episode <= r.episode "
            "AND c.episode <> ?), -1) "
            "RETURNING episode",
            (record.run_id, record.run_id, keep, record.run_id, record.episode),
        ).fetchall()
        self._set_checkpoint_episode(record.run_id)
        return sorted(episode for (episode,) in rows)

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """The run's checkpoint records, oldest first."""
        rows = self._conn.execute(
            "SELECT run_id, episode, create_time, size_bytes, sha256 FROM checkpoints "
            "WHERE run_id=? ORDER BY episode",
            (run_id,),
        ).fetchall()
        return [CheckpointRecord(*row) for row in rows]

    def delete_checkpoints(self, run_id: str, episodes: Sequence[int]) -> None:
        """Deletes checkpoint records and moves the run's ``checkpoint_episode`` to its largest
        remaining one."""
        self._conn.executemany(
            "DELETE FROM checkpoints WHERE run_id=? AND episode=?",
            [(run_id, episode) for episode in episodes],
        )
        self._set_checkpoint_episode(run_id)

    def _set_checkpoint_episode(self, run_id: str) -> None:
        self._conn.execute(
            "UPDATE runs SET checkpoint_episode = "
            "(SELECT coalesce(max(episode), 0) FROM checkpoints WHERE run_id=?) WHERE id=?",
            (run_id, run_id),
        )

    def count_by_state(self) -> dict[RunState, int]:
        """How many runs are in each state (states without runs are left out)."""
        rows = self._conn.execute("SELECT state, COUNT(*) FROM runs GROUP BY state")
        return {RunState(state): count for state, count in rows}

    def active_runs(self) -> list[TrainingRun]:
        """Every PENDING, RUNNING or PAUSED run, oldest first (what a restart recovers)."""
        active = [int(s) for s in RunState if s.active]
        marks = ",".join("?" * len(active))
        rows = self._conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs WHERE state IN ({marks}) ORDER BY seq", active
        ).fetchall()
        return [_run_from_row(r) for r in rows]
