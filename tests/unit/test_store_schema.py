"""The SQLite schema: versions, recognising a database, refusing what is not ours, migrating."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from gateway.core.episode_json import episode_json
from gateway.core.runs import TrainingRun
from gateway.core.store import (
    CheckpointRecord,
    DatabaseProblem,
    EpisodeRecord,
    SchemaOutdated,
    SqliteStore,
)
from gateway.core.store.sqlite_schema import APPLICATION_ID, SCHEMA_VERSION
from tests.fakes.episodes import valid_episodes
from trainwire.v1 import episode_pb2

#: The first release's schema, as it wrote it (no application id, no user_version).
V1_SCHEMA = """
CREATE TABLE runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, request_id TEXT UNIQUE,
    state INTEGER NOT NULL, error_message TEXT NOT NULL, speed REAL NOT NULL,
    episodes_per_second REAL NOT NULL, episode INTEGER NOT NULL, reward REAL NOT NULL,
    best_reward REAL NOT NULL, task BLOB NOT NULL, config BLOB NOT NULL,
    create_time INTEGER NOT NULL, start_time INTEGER NOT NULL, end_time INTEGER NOT NULL,
    display_name TEXT NOT NULL, trainer TEXT NOT NULL
);
CREATE INDEX runs_state ON runs (state, seq);
CREATE TABLE episodes (
    run_id TEXT NOT NULL, episode INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
);
"""


#: The second release's schema (version 2, before checkpoints), as it wrote it.
V2_SCHEMA = f"""
PRAGMA application_id={APPLICATION_ID};
PRAGMA user_version=2;
CREATE TABLE runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, request_id TEXT UNIQUE,
    state INTEGER NOT NULL, error_message TEXT NOT NULL, speed REAL NOT NULL,
    episodes_per_second REAL NOT NULL, episode INTEGER NOT NULL, reward REAL NOT NULL,
    best_reward REAL NOT NULL, task BLOB NOT NULL, config BLOB NOT NULL,
    create_time INTEGER NOT NULL, start_time INTEGER NOT NULL, end_time INTEGER NOT NULL,
    display_name TEXT NOT NULL, trainer TEXT NOT NULL,
    trainer_episode INTEGER NOT NULL DEFAULT 0, creator TEXT NOT NULL DEFAULT '',
    request_hash TEXT NOT NULL DEFAULT ''
);
CREATE INDEX runs_state ON runs (state, seq);
CREATE TABLE episodes (
    run_id TEXT NOT NULL, episode INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (run_id, episode)
) WITHOUT ROWID;
CREATE TABLE gateway_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def v2_database(path: Path, episodes: int = 3) -> None:
    """A database as the second release left it: a finished run and a paused one, with their
    histories."""
    task = episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
    ).SerializeToString()
    config = episode_pb2.TrainConfig(max_episodes=10).SerializeToString()
    conn = sqlite3.connect(path)
    conn.executescript(V2_SCHEMA)
    conn.executemany(
        "INSERT INTO runs VALUES (NULL,?,?,?,'',1,20,?,0.5,0.9,?,?,1,2,3,?,'t',?,'alice','h')",
        [
            ("done", "req-1", 4, episodes, task, config, "done run", episodes),
            ("paused", None, 3, episodes, task, config, "paused run", episodes + 1),
        ],
    )
    conn.executemany(
        "INSERT INTO episodes VALUES (?, ?, ?)",
        [
            (run_id, n, f"{run_id} {n}".encode())
            for run_id in ("done", "paused")
            for n in range(1, episodes + 1)
        ],
    )
    conn.commit()
    conn.close()


def v1_database(path: Path, episodes: int = 3) -> None:
    """A database as the first release left it: one finished run with its history."""
    task = episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
    )
    config = episode_pb2.TrainConfig(max_episodes=episodes)
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.execute(
        "INSERT INTO runs VALUES (NULL,'old','req-1',4,'',1,20,?,0.5,0.9,?,?,1,2,3,'old run','t')",
        (episodes, task.SerializeToString(), config.SerializeToString()),
    )
    conn.executemany(
        "INSERT INTO episodes VALUES ('old', ?, ?)",
        [(n, f"episode {n}".encode()) for n in range(1, episodes + 1)],
    )
    conn.commit()
    conn.close()


def pragma(path: Path, name: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute(f"PRAGMA {name}").fetchone()[0])
    finally:
        conn.close()


