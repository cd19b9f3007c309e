"""The SQLite store: runs, histories, paging, crash recovery, group commit on its thread, and
the WAL kept bounded under a writer that never pauses."""

from __future__ import annotations

import asyncio
import sqlite3
import struct
import threading
from functools import partial
from pathlib import Path

import pytest

from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunQuery
from gateway.core.store import (
    CheckpointRecord,
    EpisodeRecord,
    SqliteBackend,
    SqliteStore,
    StoreThread,
    StoreWriteFailed,
)
from tests.fakes.fake_trainer import valid_episodes
from tests.fakes.waiting import TIMEOUT
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
    page = store.list_runs(RunQuery(limit=3))
    assert [r.id for r in page.runs] == ["r6", "r5", "r4"]
    page = store.list_runs(RunQuery(after=page.after, limit=3))
    assert [r.id for r in page.runs] == ["r3", "r2", "r1"]
    stopped = store.list_runs(RunQuery(RunState.STOPPED, limit=10)).runs
    assert [r.id for r in stopped] == ["r5", "r3", "r1"]


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


def wal_restarts(path: str) -> int:
    """How many times the WAL of ``path`` started again from its beginning (the checkpoint
    sequence number in the WAL header)."""
    with open(f"{path}-wal", "rb") as f:
        return int(struct.unpack(">I", f.read(16)[12:16])[0])


async def hold(thread: StoreThread) -> threading.Event:
    """Holds the store thread in an operation until the returned event is set: what is
    submitted meanwhile is queued together."""
    entered, release = threading.Event(), threading.Event()

    def wait(_store: SqliteStore) -> None:
        entered.set()
        release.wait(TIMEOUT)

    thread.submit(wait)
    assert await asyncio.to_thread(entered.wait, 60)
    return release


async def test_queued_appends_commit_in_one_transaction_before_any_callback(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "db.sqlite3")
    commits: list[int] = []
    thread = StoreThread(
        SqliteStore(path), asyncio.get_running_loop(), on_commit=lambda n, _s: commits.append(n)
    )
    thread.start()
    await thread.call(SqliteStore.insert_run, make_run("a"))
    await thread.call(SqliteStore.insert_run, make_run("b"))
    reader = sqlite3.connect(path)  # another connection sees committed rows only
    seen: list[tuple[str, int, int]] = []

    def committed(run_id: str, n: int, _result: object, error: BaseException | None) -> None:
        assert error is None
        seen.append((run_id, n, reader.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]))

    release = await hold(thread)
    a, b = records("a", 300), records("b", 300)
    order = [rec for pair in zip(a, b, strict=True) for rec in pair]  # two runs interleaved
    for rec in order:
        committed_rec = partial(committed, rec.run_id, rec.episode)
        thread.submit(SqliteStore.append_episodes, (rec,), callback=committed_rec)
    del commits[:]
    release.set()
    run_a = await thread.call(SqliteStore.get_run, "a")
    run_b = await thread.call(SqliteStore.get_run, "b")
    # The held operation, then one transaction for the 600 appends (and maybe the get_run).
    assert commits[0] == 1 and commits[1] in (600, 601)
    # Every callback ran after that transaction committed, in submission order.
    assert seen == [(rec.run_id, rec.episode, 600) for rec in order]
    for run, recs in ((run_a, a), (run_b, b)):
        assert run is not None
        assert (run.episode, run.reward, run.best_reward) == (
            300,
            recs[-1].reward,
            recs[-1].best_reward,
        )
    assert await thread.call(SqliteStore.read_episodes, "b", 1, 300) == [r.data for r in b]
    reader.close()
    await thread.close()
    assert not Path(f"{path}-wal").exists()  # a clean close folds the WAL into the database


async def test_a_failing_append_among_queued_appends_fails_alone(tmp_path: Path) -> None:
    thread = StoreThread(SqliteStore(str(tmp_path / "db.sqlite3")), asyncio.get_running_loop())
    thread.start()
    await thread.call(SqliteStore.insert_run, make_run("a"))
    recs = records("a", 20)
    await thread.call(SqliteStore.append_episodes, recs[:5])
    duplicate = EpisodeRecord("a", 3, 0.0, 0.0, b"not what episode 3 is")
    outcomes: list[tuple[EpisodeRecord, BaseException | None]] = []
    release = await hold(thread)
    for rec in [*recs[5:10], duplicate, *recs[10:]]:
        thread.submit(
            SqliteStore.append_episodes,
            (rec,),
            callback=lambda _r, error, rec=rec: outcomes.append((rec, error)),
        )
    release.set()
    run = await thread.call(SqliteStore.get_run, "a")
    assert [rec.episode for rec, _ in outcomes] == [*range(6, 11), 3, *range(11, 21)]
    failed = [(rec, error) for rec, error in outcomes if error is not None]
    assert len(failed) == 1 and failed[0][0] is duplicate
    assert isinstance(failed[0][1], sqlite3.IntegrityError)
    assert await thread.call(SqliteStore.read_episodes, "a", 1, 20) == [r.data for r in recs]
    assert run is not None and run.episode == 20
    await thread.close()


