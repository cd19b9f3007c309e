"""``update_run`` writes a run's task (its live hyperparameters change) and the search column
read from it, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gateway.core.store import Store, open_store
from tests.store.test_store_contract import make_run
from trainwire.v1 import episode_pb2


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "db.sqlite3")
    return str(request.getfixturevalue("postgres_url"))


def learning_rate_column(db: str, run_id: str) -> float:
    """The ``learning_rate`` search column, read straight from the database."""
    if db.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db) as conn:
            row = conn.execute("SELECT learning_rate FROM runs WHERE id=%s", (run_id,)).fetchone()
    else:
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT learning_rate FROM runs WHERE id=?", (run_id,)).fetchone()
    assert row is not None
    return float(row[0])


async def test_update_writes_the_task_and_its_learning_rate_column(db: str) -> None:
    store: Store = open_store(db)
    await store.start()
    try:
        run = make_run("a")
        run.task.imitation.learning_rate = 0.03
        await store.insert_run(run)
        assert learning_rate_column(db, "a") == 0.03

        changed = episode_pb2.TrainTask()
        changed.CopyFrom(run.task)
        changed.imitation.learning_rate = 0.005
        snapshot = run.snapshot()
        snapshot.task = changed
        snapshot.start("t:1", 5)
        await store.update_run(snapshot)

        loaded = await store.get_run("a")
        assert loaded is not None
        assert loaded.task == changed and loaded.task.imitation.clip_name == "walk"
        assert learning_rate_column(db, "a") == 0.005
    finally:
        await store.close()
