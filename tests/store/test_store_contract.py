"""The ``Store`` contract, run against every backend: SQLite (the embedded default) and
PostgreSQL (a real server, ``tests/postgres_fixtures.py``).

Every method of ``gateway.core.store.base.Store`` is exercised through the interface the core
uses, so both backends are held to one behaviour. Backend-specific matters (SQLite's WAL and
store thread, PostgreSQL's fencing and schema) have tests of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from google.protobuf import json_format

from gateway.core.curve import CurveBuilder
from gateway.core.episode_json import episode_json, json_parts
from gateway.core.framing import detail_offset
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from gateway.core.store import (
    CheckpointRecord,
    DuplicateRequest,
    EpisodeRecord,
    Store,
)
from tests.fakes.fake_trainer import valid_episodes
from tests.fakes.waiting import TIMEOUT
from tests.store.conftest import Opener
from trainwire.v1 import episode_pb2


def make_run(run_id: str, request_id: str = "", episodes: int = 50) -> TrainingRun:
    return TrainingRun(
        id=run_id,
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="walk")
        ),
        config=episode_pb2.TrainConfig(max_episodes=episodes, seed=3),
        speed=2.0,
        episodes_per_second=15.0,
        create_time=1_700_000_000_000_000_000,
        display_name=f"run {run_id}",
        request_id=request_id,
        creator="alice",
        request_hash="h1",
    )


def records(run_id: str, count: int) -> list[EpisodeRecord]:
    return [
        EpisodeRecord(
            run_id, e.episode, e.reward, e.best_reward, e.SerializeToString(deterministic=True)
        )
        for e in valid_episodes(count)
    ]


def checkpoint(run_id: str, episode: int, digest: str = "") -> CheckpointRecord:
    return CheckpointRecord(
        run_id,
        episode,
        create_time=1_700_000_000_000_000_000 + episode,
        size_bytes=1000 * episode,
        sha256=digest or f"{episode:064x}",
    )


async def checkpoint_episode(store: Store, run_id: str) -> int:
    run = await store.get_run(run_id)
    assert run is not None
    return run.checkpoint_episode


async def listed(store: Store, run_id: str) -> list[int]:
    return [c.episode for c in await store.list_checkpoints(run_id)]


async def append(store: Store, recs: list[EpisodeRecord]) -> list[BaseException | None]:
    """Queues ``recs`` together and waits for every callback; returns their outcomes in the
    order the callbacks ran."""
    loop = asyncio.get_running_loop()
    outcomes: list[tuple[int, BaseException | None]] = []
    done = loop.create_future()

    def callback(n: int) -> Callable[[BaseException | None], None]:
        def called(error: BaseException | None) -> None:
            outcomes.append((n, error))
            if len(outcomes) == len(recs) and not done.done():
                done.set_result(None)

        return called

    for rec in recs:
        store.append_episode(rec, callback(rec.episode))
    await asyncio.wait_for(done, TIMEOUT)
    assert [n for n, _ in outcomes] == [r.episode for r in recs], "callbacks in order"
    return [e for _, e in outcomes]


async def test_insert_get_and_find_by_request_id(store: Store) -> None:
    first = make_run("a", request_id="req-1")
    first.seq = await store.insert_run(first)
    second = make_run("b")
    second.seq = await store.insert_run(second)
    assert second.seq > first.seq > 0
    assert await store.get_run("a") == first
    assert await store.find_request("req-1") == first
    assert await store.find_request("nope") is None
    assert await store.get_run("nope") is None


async def test_a_request_id_names_one_run_but_runs_without_one_are_many(store: Store) -> None:
    await store.insert_run(make_run("a", "same"))
    await store.insert_run(make_run("b"))
    await store.insert_run(make_run("c"))
    with pytest.raises(DuplicateRequest):
        await store.insert_run(make_run("d", "same"))
    assert await store.get_run("d") is None
    assert store.writable


async def test_episodes_are_committed_then_called_back_and_read_back_byte_identical(
    store: Store,
) -> None:
    await store.insert_run(make_run("a"))
    recs = records("a", 40)
    assert await append(store, recs[:1]) == [None]
    assert await append(store, recs[1:]) == [None] * 39  # queued together: group commit
    assert await store.read_episodes("a", 1, 40) == [r.data for r in recs]
    assert await store.read_episodes("a", 11, 12) == [recs[10].data, recs[11].data]
    assert await store.read_episodes("a", 39, 100) == [recs[38].data, recs[39].data]
    assert await store.read_episodes("other", 1, 10) == []
    loaded = await store.get_run("a")
    assert loaded is not None
    assert (loaded.episode, loaded.reward, loaded.best_reward) == (
        40,
        recs[-1].reward,
        recs[-1].best_reward,
    )


async def test_appends_of_several_runs_in_one_commit_move_each_run(store: Store) -> None:
    for run_id in ("a", "b"):
        await store.insert_run(make_run(run_id))
    a, b = records("a", 10), records("b", 6)
    mixed = [r for pair in zip(a, b, strict=False) for r in pair] + a[6:]
    assert await append(store, mixed) == [None] * 16
    got_a, got_b = await store.get_run("a"), await store.get_run("b")
    assert got_a is not None and got_a.episode == 10
    assert got_b is not None and got_b.episode == 6
    assert await store.read_episodes("b", 1, 6) == [r.data for r in b]


async def test_update_writes_the_state_and_never_rewinds_the_counters(store: Store) -> None:
    run = make_run("a")
    await store.insert_run(run)
    snapshot = run.snapshot()  # taken before the episodes: episode 0
    await append(store, records("a", 5))
    snapshot.start("t:1", 5)
    snapshot.trainer_episode = 9
    snapshot.set_speed(3.0)
    await store.update_run(snapshot)
    loaded = await store.get_run("a")
    assert loaded is not None
    assert (loaded.episode, loaded.state, loaded.trainer, loaded.trainer_episode) == (
        5,
        RunState.RUNNING,
        "t:1",
        9,
    )
    assert (loaded.speed, loaded.start_time) == (3.0, 5)
    snapshot.fail("it broke", 7)
    await store.update_run(snapshot)
    loaded = await store.get_run("a")
    assert loaded is not None
    assert (loaded.state, loaded.error_message, loaded.end_time) == (RunState.ERROR, "it broke", 7)


async def test_list_is_newest_first_with_a_cursor_and_a_state_filter(store: Store) -> None:
    for i in range(7):
        run = make_run(f"r{i}")
        await store.insert_run(run)
        if i % 2:
            run.stop(1)
            await store.update_run(run)
    page = await store.list_runs(RunQuery(limit=3))
    assert [r.id for r in page.runs] == ["r6", "r5", "r4"]
    assert page.after == (page.runs[-1].seq,)
    page = await store.list_runs(RunQuery(after=page.after, limit=3))
    assert [r.id for r in page.runs] == ["r3", "r2", "r1"]
    last = await store.list_runs(RunQuery(after=page.after, limit=3))
    assert ([r.id for r in last.runs], last.after) == (["r0"], None)
    stopped = await store.list_runs(RunQuery(RunState.STOPPED, limit=10))
    assert [r.id for r in stopped.runs] == ["r5", "r3", "r1"]
    assert await store.list_runs(RunQuery(RunState.DONE)) == RunPage([], None)


async def test_delete_removes_the_run_and_its_history(store: Store) -> None:
    await store.insert_run(make_run("a"))
    await store.insert_run(make_run("b"))
    await append(store, records("a", 3) + records("b", 2))
    await store.delete_run("a")
    assert await store.get_run("a") is None
    assert await store.read_episodes("a", 1, 3) == []
    assert len(await store.read_episodes("b", 1, 3)) == 2


async def test_counts_and_the_active_runs_a_restart_recovers(store: Store) -> None:
    runs = [make_run(f"r{i}") for i in range(5)]
    runs[1].start("t", 1)
    runs[1].trainer_episode = 7
    runs[2].start("t", 1)
    runs[2].pause()
    runs[3].stop(2)
    runs[4].start("t", 1)
    runs[4].complete(3)
    for run in runs:
        await store.insert_run(run)
        await store.update_run(run)
    active = await store.active_runs()
    assert [r.id for r in active] == ["r0", "r1", "r2"]
    assert [r.state for r in active] == [RunState.PENDING, RunState.RUNNING, RunState.PAUSED]
    assert active[1].trainer == "t" and active[1].trainer_episode == 7
    assert await store.count_by_state() == {
        RunState.PENDING: 1,
        RunState.RUNNING: 1,
        RunState.PAUSED: 1,
        RunState.STOPPED: 1,
        RunState.DONE: 1,
    }


async def test_close_commits_what_is_queued_and_a_new_store_reads_it(opener: Opener) -> None:
    store = opener()
    await store.start()
    changes: list[bool] = []
    store.on_writable(changes.append)
    assert store.writable
    await store.insert_run(make_run("a", request_id="r"))
    outcomes: list[BaseException | None] = []
    for rec in records("a", 25):
        store.append_episode(rec, outcomes.append)
    await store.close()
    assert outcomes == [None] * 25
    assert changes == []
    again = opener()
    await again.start()
    try:
        loaded = await again.find_request("r")
        assert loaded is not None and loaded.episode == 25
        assert len(await again.read_episodes("a", 1, 25)) == 25
    finally:
        await again.close()


async def test_checkpoints_are_listed_oldest_first_and_a_rewrite_takes_its_new_digest(
    store: Store,
) -> None:
    await store.insert_run(make_run("a"))
    assert await checkpoint_episode(store, "a") == 0
    assert await store.list_checkpoints("a") == []
    assert await store.add_checkpoint(checkpoint("a", 6), keep=4) == []
    assert await store.add_checkpoint(checkpoint("a", 3), keep=4) == []  # an older one too
    assert await store.list_checkpoints("a") == [checkpoint("a", 3), checkpoint("a", 6)]
    assert await checkpoint_episode(store, "a") == 6
    # The same checkpoint again (a retried report, a re-attach): a no-op.
    assert await store.add_checkpoint(checkpoint("a", 6), keep=4) == []
    assert await store.list_checkpoints("a") == [checkpoint("a", 3), checkpoint("a", 6)]
    # Written again by a restarted job (another digest): the files' digest is the one kept.
    assert await store.add_checkpoint(checkpoint("a", 6, digest="f" * 64), keep=4) == []
    assert await store.list_checkpoints("a") == [
        checkpoint("a", 3),
        checkpoint("a", 6, digest="f" * 64),
    ]
    assert await store.list_checkpoints("other") == []
    with pytest.raises(ValueError, match="keep"):
        await store.add_checkpoint(checkpoint("a", 9), keep=0)
    assert await listed(store, "a") == [3, 6]
    assert store.writable


async def test_retention_keeps_the_latest_and_returns_exactly_what_it_deleted(
    store: Store,
) -> None:
    await store.insert_run(make_run("a"))
    await store.insert_run(make_run("b"))
    deleted = [await store.add_checkpoint(checkpoint("a", e), keep=3) for e in range(2, 14, 2)]
    assert deleted == [[], [], [], [2], [4], [6]]
    assert await listed(store, "a") == [8, 10, 12]
    # Older than the latest three (re-trained after a restore): not kept, so its files go.
    assert await store.add_checkpoint(checkpoint("a", 5), keep=3) == [5]
    assert await store.add_checkpoint(checkpoint("a", 11), keep=3) == [8]
    assert await listed(store, "a") == [10, 11, 12]
    assert await store.add_checkpoint(checkpoint("a", 14), keep=1) == [10, 11, 12]
    assert await store.list_checkpoints("a") == [checkpoint("a", 14)]
    assert await checkpoint_episode(store, "a") == 14
    # Another run's records are its own.
    assert await store.add_checkpoint(checkpoint("b", 1), keep=1) == []
    assert await listed(store, "b") == [1]
    assert await listed(store, "a") == [14]


async def test_retention_keeps_the_newest_checkpoint_at_or_before_the_published_episode(
    store: Store,
) -> None:
    await store.insert_run(make_run("a"))
    assert await append(store, records("a", 7)) == [None] * 7  # published through 7
    deleted = [await store.add_checkpoint(checkpoint("a", e), keep=2) for e in (5, 10, 15, 20)]
    # The trainer trained ahead: 10, 15 and 20 are beyond what a takeover continues from, so
    # 5 stays beside the latest two.
    assert deleted == [[], [], [], [10]]
    assert await listed(store, "a") == [5, 15, 20]
    assert await checkpoint_episode(store, "a") == 20
    # A checkpoint older than the latest two reported again (to a replica that took the run
    # over) is not kept, even at or before the published episode: its files may be gone.
    assert await store.add_checkpoint(checkpoint("a", 6), keep=2) == [6]
    assert await listed(store, "a") == [5, 15, 20]
    # Once published past a newer one, the older one goes with the next record.
    assert await append(store, records("a", 21)[7:]) == [None] * 14
    assert await store.add_checkpoint(checkpoint("a", 25), keep=2) == [5, 15]
    assert await listed(store, "a") == [20, 25]


async def test_concurrent_checkpoints_of_a_run_apply_retention_once_each(store: Store) -> None:
    await store.insert_run(make_run("a"))
    results = await asyncio.gather(
        *(store.add_checkpoint(checkpoint("a", e), keep=3) for e in range(1, 11))
    )
    deleted = sorted(e for episodes in results for e in episodes)
    assert deleted == [1, 2, 3, 4, 5, 6, 7]
    assert await listed(store, "a") == [8, 9, 10]
    assert await checkpoint_episode(store, "a") == 10


async def test_checkpoint_episode_follows_the_records_and_updates_never_rewind_it(
    store: Store,
) -> None:
    run = make_run("a")
    await store.insert_run(run)
    snapshot = run.snapshot()  # taken before the checkpoints: checkpoint_episode 0
    for episode in (3, 6, 9):
        await store.add_checkpoint(checkpoint("a", episode), keep=4)
    snapshot.start("t:1", 5)
    await store.update_run(snapshot)
    assert await checkpoint_episode(store, "a") == 9
    # The latest one was corrupt: the gateway drops it and resumes from the one before.
    await store.delete_checkpoints("a", [9])
    assert await checkpoint_episode(store, "a") == 6
    assert await listed(store, "a") == [3, 6]
    await store.delete_checkpoints("a", [])
    await store.delete_checkpoints("a", [7, 8])  # never recorded: nothing happens
    assert await listed(store, "a") == [3, 6]
    await store.delete_checkpoints("a", [3, 6])
    assert await checkpoint_episode(store, "a") == 0
    assert await store.list_checkpoints("a") == []


async def test_delete_removes_the_run_s_checkpoint_records(store: Store) -> None:
    await store.insert_run(make_run("a"))
    await store.insert_run(make_run("b"))
    for run_id in ("a", "b"):
        await store.add_checkpoint(checkpoint(run_id, 4), keep=2)
    await store.delete_run("a")
    assert await store.list_checkpoints("a") == []
    assert await listed(store, "b") == [4]
    # A checkpoint that arrives after its run was deleted is not kept: its files go too.
    assert await store.add_checkpoint(checkpoint("a", 8), keep=2) == [8]
    assert await store.list_checkpoints("a") == []
    await store.insert_run(make_run("a"))  # the id again: a new run, no old records
    assert await store.list_checkpoints("a") == []
    assert await checkpoint_episode(store, "a") == 0


async def test_restarts_parked_and_the_checkpoint_are_read_back_everywhere(
    store: Store,
) -> None:
    run = make_run("a")
    await store.insert_run(run)
    await store.insert_run(make_run("b"))
    fresh = await store.get_run("a")
    assert fresh is not None
    assert (fresh.checkpoint_episode, fresh.restarts, fresh.parked) == (0, 0, False)
    await store.add_checkpoint(checkpoint("a", 5), keep=2)
    run.start("t:1", 1)
    run.pause()
    run.restarts = 2
    run.parked = True
    await store.update_run(run)
    run.checkpoint_episode = 0  # stale in memory: never written by update_run
    loaded = await store.get_run("a")
    assert loaded is not None
    assert (loaded.checkpoint_episode, loaded.restarts, loaded.parked) == (5, 2, True)
    listed_runs = {r.id: r for r in (await store.list_runs(RunQuery(limit=10))).runs}
    assert listed_runs["a"] == loaded
    assert (listed_runs["b"].restarts, listed_runs["b"].parked) == (0, False)
    active = {r.id: r for r in await store.active_runs()}
    assert active["a"] == loaded
    run.resume()
    run.parked = False
    await store.update_run(run)
    loaded = await store.get_run("a")
    assert loaded is not None
    assert (loaded.state, loaded.restarts, loaded.parked) == (RunState.RUNNING, 2, False)


async def test_checkpoint_records_survive_a_reopen(opener: Opener) -> None:
    store = opener()
    await store.start()
    await store.insert_run(make_run("a"))
    await store.add_checkpoint(checkpoint("a", 3), keep=2)
    await store.close()
    again = opener()
    await again.start()
    try:
        assert await again.list_checkpoints("a") == [checkpoint("a", 3)]
        assert await checkpoint_episode(again, "a") == 3
    finally:
        await again.close()


def detail_records(
    run_id: str, count: int, json_every: int, detail_every: int = 4, kept: bool = True
) -> list[EpisodeRecord]:
    """Episodes with a detail every ``detail_every``-th, kept for good every 8th and the last
    (none without ``kept``: all recent), with their curve blocks, and their JSON on every
    ``json_every``-th (0: none; never a 16th's detail's)."""
    builder = CurveBuilder()
    recs = []
    for e in valid_episodes(count, detail_every=detail_every):
        data = e.SerializeToString(deterministic=True)
        at = detail_offset(data)
        with_json = json_every and e.episode % json_every == 0
        numbers, detail = json_parts(e) if with_json else (b"", None)
        if e.episode % 16 == 0:
            detail = None  # a detail stored without its JSON beside numbers with theirs
        recs.append(
            EpisodeRecord(
                run_id,
                e.episode,
                e.reward,
                e.best_reward,
                data,
                at if at < len(data) else -1,
                builder.add(e.episode, e.reward, e.best_reward, e.metrics),
                keep_detail=kept and (e.episode % 8 == 0 or e.done),
                numbers_json=numbers,
                detail_json=detail,
            )
        )
    return recs


async def test_details_are_kept_apart_settled_and_curve_blocks_read_back(store: Store) -> None:
    await store.insert_run(make_run("a"))
    recs = detail_records("a", 40, json_every=0)
    assert await append(store, recs) == [None] * 40
    whole = [r.data for r in recs]
    assert await store.read_episodes("a", 1, 40) == whole
    assert await store.read_episodes("a", 1, 40, scalars=True) == [r.scalars for r in recs]
    # Recent details (episodes 4, 12, 20, 28, 36): 20 kept for good, the others dropped.
    assert await store.settle_details("a", 1, 30, [20, 25]) == 3
    after = await store.read_episodes("a", 1, 40)
    with_detail = {n for n, d in enumerate(after, 1) if d != recs[n - 1].scalars}
    assert with_detail == {8, 16, 20, 24, 32, 36, 40}
    assert all(after[n - 1] == whole[n - 1] for n in with_detail)  # never altered, only gone
    blocks = await store.read_curve_blocks("a", [(1, 0, 9), (2, 1, 5)])
    assert [(b.level, b.index) for b in blocks] == [(1, i) for i in range(10)] + [(2, 1)]
    assert blocks[-1] == carried_block(recs, 2, 1)
    await store.delete_run("a")
    assert await store.read_curve_blocks("a", [(1, 0, 9)]) == []


async def test_episodes_json_is_read_as_stored_and_written_where_it_was_not(
    store: Store,
) -> None:
    """Each episode's JSON is kept beside it in two parts (numbers, detail) and read back
    joined, with the detail the store kept or without; the episodes stored without their JSON
    (before the store kept it: the odd ones here) read the same, encoded on the read."""
    await store.insert_run(make_run("a"))
    recs = detail_records("a", 40, json_every=2)
    assert await append(store, recs) == [None] * 40
    assert await store.settle_details("a", 1, 30, [20]) == 3  # 4, 12, 28 dropped; 20 kept

    def expected(scalars: bool) -> list[bytes]:
        stored = [episode_pb2.Episode.FromString(d) for d in whole]
        if scalars:
            for e in stored:
                e.ClearField("detail")
        return [episode_json(e).encode() for e in stored]

    whole = await store.read_episodes("a", 1, 40)
    full = await store.read_episodes("a", 1, 40, json=True)
    assert full == expected(False)
    assert sum(b'"imitation"' in j for j in full) == 7  # 8, 16, 20, 24, 32, 36, 40
    assert await store.read_episodes("a", 1, 40, scalars=True, json=True) == expected(True)
    assert await store.read_episodes("a", 11, 13, json=True) == full[10:13]
    for text, data in zip(full, whole, strict=True):  # the protobuf JSON mapping, exactly
        assert json_format.Parse(text, episode_pb2.Episode()) == episode_pb2.Episode.FromString(
            data
        )


def carried_block(recs: list[EpisodeRecord], level: int, index: int) -> object:
    """The block of ``level``/``index`` as the records carried it."""
    return next(b for r in recs for b in r.blocks if (b.level, b.index) == (level, index))


async def test_a_read_cancelled_at_any_point_leaves_the_store_serving_reads(store: Store) -> None:
    """The page cache cancels reads whose watchers went away (``gateway.core.page_cache``): a
    read cancelled before, during or after its query leaves every connection usable."""
    run = make_run("a", episodes=3000)
    run.seq = await store.insert_run(run)
    recs = records("a", 3000)
    await append(store, recs)
    expected = [r.data for r in recs]
    loop = asyncio.get_running_loop()
    for attempt in range(24):
        read = asyncio.ensure_future(store.read_episodes("a", 1, 3000))
        # Cancelled at once, after a few loop passes, or up to ~6 ms into the query (the whole
        # read takes 4-8 ms on PostgreSQL).
        if attempt % 3 == 1:
            for _ in range(attempt):
                await asyncio.sleep(0)
        elif attempt % 3 == 2:
            began = loop.time()
            while loop.time() - began < attempt / 4000:
                await asyncio.sleep(0)
        read.cancel()
        await asyncio.gather(read, return_exceptions=True)
        first, last = 1 + attempt * 100, 256 + attempt * 100
        assert (
            await asyncio.wait_for(store.read_episodes("a", first, last), TIMEOUT)
            == (expected[first - 1 : last])
        )
    assert await asyncio.wait_for(store.read_episodes("a", 1, 3000), TIMEOUT) == expected