def test_a_checkpoint_between_transactions_lets_the_next_commit_restart_the_wal(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "db.sqlite3")
    store = SqliteStore(path)
    store.insert_run(make_run("a"))
    recs = records("a", 3000)

    def append(first: int, last: int) -> None:
        store.begin()
        store.append_episodes(recs[first:last])
        store.commit()

    append(0, 1000)
    store.checkpoint()  # the checkpointer's pass ...
    append(1000, 2000)  # ... and the writer goes on meanwhile
    grown, restarts = Path(f"{path}-wal").stat().st_size, wal_restarts(path)
    busy, frames, copied = store.checkpoint_writer()
    assert busy == 0 and frames == copied > 0
    append(2000, 2100)
    assert wal_restarts(path) == restarts + 1  # the WAL started again from its beginning ...
    assert Path(f"{path}-wal").stat().st_size < grown / 2  # ... and its file was cut back
    assert SqliteStore(path).read_episodes("a", 1, 2100) == [r.data for r in recs[:2100]]


async def test_the_wal_stays_bounded_under_a_writer_that_never_pauses(tmp_path: Path) -> None:
    path = str(tmp_path / "db.sqlite3")
    limit = 256 * 1024
    thread = StoreThread(SqliteStore(path), asyncio.get_running_loop(), wal_limit_bytes=limit)
    thread.start()
    runs = [f"r{i}" for i in range(8)]
    for run_id in runs:
        await thread.call(SqliteStore.insert_run, make_run(run_id))
    episodes = {run_id: records(run_id, 5000) for run_id in runs}
    wal = Path(f"{path}-wal")
    peak = n = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    # One commit after another, as many runs ingesting unpaced give: the store thread never
    # waits for work long enough for a checkpoint to catch up by chance.
    while wal_restarts(path) < 4 and n < 5000 and loop.time() < deadline:
        for run_id in runs:
            for rec in episodes[run_id][n : n + 5]:
                thread.submit(SqliteStore.append_episodes, (rec,))
        n += 5
        await thread.call(SqliteStore.get_run, runs[0])
        peak = max(peak, wal.stat().st_size)
    assert wal_restarts(path) >= 4, f"the WAL never started again ({peak} bytes)"
    # The store thread restarts it at the limit (waiting for the checkpointer past one and a
    # half times the limit); a commit or two of 40 episodes more may come first.
    assert peak <= 1.5 * limit + 256 * 1024, peak
    await thread.close()
    assert SqliteStore(path).read_episodes("r7", 1, n) == [r.data for r in episodes["r7"][:n]]


async def test_a_group_commit_of_large_episodes_stays_within_a_quarter_of_the_wal_limit(
    tmp_path: Path,
) -> None:
    # A transaction cannot be checkpointed while it is written: 2048 queued episodes at the
    # largest motion detail made one 64 MiB commit, and the WAL passed its limit by as much.
    path = str(tmp_path / "db.sqlite3")
    limit = 1 << 20
    batches: list[int] = []
    thread = StoreThread(
        SqliteStore(path),
        asyncio.get_running_loop(),
        lambda ops, _: batches.append(ops),
        wal_limit_bytes=limit,
    )
    thread.start()
    await thread.call(SqliteStore.insert_run, make_run("big"))
    big = [
        EpisodeRecord("big", e.episode, e.reward, e.best_reward, e.SerializeToString())
        for e in valid_episodes(600, detail_every=1, frames=240, joints=32)
    ]
    size = len(big[0].data)
    assert size > 16 * 1024  # the contract's largest detail: 240 frames x 32 joints
    release = await hold(thread)  # everything below is queued together
    for rec in big:
        thread.submit(SqliteStore.append_episodes, (rec,))
    batches.clear()
    release.set()
    await thread.call(SqliteStore.get_run, "big")
    appended = [n for n in batches if n > 1]
    assert sum(batches) >= len(big) and len(appended) > 1, batches
    assert max(batches) * size <= limit // 4 + size, (batches, size)
    await thread.close()
    assert SqliteStore(path).read_episodes("big", 1, 600) == [r.data for r in big]


async def test_a_checkpoint_record_that_cannot_be_written_fails_and_turns_writable_off(
    tmp_path: Path,
) -> None:
    backend = SqliteBackend(str(tmp_path / "db.sqlite3"))
    backend.db.insert_run(make_run("a"))  # before start: this thread may still use it
    backend.db._conn.execute("PRAGMA query_only=1")  # every write fails as read-only
    changes: list[bool] = []
    backend.on_writable(changes.append)
    await backend.start()
    try:
        with pytest.raises(StoreWriteFailed, match="read-only"):
            await backend.add_checkpoint(CheckpointRecord("a", 4, 1, 10, "0" * 64), keep=2)
        with pytest.raises(StoreWriteFailed):
            await backend.delete_checkpoints("a", [4])
        assert changes == [False] and not backend.writable
        assert await backend.list_checkpoints("a") == []  # reads go on
        run = await backend.get_run("a")
        assert run is not None and run.checkpoint_episode == 0
    finally:
        await backend.close()
