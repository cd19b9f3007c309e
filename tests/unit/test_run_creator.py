"""``Run.creator``: stored with the run, read back, and added to databases from before it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gateway.convert import run_to_proto
from gateway.core.runs import TrainingRun
from gateway.core.store import SqliteStore
from trainwire.v1 import episode_pb2

_OLD_SCHEMA = """
CREATE TABLE runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, request_id TEXT UNIQUE,
    state INTEGER NOT NULL, error_message TEXT NOT NULL, speed REAL NOT NULL,
    episodes_per_second REAL NOT NULL, episode INTEGER NOT NULL, reward REAL NOT NULL,
    best_reward REAL NOT NULL, task BLOB NOT NULL, config BLOB NOT NULL,
    create_time INTEGER NOT NULL, start_time INTEGER NOT NULL, end_time INTEGER NOT NULL,
    display_name TEXT NOT NULL, trainer TEXT NOT NULL,
    trainer_episode INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE episodes (
    run_id TEXT NOT NULL, episode INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
);
"""


def _run(run_id: str, creator: str = "") -> TrainingRun:
    return TrainingRun(
        id=run_id,
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="walk")
        ),
        config=episode_pb2.TrainConfig(max_episodes=5),
        creator=creator,
    )


def test_creator_roundtrips_through_the_store_and_the_proto(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "db.sqlite3"))
    store.insert_run(_run("r1", creator="alice"))
    run = store.get_run("r1")
    assert run is not None and run.creator == "alice"
    assert run_to_proto(run).creator == "alice"
    store.close()


def test_a_database_from_before_creator_gets_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(_OLD_SCHEMA)
    conn.execute(
        "INSERT INTO runs VALUES (NULL,'old',NULL,1,'',1,1,0,0,0,?,?,0,0,0,'','',0)",
        (_run("x").task.SerializeToString(), _run("x").config.SerializeToString()),
    )
    conn.commit()
    conn.close()
    store = SqliteStore(str(path), migrate=True)
    old = store.get_run("old")
    assert old is not None and old.creator == ""
    store.insert_run(_run("new", creator="bob"))
    new = store.get_run("new")
    assert new is not None and new.creator == "bob"
    store.close()
