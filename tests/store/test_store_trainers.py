"""``Run.trainers`` in the store, on every backend: written with the trainer, read back in
order (rank 0's first) by every read of runs, and filled in from ``trainer`` by the migration
from version 5 (SQLite and PostgreSQL)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest

from gateway.core.runs import RunState
from gateway.core.search import RunQuery
from gateway.core.store import PostgresStore, SchemaOutdated, Store
from gateway.core.store.postgres_schema import SCHEMA_VERSION as PG_SCHEMA_VERSION
from gateway.core.store.sqlite import SqliteStore
from gateway.core.store.sqlite_schema import SCHEMA_VERSION
from tests.store.test_postgres_store import make_old, version_of
from tests.store.test_store_contract import make_run


async def test_a_runs_trainers_are_stored_with_its_trainer_and_read_back_in_order(
    store: Store,
) -> None:
    spanning, alone, waiting = make_run("s"), make_run("a", request_id="req-a"), make_run("w")
    for run in (spanning, alone, waiting):
        await store.insert_run(run)
    spanning.start("b:1", 10, ("b:1", "a:1", "c:1"))
    alone.start("a:1", 11)
    await store.update_run(spanning)
    await store.update_run(alone)

    got = await store.get_run("s")
    assert got is not None and (got.trainer, got.trainers) == ("b:1", ("b:1", "a:1", "c:1"))
    found = await store.find_request("req-a")
    assert found is not None and found.trainers == ("a:1",)
    page = await store.list_runs(RunQuery(limit=10))
    assert {r.id: r.trainers for r in page.runs} == {
        "s": ("b:1", "a:1", "c:1"),
        "a": ("a:1",),
        "w": (),
    }
    assert {r.id: r.trainers for r in await store.active_runs()}["s"] == ("b:1", "a:1", "c:1")

    # Placed again elsewhere: the new trainers replace the old ones.
    spanning.trainer, spanning.trainers = "c:1", ("c:1", "d:1")
    await store.update_run(spanning)
    again = await store.get_run("s")
    assert again is not None and (again.trainer, again.trainers) == ("c:1", ("c:1", "d:1"))


def _v5_database(path: Path) -> None:
    """A database as version 5 wrote it: no ``trainers``; a finished run that trained on
    ``t:1`` and a PENDING one."""
    store = SqliteStore(str(path))
    done, waiting = make_run("old", request_id="req-old"), make_run("new")
    done.start("t:1", 1)
    done.complete(2)
    for run in (done, waiting):
        store.insert_run(run)
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE runs DROP COLUMN trainers")
    conn.execute("PRAGMA user_version=5")
    conn.commit()
    conn.close()


def test_a_sqlite_database_at_version_5_gets_each_runs_trainers(tmp_path: Path) -> None:
    path = tmp_path / "v5.sqlite3"
    _v5_database(path)
    with pytest.raises(
        SchemaOutdated, match=f"schema is version 5, this gateway's is {SCHEMA_VERSION}"
    ):
        SqliteStore(str(path))
    store = SqliteStore(str(path), migrate=True)
    try:
        assert store.found_version == 5
        old, new = store.get_run("old"), store.get_run("new")
        assert old is not None and old.state is RunState.DONE
        assert (old.trainer, old.trainers) == ("t:1", ("t:1",))
        assert new is not None and (new.trainer, new.trainers) == ("", ())
    finally:
        store.close()


async def test_a_postgresql_database_at_version_5_gets_each_runs_trainers(
    postgres_url: str,
) -> None:
    await make_old(postgres_url, version=5)  # one finished run that trained on "t"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO runs (id, state, error_message, speed, episodes_per_second, episode, "
            "reward, best_reward, task, config, create_time, start_time, end_time, "
            "display_name, trainer) SELECT 'pending', 1, '', 1, 20, 0, 0, 0, task, config, 5, "
            "0, 0, '', '' FROM runs WHERE id = 'old'"
        )
    with pytest.raises(
        SchemaOutdated, match=f"schema is version 5, this gateway's is {SCHEMA_VERSION}"
    ):
        await PostgresStore(postgres_url, "a").start()
    store = PostgresStore(postgres_url, "a", migrate=True)
    await store.start()
    try:
        assert await version_of(postgres_url) == PG_SCHEMA_VERSION
        old, pending = await store.get_run("old"), await store.get_run("pending")
        assert old is not None and (old.trainer, old.trainers) == ("t", ("t",))
        assert pending is not None and (pending.trainer, pending.trainers) == ("", ())
    finally:
        await store.close()
