"""The store thread: owns a ``SqliteStore``'s connection and group-commits.

``StoreThread`` owns the connection on a single thread and runs every operation in queue order;
consecutive operations that are already queued run in one transaction (group commit),
consecutive episode appends among them as one statement, and their results are delivered to the
event loop only after that transaction committed. Hence an episode is durable before any
watcher can see it, and a burst of episodes costs one commit, not one per episode. A write that
fails because the database cannot be written is delivered as ``StoreWriteFailed``.

The WAL starts again from its beginning once it holds ``WAL_LIMIT_BYTES`` (32 MiB). A
checkpoint copies the WAL into the database, but the WAL only starts again when a transaction
begins with all of it copied, and a writer that never pauses never leaves a checkpoint on
another connection that moment: with such checkpoints alone the WAL would grow for as long as
ingest lasts, and with it the disk used and the time a restart after a crash spends reading it
back. So:

- Checkpoints (the only step that fsyncs) run on a checkpointer thread with a connection of its
  own (``PASSIVE``: never blocking the writer), once a second, and one after the other while
  the WAL holds more than half its limit, so that they keep up with a steady writer.
- Once the WAL holds its limit, the store thread, between two transactions (after delivering
  the last one), copies what the checkpointer's last pass left: the frames written since that
  pass began. Its next commit then writes the WAL from the start. Mostly a pass ends between
  two transactions and the WAL starts again by itself; this step is the guarantee, and the
  only checkpoint work on the commit path (past one and a half times the limit it also waits
  for the checkpointer's pass in flight).
- A transaction cannot be checkpointed while it is written, so a group commit holds at most a
  quarter of the limit in episode bytes (``_batch_bytes``; one episode more at worst), so no
  single transaction can carry the WAL far past its limit.
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
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.core.store.base import EpisodeRecord
from gateway.core.store.sqlite import SqliteStore, write_failure

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

#: The store thread brings the WAL back to its start once it holds this much.
WAL_LIMIT_BYTES = 32 * 2**20


class _Op:
    __slots__ = ("args", "callback", "fn")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], callback: Callable[..., None] | None
    ) -> None:
        self.fn = fn
        self.args = args
        self.callback = callback


_Result = tuple[Callable[..., None] | None, Any, BaseException | None]


def _episode_bytes(op: _Op) -> int:
    """The episode bytes an operation appends (0 for any other operation)."""
    if op.fn is _APPEND:
        return sum(len(record.data) for record in op.args[0])
    return 0


def _as_write_failure(result: _Result) -> _Result:
    callback, value, error = result
    if error is not None:
        failed = write_failure(error)
        if failed is not None:
            return callback, value, failed
    return result


_STOP = object()
#: Seconds between checkpoints while the WAL holds less than half its limit ...
CHECKPOINT_INTERVAL_S = 1.0
#: ... and while it holds more (then the store thread asks for them after each commit).
CATCH_UP_INTERVAL_S = 0.1
_MAX_BATCH = 2048
#: The least episode bytes a group commit may hold (a quarter of the WAL limit above that).
_MIN_BATCH_BYTES = 64 * 1024
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
        self._batch_bytes = max(_MIN_BATCH_BYTES, wal_limit_bytes // 4)
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
            size = _episode_bytes(first)  # type: ignore[arg-type]
            while len(batch) < _MAX_BATCH and size < self._batch_bytes:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is _STOP:
                    stop = True
                    break
                batch.append(op)  # type: ignore[arg-type]
                size += _episode_bytes(op)  # type: ignore[arg-type]
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
            self._deliver([_as_write_failure(r) for r in results])
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
