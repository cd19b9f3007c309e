"""The SQLite store: runs, histories, paging, crash recovery, and group commit on its thread."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from gateway.core.runs import RunState, TrainingRun
from gateway.core.store import EpisodeRecord, SqliteStore, StoreThread
from tests.fakes.fake_trainer import valid_episodes
from trainwire.v1 import episode_pb2


def make_run(run_id: str, request_id: str = "") -> TrainingRun:
    return TrainingRun(
        id=run_id,
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="walk")
        ),
        config=episode_pb2.TrainConfig(max_episodes=50, seed=3),
        speed=2.0,
        episodes_per_second=15.0,
        create_time=1_700_000_000_000_000_000,
        display_name=f"run {run_id}",
        request_id=request_id,
    )


def records(run_id: str, count: int) -> list[EpisodeRecord]:
    return [
        EpisodeRecord(run_id, e.episode, e.reward, e.best_reward, e.SerializeToString())
        for e in valid_episodes(count)
    ]


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SqliteStore:
    path = str(tmp_path / "sub" / "db.sqlite3") if request.param == "file" else ":memory:"
    return SqliteStore(path)


def test_run_roundtrip_and_request_lookup(store: SqliteStore) -> None:
    run = make_run("a", request_id="req-1")
    run.seq = store.insert_run(run)
    loaded = store.get_run("a")
    assert loaded == run
    assert store.find_request("req-1") == run
    assert store.find_request("nope") is None
    assert store.get_run("nope") is None


def test_request_id_is_unique_but_empty_is_not(store: SqliteStore) -> None:
    store.insert_run(make_run("a", "same"))
    store.insert_run(make_run("b"))
    store.insert_run(make_run("c"))  # two runs without request id are fine
    with pytest.raises(sqlite3.IntegrityError):
        store.insert_run(make_run("d", "same"))


def test_episodes_are_stored_byte_identical_and_move_the_counters(store: SqliteStore) -> None:
    run = make_run("a")
    store.insert_run(run)
    recs = records("a", 30)
    store.append_episodes(recs[:10])
    store.append_episodes(recs[10:])
    assert store.read_episodes("a", 1, 30) == [r.data for r in recs]
    assert store.read_episodes("a", 11, 12) == [recs[10].data, recs[11].data]
    loaded = store.get_run("a")
    assert loaded is not None
    assert (loaded.episode, loaded.reward, loaded.best_reward) == (
        30,
        recs[-1].reward,
        recs[-1].best_reward,
    )


def test_update_does_not_rewind_counters(store: SqliteStore) -> None:
    run = make_run("a")
    store.insert_run(run)
    store.append_episodes(records("a", 5))
    run.start("t:1", 5)
    store.update_run(run)  # run.episode is still 0 in this snapshot
    loaded = store.get_run("a")
    assert loaded is not None and loaded.episode == 5 and loaded.state is RunState.RUNNING


def test_list_is_newest_first_with_cursor_and_filter(store: SqliteStore) -> None:
    for i in range(7):
        run = make_run(f"r{i}")
        if i % 2:
            run.stop(1)
        store.insert_run(run)
        if i % 2:
            store.update_run(run)
    page = store.list_runs(None, None, 3)
    assert [r.id for r in page] == ["r6", "r5", "r4"]
    page = store.list_runs(None, page[-1].seq, 3)
    assert [r.id for r in page] == ["r3", "r2", "r1"]
    assert [r.id for r in store.list_runs(RunState.STOPPED, None, 10)] == ["r5", "r3", "r1"]


def test_delete_removes_run_and_history(store: SqliteStore) -> None:
    store.insert_run(make_run("a"))
    store.append_episodes(records("a", 3))
    store.delete_run("a")
    assert store.get_run("a") is None
    assert store.read_episodes("a", 1, 3) == []


def test_active_runs_are_the_ones_a_restart_recovers_oldest_first(store: SqliteStore) -> None:
    runs = [make_run(f"r{i}") for i in range(4)]
    runs[1].start("t", 1)
    runs[1].trainer_episode = 7
    runs[2].start("t", 1)
    runs[2].pause()
    runs[3].stop(2)
    for run in runs:
        store.insert_run(run)
        store.update_run(run)
    active = store.active_runs()
    assert [r.id for r in active] == ["r0", "r1", "r2"]
    assert [r.state for r in active] == [RunState.PENDING, RunState.RUNNING, RunState.PAUSED]
    assert active[1].trainer == "t" and active[1].trainer_episode == 7


def test_file_store_uses_wal_and_survives_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "db.sqlite3")
    store = SqliteStore(path)
    store.insert_run(make_run("a"))
    store.append_episodes(records("a", 4))
    # no close: a crashed process leaves the WAL behind
    other = SqliteStore(path)
    assert other._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert len(other.read_episodes("a", 1, 4)) == 4


async def test_store_thread_group_commits_and_isolates_failures(tmp_path: Path) -> None:
    commits: list[int] = []
    thread = StoreThread(
        SqliteStore(str(tmp_path / "db.sqlite3")),
        asyncio.get_running_loop(),
        on_commit=lambda n, _s: commits.append(n),
    )
    thread.start()
    await thread.call(SqliteStore.insert_run, make_run("a", "dup"))
    delivered: list[int] = []
    for rec in records("a", 200):
        thread.submit(
            SqliteStore.append_episodes,
            (rec,),
            callback=lambda _r, err, n=rec.episode: delivered.append(-1 if err else n),
        )
    # A failing operation in the middle of a batch fails alone.
    failing = asyncio.ensure_future(thread.call(SqliteStore.insert_run, make_run("b", "dup")))
    after = await thread.call(SqliteStore.get_run, "a")
    with pytest.raises(sqlite3.IntegrityError):
        await failing
    assert delivered == list(range(1, 201))  # in order, each after its commit
    assert after is not None and after.episode == 200
    assert len(commits) < 200  # grouped
    await thread.close()
    with pytest.raises(RuntimeError):
        thread.submit(SqliteStore.get_run, "a")


def test_checkpoints_happen_off_the_commit_path(tmp_path: Path) -> None:
    path = str(tmp_path / "db.sqlite3")
    store = SqliteStore(path)
    assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    store.insert_run(make_run("a"))
    recs = records("a", 300)
    store.append_episodes(recs)
    assert Path(path + "-wal").stat().st_size > 0
    store.checkpoint()
    busy, frames, done = sqlite3.connect(path).execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and frames == done  # everything in the WAL is in the database file
    assert SqliteStore(path).read_episodes("a", 300, 300) == [recs[-1].data]