def test_a_new_database_is_marked_and_at_the_latest_version(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    store = SqliteStore(str(path))
    assert store.found_version == 0
    store.close()
    assert pragma(path, "application_id") == APPLICATION_ID
    assert pragma(path, "user_version") == SCHEMA_VERSION
    SqliteStore(str(path)).close()  # opens again without a migration


def test_an_older_database_is_refused_until_migrated_and_keeps_everything(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v1.sqlite3"
    v1_database(path)
    before = path.read_bytes()
    with pytest.raises(SchemaOutdated) as info:
        SqliteStore(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert f"schema is version 1, this gateway's is {SCHEMA_VERSION}" in message
    assert f"python -m gateway migrate --db {path}" in message
    assert path.read_bytes() == before  # refused without a change
    store = SqliteStore(str(path), migrate=True)
    assert store.found_version == 1
    old = store.get_run("old")
    assert old is not None and old.display_name == "old run" and old.request_id == "req-1"
    assert (old.trainer_episode, old.creator, old.request_hash) == (0, "", "")
    assert (old.checkpoint_episode, old.restarts, old.parked) == (0, 0, False)
    assert store.list_checkpoints("old") == []
    assert store.read_episodes("old", 1, 3) == [b"episode 1", b"episode 2", b"episode 3"]
    store.begin()
    store.append_episodes([EpisodeRecord("old", 4, 0.1, 0.9, b"episode 4")])
    store.commit()
    store.close()
    conn = sqlite3.connect(path)
    ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name='episodes'").fetchone()[0]
    conn.close()
    assert "WITHOUT ROWID" in ddl


def test_a_database_before_checkpoints_is_refused_until_migrated_and_keeps_everything(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v2.sqlite3"
    v2_database(path)
    before = path.read_bytes()
    with pytest.raises(SchemaOutdated) as info:
        SqliteStore(str(path))
    assert f"schema is version 2, this gateway's is {SCHEMA_VERSION}" in str(info.value)
    assert path.read_bytes() == before  # refused without a change
    store = SqliteStore(str(path), migrate=True)
    assert store.found_version == 2
    done, paused = store.get_run("done"), store.get_run("paused")
    assert done is not None and paused is not None
    assert (done.state, done.request_id, done.creator, done.episode) == (4, "req-1", "alice", 3)
    assert (paused.state, paused.trainer_episode) == (3, 4)
    assert [r.id for r in store.active_runs()] == ["paused"]
    for run in (done, paused):
        assert (run.checkpoint_episode, run.restarts, run.parked) == (0, 0, False)
        assert store.read_episodes(run.id, 1, 3) == [f"{run.id} {n}".encode() for n in (1, 2, 3)]
    store.begin()
    assert store.add_checkpoint(CheckpointRecord("paused", 3, 7, 100, "ab" * 32), 2) == []
    paused.parked = True
    paused.restarts = 1
    store.update_run(paused)
    store.commit()
    store.close()
    assert pragma(path, "user_version") == SCHEMA_VERSION
    again = SqliteStore(str(path))  # at the latest version: opens without a migration
    reopened = again.get_run("paused")
    assert reopened is not None
    assert (reopened.checkpoint_episode, reopened.restarts, reopened.parked) == (3, 1, True)
    assert again.list_checkpoints("paused") == [CheckpointRecord("paused", 3, 7, 100, "ab" * 32)]
    again.close()


def test_a_failed_migration_leaves_the_database_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "v2.sqlite3"
    v2_database(path)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE checkpoints (x)")  # in the way of the migration
    conn.commit()
    conn.close()
    with pytest.raises(DatabaseProblem, match="checkpoints already exists"):
        SqliteStore(str(path), migrate=True)
    assert pragma(path, "user_version") == 2
    conn = sqlite3.connect(path)
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        assert "checkpoint_episode" not in columns and "restarts" not in columns
        assert conn.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 6
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.mkdir(), "it is a directory"),
        (
            lambda p: p.write_bytes(b"not a database at all " * 100),
            "it is not a SQLite database (corrupt, or another kind of file)",
        ),
        (
            lambda p: sqlite3.connect(p).executescript("CREATE TABLE invoices (id INTEGER);"),
            "it is not a Trainwire database (its tables: invoices)",
        ),
        (
            lambda p: sqlite3.connect(p).executescript(
                "PRAGMA application_id=1234; CREATE TABLE t (x);"
            ),
            "it belongs to another program (application id 0x000004d2)",
        ),
        (
            lambda p: sqlite3.connect(p).executescript(
                f"PRAGMA application_id={APPLICATION_ID}; PRAGMA user_version=99; "
                "CREATE TABLE runs (x);"
            ),
            f"it was written by a newer gateway (schema version 99; this one knows up to "
            f"{SCHEMA_VERSION})",
        ),
    ],
    ids=["directory", "corrupt", "foreign", "other-program", "newer"],
)
def test_databases_that_cannot_be_used_are_one_line_naming_the_problem(
    tmp_path: Path, make, problem: str
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "db.sqlite3"
    make(path)
    with pytest.raises(DatabaseProblem) as info:
        SqliteStore(str(path))
    assert str(info.value) == f"cannot use the database {path}: {problem}"


def test_a_path_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatabaseProblem) as info:
        SqliteStore(str(tmp_path / "file" / "db.sqlite3"))
    assert "its directory cannot be created" in str(info.value)


def make_read_only(path: Path) -> None:
    """Read-only for this user: immutable for root (chattr), or no write permission."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o444)


def undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=False)
    path.chmod(0o644)


def test_a_read_only_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ro.sqlite3"
    SqliteStore(str(path)).close()
    make_read_only(path)
    try:
        with pytest.raises(DatabaseProblem) as info:
            SqliteStore(str(path))
        assert str(info.value).startswith(f"cannot use the database {path}: ")
        assert "read" in str(info.value)  # "read-only" or "cannot read and write it"
    finally:
        undo_read_only(path)


def test_runs_keep_their_request_fingerprint(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "db.sqlite3"))
    run = TrainingRun(
        id="r1",
        task=episode_pb2.TrainTask(),
        config=episode_pb2.TrainConfig(max_episodes=1),
        request_id="k",
        request_hash="abc123",
    )
    store.insert_run(run)
    found = store.find_request("k")
    assert found is not None and found.request_hash == "abc123"
    store.close()


def v3_database(path: Path, episodes: list[episode_pb2.Episode]) -> None:
    """A database as version 3 wrote it: whole episodes (detail included) in ``episodes``, no
    details tables, no curve."""
    store = SqliteStore(str(path))
    store.insert_run(
        TrainingRun(
            id="long",
            task=episode_pb2.TrainTask(),
            config=episode_pb2.TrainConfig(max_episodes=len(episodes)),
        )
    )
    store.close()
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE details; DROP TABLE recent_details; DROP TABLE curve; PRAGMA user_version=3;"
    )
    for column in ("labels", "fork_run_id", "fork_episode", "kind", "clip", "model"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("ALTER TABLE runs DROP COLUMN learning_rate")
    conn.execute("ALTER TABLE runs DROP COLUMN seed")
    conn.executemany(
        "INSERT INTO episodes (run_id, episode, data) VALUES ('long', ?, ?)",
        [(e.episode, e.SerializeToString(deterministic=True)) for e in episodes],
    )
    conn.execute("UPDATE runs SET episode=?, state=4 WHERE id='long'", (len(episodes),))
    conn.commit()
    conn.close()


def test_a_database_before_long_runs_splits_its_details_and_gets_its_curve(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v3.sqlite3"
    episodes = list(valid_episodes(70, detail_every=7))
    v3_database(path, episodes)
    with pytest.raises(SchemaOutdated, match="schema is version 3"):
        SqliteStore(str(path))
    store = SqliteStore(str(path), migrate=True)
    assert store.found_version == 3
    whole = [e.SerializeToString(deterministic=True) for e in episodes]
    assert store.read_episodes("long", 1, 70) == whole  # byte for byte
    scalars = [episode_pb2.Episode.FromString(d) for d in store.read_episodes("long", 1, 70, True)]
    assert not any(e.HasField("imitation") for e in scalars)
    assert [e.reward for e in scalars] == [e.reward for e in episodes]
    blocks = store.read_curve_blocks("long", [(1, 0, 16), (2, 0, 3), (3, 0, 0)])
    assert [(b.level, b.index) for b in blocks] == (
        [(1, i) for i in range(17)] + [(2, i) for i in range(4)] + [(3, 0)]
    )
    top = blocks[-1]
    assert top.count == 64 and top.reward_max == max(e.reward for e in episodes[:64])
    # Stored before the store kept JSON: their JSON is written when read, the same as ever.
    assert store.read_episodes("long", 1, 70, json=True) == [
        episode_json(e).encode() for e in episodes
    ]
    plain = store.read_episodes("long", 1, 70, True, json=True)
    assert plain == [episode_json(e).encode() for e in scalars]
    store.close()
