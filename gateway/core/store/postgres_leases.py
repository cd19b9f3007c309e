"""The queries that coordinate gateway replicas on one PostgreSQL database.

Every time comes from the database's clock (``now()``), so replicas need no synchronised
clocks. Each query is one short transaction; a claim or a takeover changes one row per
statement, so it never deadlocks with a group commit.

Notifications (``NOTIFY trainwire``, payload ``KIND:RUN_ID``, sent in the transaction that
made the change, so a listener that wakes finds it committed):

| kind | sent when |
| --- | --- |
| ``c`` | a run was created (PENDING, no owner) |
| ``k`` | a replica claimed a run (to start it, or to take it over) |
| ``p`` | a PENDING run has no owner again (released after SLOTS_BUSY, or its claim expired) |
| ``l`` | an active run was released by a replica that stops: take it over now |
| ``r`` | a run's state, speed, trainer or checkpoints changed |
| ``e`` | episodes of a run were committed |
| ``x`` | a control was requested for a run (its owner applies it) |
| ``a`` | the owner applied the controls requested so far |
| ``d`` | a run was deleted |
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import psycopg

from gateway.core.runs import RunState, TrainingRun
from gateway.core.store.postgres import CHANNEL, PostgresStore
from gateway.core.store.sqlite import _RUN_COLUMNS, _run_from_row

_LEASE = "now() + %(lease)s * interval '1 second'"
_FREE = "(owner IS NULL OR lease_until < now())"


@dataclass(frozen=True, slots=True)
class Control:
    """The controls requested for a run and not yet applied (see ``Leases.request``).

    Attributes:
        state: The desired state (RUNNING: resume, PAUSED, STOPPED), or None.
        speed: The desired speed, or None.
        seq: The number of the last request.
        applied: The number of the last request the owner applied.
        error: Why the owner could not apply the last one ("" when it could).
    """

    state: RunState | None
    speed: float | None
    seq: int
    applied: int
    error: str


@dataclass(frozen=True, slots=True)
class Requested:
    """What ``Leases.request`` found: the request's number, the run's state and whether an
    owner holds a live lease on it."""

    seq: int
    state: RunState
    owned: bool


class Leases:
    """Claims, leases and controls of one replica (``store.replica_id``).

    Args:
        store: The started store (its pool and replica id).
        lease_s: How long a claim or a renewal holds, in seconds.
    """

    def __init__(self, store: PostgresStore, lease_s: float) -> None:
        self._store = store
        self.me = store.replica_id
        self.lease_s = lease_s

    def _args(self, **more: object) -> dict[str, object]:
        return {"me": self.me, "lease": self.lease_s, **more}

    async def _claim(self, where: str, run_id: str) -> TrainingRun | None:
        async def go(conn: psycopg.AsyncConnection) -> TrainingRun | None:
            cur = await conn.execute(
                f"UPDATE runs SET owner = %(me)s, lease_until = {_LEASE} "  # type: ignore[arg-type]
                f"WHERE id = %(id)s AND {where} RETURNING {_RUN_COLUMNS}",
                self._args(id=run_id),
            )
            row = await cur.fetchone()
            if row is None:
                return None
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"k:{run_id}"))
            return _run_from_row(row)

        return await self._store.write(go)

    async def claim_pending(self, run_id: str) -> TrainingRun | None:
        """Claims a PENDING run that no live lease holds (to start it); returns it as stored,
        or None when another replica holds it or it is no longer PENDING."""
        return await self._claim(f"state = 1 AND ({_FREE} OR owner = %(me)s)", run_id)

    async def take_over(self, run_id: str) -> TrainingRun | None:
        """Claims a RUNNING or PAUSED run whose lease expired (or was released); returns it
        as stored, or None when another replica got it first."""
        return await self._claim(f"state IN (2, 3) AND {_FREE}", run_id)

    async def orphans(self, limit: int = 50) -> list[str]:
        """RUNNING or PAUSED runs that no live lease holds, oldest first."""

        async def go(conn: psycopg.AsyncConnection) -> list[str]:
            cur = await conn.execute(
                f"SELECT id FROM runs WHERE state IN (2, 3) AND {_FREE} "  # type: ignore[arg-type]
                "ORDER BY seq LIMIT %s",
                (limit,),
            )
            return [row[0] for row in await cur.fetchall()]

        return await self._store.read(go)

    async def unclaimed_pending(self) -> list[TrainingRun]:
        """PENDING runs that no live lease holds, oldest first (each replica's queue). Claims
        that expired are cleared first (their replica died before the run started)."""

        async def go(conn: psycopg.AsyncConnection) -> list[TrainingRun]:
            cur = await conn.execute(
                "UPDATE runs SET owner = NULL, lease_until = NULL "
                "WHERE state = 1 AND owner IS NOT NULL AND lease_until < now() RETURNING id"
            )
            for (run_id,) in await cur.fetchall():
                await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"p:{run_id}"))
            cur = await conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE state = 1 AND owner IS NULL "  # type: ignore[arg-type]
                "ORDER BY seq"
            )
            return [_run_from_row(row) for row in await cur.fetchall()]

        return await self._store.write(go)

    async def renew(self, run_ids: list[str]) -> set[str]:
        """Extends this replica's leases on ``run_ids``; returns those it still holds."""
        if not run_ids:
            return set()

        async def go(conn: psycopg.AsyncConnection) -> set[str]:
            cur = await conn.execute(
                f"UPDATE runs SET lease_until = {_LEASE} "  # type: ignore[arg-type]
                "WHERE owner = %(me)s AND id = ANY(%(ids)s) RETURNING id",
                self._args(ids=sorted(run_ids)),
            )
            return {row[0] for row in await cur.fetchall()}

        return await self._store.write(go)

    async def release(self, run_ids: list[str]) -> None:
        """Gives this replica's leases on ``run_ids`` up (``p`` for PENDING runs, ``l`` for
        active ones: another replica takes those over at once)."""
        if not run_ids:
            return

        async def go(conn: psycopg.AsyncConnection) -> None:
            cur = await conn.execute(
                "UPDATE runs SET owner = NULL, lease_until = NULL "
                "WHERE owner = %(me)s AND id = ANY(%(ids)s) RETURNING id, state",
                self._args(ids=sorted(run_ids)),
            )
            for run_id, state in await cur.fetchall():
                if RunState(state).active:
                    kind = "p" if state == RunState.PENDING else "l"
                    await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{kind}:{run_id}"))

        await self._store.write(go)

    async def owner(self, run_id: str) -> tuple[str | None, bool]:
        """The run's owner and whether its lease is live."""

        async def go(conn: psycopg.AsyncConnection) -> tuple[str | None, bool]:
            cur = await conn.execute(
                "SELECT owner, coalesce(lease_until > now(), false) FROM runs WHERE id = %s",
                (run_id,),
            )
            row = await cur.fetchone()
            return (None, False) if row is None else (row[0], bool(row[1]))

        return await self._store.read(go)

    # -- controls ----------------------------------------------------------------------------

    async def request(
        self, run_id: str, state: RunState | None, speed: float | None
    ) -> Requested | None:
        """Records a control for the run's owner (``x``); None when the run is not active."""

        async def go(conn: psycopg.AsyncConnection) -> Requested | None:
            cur = await conn.execute(
                "UPDATE runs SET desired_state = coalesce(%s, desired_state), "
                "desired_speed = coalesce(%s, desired_speed), control_seq = control_seq + 1 "
                "WHERE id = %s AND state IN (1, 2, 3) "
                "RETURNING control_seq, state, coalesce(lease_until > now(), false)",
                (None if state is None else int(state), speed, run_id),
            )
            row = await cur.fetchone()
            if row is None:
                return None
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"x:{run_id}"))
            return Requested(int(row[0]), RunState(row[1]), bool(row[2]))

        return await self._store.write(go)

    async def control(self, run_id: str) -> Control | None:
        """The run's controls (None: no such run)."""

        async def go(conn: psycopg.AsyncConnection) -> Control | None:
            cur = await conn.execute(
                "SELECT desired_state, desired_speed, control_seq, applied_seq, control_error "
                "FROM runs WHERE id = %s",
                (run_id,),
            )
            row = await cur.fetchone()
            if row is None:
                return None
            state = None if row[0] is None else RunState(row[0])
            return Control(state, row[1], int(row[2]), int(row[3]), row[4])

        return await self._store.read(go)

    async def applied(self, run_id: str, seq: int, error: str) -> None:
        """Records that the owner applied the controls up to ``seq`` (``a``); the desired
        values are cleared unless a later request came meanwhile."""

        async def go(conn: psycopg.AsyncConnection) -> None:
            await conn.execute(
                "UPDATE runs SET applied_seq = greatest(applied_seq, %(seq)s), "
                "control_error = %(error)s, "
                "desired_state = CASE WHEN control_seq = %(seq)s THEN NULL "
                "ELSE desired_state END, "
                "desired_speed = CASE WHEN control_seq = %(seq)s THEN NULL "
                "ELSE desired_speed END WHERE id = %(id)s",
                {"seq": seq, "error": error, "id": run_id},
            )
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"a:{run_id}"))

        await self._store.write(go)


async def notifications(url: str) -> AsyncIterator[tuple[str, str]]:
    """``(kind, run_id)`` of every notification on ``CHANNEL``, from a connection of its own,
    until it breaks (the caller reconnects and re-checks what it may have missed)."""
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
    try:
        await conn.execute(f"LISTEN {CHANNEL}")
        yield "", ""  # listening: what happens from here on is heard
        async for note in conn.notifies():
            kind, _, run_id = note.payload.partition(":")
            yield kind, run_id
    finally:
        await conn.close()
