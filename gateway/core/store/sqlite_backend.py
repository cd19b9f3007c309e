"""The SQLite ``Store``: a ``StoreThread`` over a ``SqliteStore``, and the store's writability.

A write that fails because the database cannot be written (disk full, read-only) turns
``writable`` off; the backend then probes every ``PROBE_INTERVAL_S`` with a write of a few
hundred KiB and turns it back on once one succeeds. Other writes are still tried meanwhile (a
run's final state may fit), but only the probe turns ``writable`` back on: a small write can
fit in pages the database already has while it cannot grow. Reads go on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from gateway.core.curve import CurveBlock
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from gateway.core.store.base import (
    CheckpointRecord,
    DuplicateRequest,
    EpisodeRecord,
    StoreWriteFailed,
    Writability,
    WritableStore,
    check_keep,
)
from gateway.core.store.sqlite import SqliteStore
from gateway.core.store.sqlite_thread import StoreThread

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two write probes while the store cannot be written.
PROBE_INTERVAL_S = 2.0


class SqliteBackend(WritableStore):
    """The embedded default store (see the module docstring).

    Args:
        path: Database file, or ``:memory:``.
        migrate: Migrate a database of an older schema (otherwise it is refused).
        on_commit: Called on the store thread after each commit with the batch size and its
            duration (metrics).
        wal_limit_bytes: The WAL limit of the store thread (``WAL_LIMIT_BYTES`` by default).

    Raises:
        DatabaseProblem: the database cannot be used (see ``gateway.core.store.base``).
    """

    def __init__(
        self,
        path: str,
        *,
        migrate: bool = False,
        on_commit: Callable[[int, float], None] | None = None,
        wal_limit_bytes: int | None = None,
    ) -> None:
        self.path = path
        self.db = SqliteStore(path, migrate)
        self._on_commit = on_commit
        self._wal_limit_bytes = wal_limit_bytes
        self._thread: StoreThread | None = None
        self._writability = Writability(path, self._probe_write, PROBE_INTERVAL_S)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the store thread."""
        self._thread = StoreThread(
            self.db,
            asyncio.get_running_loop(),
            self._on_commit,
            wal_limit_bytes=self._wal_limit_bytes,
        )
        self._thread.start()

    async def close(self) -> None:
        """Commits what is queued, stops the thread, closes the database."""
        await self._writability.close()
        if self._thread is not None:
            await self._thread.close()

    # -- writability -------------------------------------------------------------------------

    async def _probe_write(self) -> bool:
        try:
            await self._call(SqliteStore.probe_write)
        except StoreWriteFailed:
            return False
        return True

    # -- operations --------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._thread is not None, "the store is not started"
        return await self._thread.call(fn, *args)

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await self._call(fn, *args)
        except StoreWriteFailed as exc:
            self._writability.set(False, str(exc))
            raise

    async def insert_run(self, run: TrainingRun) -> int:
        """Inserts a new run; returns its creation sequence number.

        Raises:
            DuplicateRequest: another run has its ``request_id``.
        """
        try:
            return await self._write(SqliteStore.insert_run, run)
        except sqlite3.IntegrityError as exc:
            if run.request_id and "request_id" in str(exc):
                raise DuplicateRequest(run.request_id) from None
            raise

    async def update_run(self, run: TrainingRun) -> None:
        """Writes a run's state, speed, times, trainer, trainer episode, restarts and parked."""
        await self._write(SqliteStore.update_run, run)

    async def delete_run(self, run_id: str) -> None:
        """Deletes a run, its history and its checkpoint records."""
        await self._write(SqliteStore.delete_run, run_id)

    async def add_checkpoint(self, record: CheckpointRecord, keep: int) -> list[int]:
        """Records a checkpoint and applies retention in one transaction; returns the
        episodes whose records were not kept (see ``Store.add_checkpoint``).

        Raises:
            ValueError: ``keep`` is below 1.
            StoreWriteFailed: the database cannot be written.
        """
        check_keep(keep)
        return await self._write(SqliteStore.add_checkpoint, record, keep)

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """The run's checkpoint records, oldest first."""
        return await self._call(SqliteStore.list_checkpoints, run_id)

    async def delete_checkpoints(self, run_id: str, episodes: Sequence[int]) -> None:
        """Deletes checkpoint records and moves the run's ``checkpoint_episode``.

        Raises:
            StoreWriteFailed: the database cannot be written.
        """
        await self._write(SqliteStore.delete_checkpoints, run_id, tuple(episodes))

    async def update_metadata(
        self, run_id: str, display_name: str, labels: Mapping[str, str]
    ) -> bool:
        """Sets a run's display name and labels; False when there is no such run.

        Raises:
            StoreWriteFailed: the database cannot be written.
        """
        return await self._write(SqliteStore.update_metadata, run_id, display_name, dict(labels))

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        """Queues an episode; ``callback(error)`` runs on the loop once it is committed."""
        assert self._thread is not None, "the store is not started"

        def committed(_result: object, error: BaseException | None) -> None:
            if isinstance(error, StoreWriteFailed):
                self._writability.set(False, str(error))
            callback(error)

        self._thread.submit(SqliteStore.append_episodes, (record,), callback=committed)

    async def get_run(self, run_id: str) -> TrainingRun | None:
        """The run with this id, or None."""
        return await self._call(SqliteStore.get_run, run_id)

    async def find_request(self, request_id: str) -> TrainingRun | None:
        """The run created with this request id, or None."""
        return await self._call(SqliteStore.find_request, request_id)

    async def list_runs(self, query: RunQuery) -> RunPage:
        """A page of the runs a search finds, in its order (see ``Store.list_runs``)."""
        return await self._call(SqliteStore.list_runs, query)

    async def read_episodes(
        self, run_id: str, first: int, last: int, scalars: bool = False, json: bool = False
    ) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order, or their JSON
        (see ``Store.read_episodes``)."""
        return await self._call(SqliteStore.read_episodes, run_id, first, last, scalars, json)

    async def read_curve_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        """The stored curve blocks of ``(level, first_index, last_index)`` spans."""
        return await self._call(SqliteStore.read_curve_blocks, run_id, tuple(spans))

    async def settle_details(self, run_id: str, first: int, last: int, keep: Sequence[int]) -> int:
        """Keeps or drops the recent details of a range (see ``Store.settle_details``).

        Raises:
            StoreWriteFailed: the database cannot be written.
        """
        return await self._write(SqliteStore.settle_details, run_id, first, last, tuple(keep))

    async def count_by_state(self) -> dict[RunState, int]:
        """How many runs are in each state."""
        return await self._call(SqliteStore.count_by_state)

    async def active_runs(self) -> list[TrainingRun]:
        """Every PENDING, RUNNING or PAUSED run, oldest first."""
        return await self._call(SqliteStore.active_runs)
