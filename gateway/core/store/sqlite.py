"""Durable runs and episode histories in SQLite (WAL), behind one store thread.

``SqliteStore`` is the synchronous schema and queries. ``StoreThread`` owns the connection on a
single thread and runs every operation in queue order; consecutive operations that are already
queued run in one transaction (group commit), consecutive episode appends among them as one
statement, and their results are delivered to the event loop only after that transaction
committed. Hence an episode is durable before any watcher can see it, and a burst of episodes
costs one commit, not one per episode.

Durability: WAL with ``synchronous=NORMAL``: a committed transaction survives a crash of the
process (``kill -9``); a power loss may lose the last commits, never corrupt the database.

The WAL starts again from its beginning once it holds ``WAL_LIMIT_BYTES`` (32 MiB). A
checkpoint copies the WAL into the database, but the WAL only starts again when a transaction
begins with all of it copied, and a writer that never pauses never leaves a checkpoint on
another connection that moment: with such checkpoints alone the WAL grew for as long as ingest
lasted (469 MiB beside an 18 MiB database after 200,000 episodes), and with it the disk used
and the time a restart after a crash spends reading it back. So:

- Checkpoints (the only step that fsyncs) run on a checkpointer thread with a connection of its
  own (``PASSIVE``: never blocking the writer), once a second, and one after the other while
  the WAL holds more than half its limit, so that they keep up with a steady writer.
- Once the WAL holds its limit, the store thread, between two transactions (after delivering
  the last one), copies what the checkpointer's last pass left: the frames written since that
  pass began. Its next commit then writes the WAL from the start. Mostly a pass ends between
  two transactions and the WAL starts again by itself; this step is the guarantee, and the
  only checkpoint work on the commit path (past one and a half times the limit it also waits
  for the checkpointer's pass in flight).
- ``journal_size_limit=0`` cuts the file back whenever the WAL starts again, so the file's size
  is what the WAL holds: the store thread measures it with one ``stat`` per commit. A clean
  close copies the WAL into the database and deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.core.runs import RunState, TrainingRun
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

#: The store thread brings the WAL back to its start once it holds this much.
WAL_LIMIT_BYTES = 32 * 2**20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
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
    creator TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS runs_state ON runs (state, seq);
CREATE TABLE IF NOT EXISTS episodes (
    run_id TEXT NOT NULL,
    episode INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
);
"""

_RUN_COLUMNS = (
    "seq, id, request_id, state, error_message, speed, episodes_per_second, episode, reward, "
    "best_reward, task, config, create_time, start_time, end_time, display_name, trainer, "
    "trainer_episode, creator"
)


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """One published episode: its number, the run's counters after it, and its bytes."""

    run_id: str
    episode: int
    reward: float
    best_reward: float
    data: bytes


def _checkpoint(conn: sqlite3.Connection) -> tuple[int, int, int]:
    busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(busy), int(frames), int(copied)


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
    )


