"""Group commit of episodes into the PostgreSQL store, fenced by the runs' owners.

- Episodes are kept as in SQLite: the serialized ``Episode`` (deterministic, so the same
  episode is the same bytes wherever it is written), in ``episodes`` keyed on (run, episode).
- Group commit: ``append_episode`` queues (``GroupCommit.append``); one writer task commits
  whatever is queued in one transaction (one counter ``UPDATE`` for all the runs in it, one
  ``INSERT`` of all the episodes, one ``NOTIFY`` per run), and only then calls each callback.
  Nothing is visible to a reader, on any replica, before its commit.
- Fencing: the counter update runs first, conditional on this replica owning each run
  (``runs.owner``, or no owner at all), and locks the runs' rows, so a replica that took a run
  over (which updates the same row) either waits for this commit or makes it write nothing: the
  stale owner's episodes are not inserted and its callbacks get ``NotOwner``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import psycopg

from gateway.core.store.base import EpisodeRecord, NotOwner, StoreWriteFailed
from gateway.core.store.postgres_db import CHANNEL, PostgresDatabase
from gateway.core.store.postgres_schema import INSERT_CURVE, curve_columns

_LOGGER = logging.getLogger(__name__)

#: Inserts details kept for good (True) or recent ones (False), given as arrays.
_INSERT_DETAILS = {
    True: "INSERT INTO details (run_id, episode, detail, json) SELECT * FROM "
    "unnest(%s::text[], %s::int[], %s::bytea[], %s::bytea[]) ON CONFLICT DO NOTHING",
    False: "INSERT INTO recent_details (run_id, episode, detail, json) SELECT * FROM "
    "unnest(%s::text[], %s::int[], %s::bytea[], %s::bytea[]) ON CONFLICT DO NOTHING",
}

#: The most episodes one group commit takes.
MAX_BATCH = 4096

_Queued = tuple[EpisodeRecord, Callable[[BaseException | None], None]]


class GroupCommit:
    """The episode writer of one replica (see the module docstring).

    Args:
        db: The database it writes to (its writes map failures and turn writability off).
        replica_id: The replica it writes for (owner of the runs it drives).
        on_commit: Called after each group commit with its size and duration (metrics).
    """

    def __init__(
        self,
        db: PostgresDatabase,
        replica_id: str,
        on_commit: Callable[[int, float], None] | None = None,
    ) -> None:
        self._db = db
        self._replica_id = replica_id
        self._on_commit = on_commit
        self._queue: list[_Queued] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        """Starts the writer task."""
        self._writer = asyncio.create_task(self._write_loop(), name="gateway-store-writer")

    def stop(self) -> None:
        """Takes no more episodes; the writer commits what is queued and ends (``join``)."""
        self._closing = True
        self._wake.set()

    async def join(self) -> None:
        """Waits for the writer to end (after ``stop``)."""
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None

    def append(
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
                # Idempotent (the update sets values, the inserts skip rows already there): a
                # commit cut by a server restart is made again once it is back.
                commit = functools.partial(self._commit, batch=batch)
                owned = await self._db.write(commit, idempotent=True)
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

    async def _commit(self, conn: psycopg.AsyncConnection, *, batch: list[_Queued]) -> set[str]:
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
                self._replica_id,
            ),
        )
        owned = {row[0] for row in await cur.fetchall()}
        rows = [record for record, _ in batch if record.run_id in owned]
        if rows:
            await conn.execute(
                "INSERT INTO episodes (run_id, episode, data, json) "
                "SELECT * FROM unnest(%s::text[], %s::int[], %s::bytea[], %s::bytea[]) "
                "ON CONFLICT DO NOTHING",
                (
                    [r.run_id for r in rows],
                    [r.episode for r in rows],
                    [r.scalars for r in rows],
                    [r.numbers_json or None for r in rows],
                ),
            )
            for keep, insert in _INSERT_DETAILS.items():
                details = [r for r in rows if r.detail_at >= 0 and r.keep_detail is keep]
                if not details:
                    continue
                await conn.execute(
                    insert,
                    (
                        [r.run_id for r in details],
                        [r.episode for r in details],
                        [r.detail for r in details],
                        [r.detail_json for r in details],
                    ),
                )
            blocks = [(r.run_id, b) for r in rows for b in r.blocks]
            if blocks:
                await conn.execute(INSERT_CURVE, curve_columns(blocks))
            await conn.execute(
                "SELECT pg_notify(%s, 'e:' || id) FROM unnest(%s::text[]) AS id",
                (CHANNEL, sorted(owned)),
            )
        return owned