class SqliteStore:
    """The gateway's SQLite database. Not thread-safe: use it from one thread at a time.

    Args:
        path: Database file, or ``:memory:``.
    """

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
        self.path = path
        # Autocommit mode: transactions are explicit (BEGIN ... COMMIT) so one can span a batch.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (which fsync) run on the store thread's checkpointer, not inside a commit:
        # an automatic checkpoint would stall publication for as long as the disk takes.
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        # Whenever the WAL starts again, its file is cut back to what it holds (without this it
        # keeps its largest size for ever): the file's size is the WAL's (see StoreThread).
        self._conn.execute("PRAGMA journal_size_limit=0")
        self._conn.execute("PRAGMA foreign_keys=OFF")
        self._conn.executescript(_SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(runs)")}
        if "trainer_episode" not in columns:  # a database of the first release
            self._conn.execute(
                "ALTER TABLE runs ADD COLUMN trainer_episode INTEGER NOT NULL DEFAULT 0"
            )
        if "creator" not in columns:  # a database from before token authentication
            self._conn.execute("ALTER TABLE runs ADD COLUMN creator TEXT NOT NULL DEFAULT ''")
        self._in_tx = False
        self._checkpoint_conn: sqlite3.Connection | None = None

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
        """Rolls back the open transaction (no-op outside one)."""
        if self._in_tx:
            self._in_tx = False
            self._conn.execute("ROLLBACK")

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
            f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (NULL,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
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
            ),
        )
        seq = cur.lastrowid
        assert seq is not None
        return seq

    def update_run(self, run: TrainingRun) -> None:
        """Writes a run's state, speed, times, trainer and trainer episode.

        The episode counters are not written: ``append_episodes`` owns them, and a snapshot
        taken before the last group commit must not rewind them.
        """
        self._conn.execute(
            "UPDATE runs SET state=?, error_message=?, speed=?, start_time=?, end_time=?, "
            "trainer=?, trainer_episode=? WHERE id=?",
            (
                int(run.state),
                run.error_message,
                run.speed,
                run.start_time,
                run.end_time,
                run.trainer,
                run.trainer_episode,
                run.id,
            ),
        )

    def append_episodes(self, records: Sequence[EpisodeRecord]) -> None:
        """Appends episodes and moves each run's counters to its last appended episode."""
        self._conn.executemany(
            "INSERT INTO episodes (run_id, episode, data) VALUES (?,?,?)",
            [(r.run_id, r.episode, r.data) for r in records],
        )
        last: dict[str, EpisodeRecord] = {}
        for r in records:
            last[r.run_id] = r
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

    def list_runs(
        self, state: RunState | None, before_seq: int | None, limit: int
    ) -> list[TrainingRun]:
        """Runs newest first, optionally in one state, created before ``before_seq``."""
        where: list[str] = []
        args: list[Any] = []
        if state is not None:
            where.append("state=?")
            args.append(int(state))
        if before_seq is not None:
            where.append("seq<?")
            args.append(before_seq)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._conn.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs {clause} ORDER BY seq DESC LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [_run_from_row(r) for r in rows]

    def read_episodes(self, run_id: str, first: int, last: int) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order."""
        rows = self._conn.execute(
            "SELECT data FROM episodes WHERE run_id=? AND episode BETWEEN ? AND ? ORDER BY episode",
            (run_id, first, last),
        ).fetchall()
        return [r[0] for r in rows]

    def delete_run(self, run_id: str) -> None:
        """Deletes a run and its history."""
        self._conn.execute("DELETE FROM episodes WHERE run_id=?", (run_id,))
        self._conn.execute("DELETE FROM runs WHERE id=?", (run_id,))

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


class _Op:
    __slots__ = ("args", "callback", "fn")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], callback: Callable[..., None] | None
    ) -> None:
        self.fn = fn
        self.args = args
        self.callback = callback


_Result = tuple[Callable[..., None] | None, Any, BaseException | None]

_STOP = object()
#: Seconds between checkpoints while the WAL holds less than half its limit ...
CHECKPOINT_INTERVAL_S = 1.0
#: ... and while it holds more (then the store thread asks for them after each commit).
CATCH_UP_INTERVAL_S = 0.1
_MAX_BATCH = 2048
_APPEND = SqliteStore.append_episodes


class StoreThread:
    """Runs store operations on one thread, group-committing whatever is queued together.

    Results come back on the event loop: ``call`` awaits one; ``submit`` hands it to a callback
    (``callback(result, error)``) without a future per operation, for the episode hot path.
    Consecutive ``append_episodes`` operations of a batch run as one ``append_episodes``.

    Args:
        store: The database; owned by this thread from ``start`` on.
        loop: The event loop results are delivered on.
        on_commit: Called on the store thread after each commit with the batch size (in
            operations) and the commit's duration in seconds (a hook for metrics).
        wal_limit_bytes: The WAL is brought back to its start once it holds this much (see the
            module docstring; default ``WAL_LIMIT_BYTES``).
    """

    def __init__(
        self,
        store: SqliteStore,
        loop: asyncio.AbstractEventLoop,
        on_commit: Callable[[int, float], None] | None = None,
        *,
        wal_limit_bytes: int | None = None,
    ) -> None:
        if wal_limit_bytes is None:
            wal_limit_bytes = WAL_LIMIT_BYTES
        if wal_limit_bytes <= 0:
            raise ValueError(f"wal_limit_bytes must be > 0, got {wal_limit_bytes}")
        self._store = store
        self._loop = loop
        self._on_commit = on_commit
        self._queue: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gateway-store", daemon=True)
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="gateway-store-checkpoint", daemon=True
        )
        self._stopping = threading.Event()
        self._closed = False
        self._wal_limit = wal_limit_bytes
        self._wal_path = f"{store.path}-wal"
        self._wake_checkpointer = threading.Event()
        # One checkpoint at a time: the checkpointer's, or the store thread's own.
        self._checkpoint_lock = threading.Lock()

    @property
    def store(self) -> SqliteStore:
        """The database (touch it only from the store thread, or before ``start``)."""
        return self._store

    def start(self) -> None:
        """Starts the store thread (and, for a file, its checkpointer)."""
        self._thread.start()
        if self._store.is_file:
            self._checkpointer.start()

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        callback: Callable[[Any, BaseException | None], None] | None = None,
    ) -> None:
        """Queues ``fn(store, *args)``; ``callback(result, error)`` runs on the loop after the
        commit."""
        if self._closed:
            raise RuntimeError("the store is closed")
        self._queue.put(_Op(fn, args, callback))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(store, *args)`` on the store thread and returns its result once committed."""
        future: asyncio.Future[T] = self._loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.submit(fn, *args, callback=done)
        return await future

    async def close(self) -> None:
        """Commits everything queued, stops the thread and closes the database."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    # -- checkpoints -------------------------------------------------------------------------

    def _checkpoint_loop(self) -> None:
        """The checkpointer thread: a PASSIVE checkpoint every ``CHECKPOINT_INTERVAL_S``, or
        every ``CATCH_UP_INTERVAL_S`` while the store thread asks for them."""
        while True:
            self._wake_checkpointer.wait(CHECKPOINT_INTERVAL_S)
            self._wake_checkpointer.clear()
            if self._stopping.is_set():
                return
            try:
                with self._checkpoint_lock:
                    self._store.checkpoint()
            except Exception:  # a failed checkpoint is retried; the WAL stays valid
                _LOGGER.exception("WAL checkpoint failed")
            # A pause between passes (each fsyncs twice): the store thread finds the lock free
            # when the WAL reaches its limit, and little to copy then.
            self._stopping.wait(CATCH_UP_INTERVAL_S)

    def _mind_wal(self) -> None:
        """After a commit (and its delivery): keeps the WAL under its limit.

        The WAL file's size is what the WAL holds (``SqliteStore`` truncates it whenever it
        restarts). Beyond half the limit the checkpointer copies continuously; at the limit
        this thread copies what the checkpointer's last pass left (the frames written since it
        started), so its next commit writes the WAL from the start. The checkpointer's pass in
        flight ends first (no waiting here), unless the WAL holds one and a half times the
        limit already.
        """
        try:
            size = os.stat(self._wal_path).st_size
        except OSError:
            return
        if size < self._wal_limit:
            if 2 * size >= self._wal_limit:
                self._wake_checkpointer.set()
            return
        if not self._checkpoint_lock.acquire(blocking=2 * size >= 3 * self._wal_limit):
            return  # the checkpointer is copying: after the next commit
        try:
            self._store.checkpoint_writer()
        except Exception:  # retried after the next commit; the WAL stays valid
            _LOGGER.exception("WAL checkpoint failed")
        finally:
            self._checkpoint_lock.release()

    # -- the store thread --------------------------------------------------------------------

    def _run(self) -> None:
        store = self._store
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            batch: list[_Op] = [first]  # type: ignore[list-item]
            while len(batch) < _MAX_BATCH:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is _STOP:
                    stop = True
                    break
                batch.append(op)  # type: ignore[arg-type]
            start = time.perf_counter()
            try:
                results = self._run_batch(batch)
            except Exception:
                # One operation failed (or the commit did): undo the batch and redo each
                # operation in its own transaction so the failure reaches its caller alone.
                store.rollback()
                results = [self._run_batch([op])[0] for op in batch]
            if self._on_commit is not None:
                self._on_commit(len(batch), time.perf_counter() - start)
            self._deliver(results)
            if store.is_file:  # after the delivery: watchers get the batch meanwhile
                self._mind_wal()
        self._stopping.set()
        self._wake_checkpointer.set()
        if self._checkpointer.is_alive():
            self._checkpointer.join()
        try:
            store.close()
        except Exception:  # pragma: no cover
            _LOGGER.exception("closing the store failed")

    def _run_batch(self, batch: list[_Op]) -> list[_Result]:
        """Runs a batch in one transaction; raises if any operation fails when batched."""
        store = self._store
        store.begin()
        if len(batch) == 1:
            op = batch[0]
            try:
                result = op.fn(store, *op.args)
                store.commit()
            except Exception as exc:  # delivered to its caller
                store.rollback()
                return [(op.callback, None, exc)]
            return [(op.callback, result, None)]
        results: list[_Result] = []
        appends: list[EpisodeRecord] = []
        for op in batch:
            if op.fn is _APPEND and len(op.args) == 1:
                # One executemany for a run of appends, one counter update per run.
                appends.extend(op.args[0])
                results.append((op.callback, None, None))
                continue
            if appends:
                _APPEND(store, appends)
                appends = []
            results.append((op.callback, op.fn(store, *op.args), None))
        if appends:
            _APPEND(store, appends)
        store.commit()
        return results

    def _deliver(self, results: list[_Result]) -> None:
        callbacks = [r for r in results if r[0] is not None]
        if not callbacks:
            return

        def run_callbacks() -> None:
            for callback, result, error in callbacks:
                assert callback is not None
                try:
                    callback(result, error)
                except Exception:
                    _LOGGER.exception("store callback failed")

        # A closed loop means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(run_callbacks)
