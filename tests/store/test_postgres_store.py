"""What only the PostgreSQL store does: its schema (recognised, refused, migrated, also by
``python -m gateway migrate``), writes fenced by the run's owner, claims and leases, and the
notifications replicas wake up on. A real server (``tests/postgres_fixtures.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator

import psycopg
import pytest

from gateway.core.runs import RunState
from gateway.core.store import DatabaseProblem, NotOwner, PostgresStore, SchemaOutdated
from gateway.core.store.postgres import RECENT_VACUUM_ROWS
from gateway.core.store.postgres_leases import Leases, notifications
from gateway.core.store.postgres_schema import SCHEMA_VERSION, upgrade
from tests.fakes.episodes import valid_episodes
from tests.fakes.gateway_harness import ROOT
from tests.fakes.waiting import TIMEOUT, until
from tests.store.test_store_contract import (
    append,
    checkpoint,
    detail_records,
    listed,
    make_run,
    records,
)
from trainwire.v1 import episode_pb2


async def version_of(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute("SELECT value FROM trainwire_meta WHERE key='schema_version'")
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def make_old(url: str, version: int = 1) -> None:
    """A database at an older schema ``version`` (1: before replicas, 2: before checkpoints)
    holding one finished run."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await upgrade(conn, url, migrate=False, target=version)
    # An older database cannot take this gateway's queries: the row is written by hand.
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        run = make_run("old", request_id="req-old")
        await conn.execute(
            "INSERT INTO runs (id, request_id, state, error_message, speed, "
            "episodes_per_second, episode, reward, best_reward, task, config, create_time, "
            "start_time, end_time, display_name, trainer) "
            "VALUES ('old', 'req-old', 4, '', 1, 20, 2, 0.5, 0.9, %s, %s, 1, 2, 3, 'old', 't')",
            (run.task.SerializeToString(), run.config.SerializeToString()),
        )
        await conn.execute("INSERT INTO episodes VALUES ('old', 1, 'a'), ('old', 2, 'b')")


def gateway_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_an_empty_database_gets_the_schema_and_a_foreign_one_is_refused(
    postgres_url: str, postgres_server: object
) -> None:
    store = PostgresStore(postgres_url, "a")
    await store.start()
    await store.close()
    assert await version_of(postgres_url) == SCHEMA_VERSION
    foreign = postgres_server.create_database("foreign")  # type: ignore[attr-defined]
    async with await psycopg.AsyncConnection.connect(foreign, autocommit=True) as conn:
        await conn.execute("CREATE TABLE invoices (id int)")
    with pytest.raises(DatabaseProblem, match=r"not a Trainwire database .*invoices"):
        await PostgresStore(foreign, "a").start()
    newer = postgres_server.create_database("newer")  # type: ignore[attr-defined]
    await PostgresStore(newer, "a").start()  # creates it; then a newer gateway "wrote" it
    async with await psycopg.AsyncConnection.connect(newer, autocommit=True) as conn:
        await conn.execute("UPDATE trainwire_meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(DatabaseProblem, match="newer gateway") as refused:
        await PostgresStore(newer, "a").start()
    assert "\n" not in str(refused.value)


async def test_an_older_schema_is_refused_unless_migrated_and_keeps_its_runs(
    postgres_url: str,
) -> None:
    await make_old(postgres_url)
    with pytest.raises(SchemaOutdated, match="migrate it with `python -m gateway migrate"):
        await PostgresStore(postgres_url, "a").start()
    assert await version_of(postgres_url) == 1
    # Two replicas started with --migrate at once: one migrates, both run.
    stores = [PostgresStore(postgres_url, name, migrate=True) for name in "ab"]
    await asyncio.gather(*(s.start() for s in stores))
    assert await version_of(postgres_url) == SCHEMA_VERSION
    old = await stores[0].find_request("req-old")
    assert old is not None and old.state is RunState.DONE and old.episode == 2
    assert await stores[1].read_episodes("old", 1, 2) == [b"a", b"b"]
    for store in stores:
        await store.close()


async def test_a_database_before_checkpoints_migrates_and_keeps_its_runs(
    postgres_url: str,
) -> None:
    await make_old(postgres_url, version=2)
    with pytest.raises(
        SchemaOutdated, match=f"schema is version 2, this gateway's is {SCHEMA_VERSION}"
    ):
        await PostgresStore(postgres_url, "a").start()
    assert await version_of(postgres_url) == 2
    store = PostgresStore(postgres_url, "a", migrate=True)
    await store.start()
    try:
        assert await version_of(postgres_url) == SCHEMA_VERSION
        old = await store.find_request("req-old")
        assert old is not None and old.state is RunState.DONE and old.episode == 2
        assert (old.checkpoint_episode, old.restarts, old.parked) == (0, 0, False)
        assert await store.read_episodes("old", 1, 2) == [b"a", b"b"]
        assert await store.list_checkpoints("old") == []
        assert await store.add_checkpoint(checkpoint("old", 2), keep=1) == []
        migrated = await store.get_run("old")
        assert migrated is not None and migrated.checkpoint_episode == 2
    finally:
        await store.close()


async def test_the_migrate_command_and_the_gateway_refusal_are_one_line(
    postgres_url: str, postgres_server: object
) -> None:
    await make_old(postgres_url)
    refused = await asyncio.to_thread(
        gateway_cli, "--db", postgres_url, "--port", "0", "--http-port", "-1"
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "schema is version 1" in lines[0], refused.stderr
    migrated = await asyncio.to_thread(gateway_cli, "migrate", "--db", postgres_url)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.strip().endswith(f"migrated from schema version 1 to {SCHEMA_VERSION}")
    again = await asyncio.to_thread(gateway_cli, "migrate", "--db", postgres_url)
    assert again.stdout.strip().endswith(f"is at schema version {SCHEMA_VERSION} already")
    foreign = postgres_server.create_database("foreign")  # type: ignore[attr-defined]
    async with await psycopg.AsyncConnection.connect(foreign, autocommit=True) as conn:
        await conn.execute("CREATE TABLE invoices (id int)")
    bad = await asyncio.to_thread(gateway_cli, "migrate", "--db", foreign)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "invoices" in bad.stderr


@pytest.fixture
async def two(postgres_url: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    """Two replicas' stores on one database."""
    a, b = PostgresStore(postgres_url, "replica-a"), PostgresStore(postgres_url, "replica-b")
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_writes_are_fenced_by_the_owner_and_a_takeover_moves_them(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    leases_a, leases_b = Leases(a, 30), Leases(b, 30)
    run = make_run("r")
    await a.insert_run(run)
    claimed = await leases_a.claim_pending("r")
    assert claimed is not None and claimed.id == "r"
    assert await leases_b.claim_pending("r") is None  # no double start
    recs = records("r", 6)
    assert await append(a, recs[:3]) == [None] * 3
    outcomes = await append(b, recs[3:4])
    assert isinstance(outcomes[0], NotOwner)
    run.start("t", 1)
    with pytest.raises(NotOwner):
        await b.update_run(run)
    await a.update_run(run)
    assert await b.read_episodes("r", 1, 10) == [r.data for r in recs[:3]]
    # A's lease runs out (its replica died): B takes the run over; A writes nothing more.
    async with a.pool.connection() as conn:  # type: ignore[union-attr]
        await conn.execute("UPDATE runs SET lease_until = now() - interval '1 second'")
    assert await leases_b.orphans() == ["r"]
    taken = await leases_b.take_over("r")
    assert taken is not None and taken.episode == 3 and taken.state is RunState.RUNNING
    assert await leases_a.take_over("r") is None
    assert await leases_a.renew(["r"]) == set()
    assert isinstance((await append(a, recs[3:4]))[0], NotOwner)
    assert await append(b, recs[3:]) == [None] * 3
    stored = await a.get_run("r")
    assert stored is not None and stored.episode == 6


async def test_claims_expire_and_releases_and_controls_are_recorded(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    leases_a, leases_b = Leases(a, 30), Leases(b, 30)
    for run_id in ("p1", "p2"):
        await a.insert_run(make_run(run_id))
    assert [r.id for r in await leases_b.unclaimed_pending()] == ["p1", "p2"]
    assert await leases_a.claim_pending("p1") is not None
    assert [r.id for r in await leases_b.unclaimed_pending()] == ["p2"]
    await leases_a.release(["p1"])  # the trainer was busy
    assert [r.id for r in await leases_b.unclaimed_pending()] == ["p1", "p2"]
    requested = await leases_b.request("p2", RunState.STOPPED, None)
    assert requested is not None and not requested.owned and requested.state is RunState.PENDING
    again = await leases_b.request("p2", None, 3.0)
    assert again is not None and again.seq == requested.seq + 1
    control = await leases_a.control("p2")
    assert control is not None
    assert (control.state, control.speed, control.seq, control.applied) == (
        RunState.STOPPED,
        3.0,
        again.seq,
        0,
    )
    await leases_a.applied("p2", again.seq, "")
    control = await leases_a.control("p2")
    assert control is not None and (control.state, control.speed) == (None, None)
    assert control.applied == again.seq


@contextlib.asynccontextmanager
async def announced(
    postgres_url: str,
) -> AsyncIterator[tuple[PostgresStore, list[tuple[str, str]]]]:
    """A started store and the notifications heard on its database (listening already)."""
    store = PostgresStore(postgres_url, "a")
    await store.start()
    heard: list[tuple[str, str]] = []
    listening = asyncio.Event()

    async def listen() -> None:
        async for kind, run_id in notifications(postgres_url):
            if not kind:
                listening.set()
                continue
            heard.append((kind, run_id))

    listener = asyncio.create_task(listen())
    try:
        await asyncio.wait_for(listening.wait(), TIMEOUT)
        yield store, heard
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await store.close()


async def test_commits_and_changes_are_announced(postgres_url: str) -> None:
    async with announced(postgres_url) as (store, heard):
        run = make_run("n")
        await store.insert_run(run)
        await append(store, records("n", 3))
        run.start("t", 1)
        await store.update_run(run)
        await until(lambda: len(heard) >= 3, "3 notifications")
        assert heard == [("c", "n"), ("e", "n"), ("r", "n")]


async def test_checkpoint_writes_are_fenced_by_the_owner(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    leases_a, leases_b = Leases(a, 30), Leases(b, 30)
    run = make_run("r")
    await a.insert_run(run)
    # No owner yet: any replica may record (as update_run).
    assert await b.add_checkpoint(checkpoint("r", 1), keep=2) == []
    assert await leases_a.claim_pending("r") is not None
    assert await a.add_checkpoint(checkpoint("r", 2), keep=2) == []
    with pytest.raises(NotOwner):
        await b.add_checkpoint(checkpoint("r", 3), keep=2)
    with pytest.raises(NotOwner):
        await b.delete_checkpoints("r", [2])
    assert await listed(a, "r") == [1, 2]  # B wrote nothing, retention did not run
    stored = await a.get_run("r")
    assert stored is not None and stored.checkpoint_episode == 2
    run.start("t", 1)
    await a.update_run(run)
    # A's lease runs out: B takes the run over, and from then on only B records.
    async with a.pool.connection() as conn:  # type: ignore[union-attr]
        await conn.execute("UPDATE runs SET lease_until = now() - interval '1 second'")
    assert await leases_b.take_over("r") is not None
    with pytest.raises(NotOwner):
        await a.add_checkpoint(checkpoint("r", 4), keep=1)
    with pytest.raises(NotOwner):
        await a.delete_checkpoints("r", [1, 2])
    assert await b.add_checkpoint(checkpoint("r", 4), keep=2) == [1]
    await b.delete_checkpoints("r", [4])
    assert await listed(a, "r") == [2]
    stored = await a.get_run("r")
    assert stored is not None and stored.checkpoint_episode == 2
    assert a.writable and b.writable


async def test_a_checkpoint_is_announced(postgres_url: str) -> None:
    async with announced(postgres_url) as (store, heard):
        await store.insert_run(make_run("n"))
        await store.add_checkpoint(checkpoint("n", 3), keep=2)
        await store.add_checkpoint(checkpoint("n", 3), keep=2)  # a no-op: nothing to tell
        await store.delete_checkpoints("n", [3])
        await until(lambda: len(heard) >= 3, "3 notifications")
        await asyncio.sleep(0.1)
        assert heard == [("c", "n"), ("r", "n"), ("r", "n")]


async def test_a_database_before_long_runs_splits_its_details_and_gets_its_curve(
    postgres_url: str,
) -> None:
    await make_old(postgres_url, version=3)
    episodes = list(valid_episodes(40, detail_every=6))
    whole = [e.SerializeToString(deterministic=True) for e in episodes]
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute("DELETE FROM episodes")
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO episodes VALUES ('old', %s, %s)",
                [(n, data) for n, data in enumerate(whole, 1)],
            )
    store = PostgresStore(postgres_url, "a", migrate=True)
    await store.start()
    try:
        assert await version_of(postgres_url) == SCHEMA_VERSION
        assert await store.read_episodes("old", 1, 40) == whole  # byte for byte
        scalars = await store.read_episodes("old", 1, 40, scalars=True)
        assert not any(episode_pb2.Episode.FromString(d).HasField("imitation") for d in scalars)
        blocks = await store.read_curve_blocks("old", [(1, 0, 9), (2, 0, 1)])
        assert [(b.level, b.index) for b in blocks] == [(1, i) for i in range(10)] + [
            (2, 0),
            (2, 1),
        ]
        assert blocks[-1].count == 16 and blocks[-1].best_end == episodes[31].best_reward
    finally:
        await store.close()


async def recent_table(url: str) -> tuple[int, int]:
    """``recent_details``: its manual vacuums so far and its size with its TOAST (bytes)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT vacuum_count, pg_total_relation_size('recent_details') "
            "FROM pg_stat_user_tables WHERE relname = 'recent_details'"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


async def test_dropped_recent_details_are_vacuumed_and_their_space_reused(
    postgres_url: str,
) -> None:
    """The store vacuums ``recent_details`` itself every ``RECENT_VACUUM_ROWS`` deleted rows,
    so a long run's dropped motions make room for the next ones instead of waiting for
    autovacuum's next visit (a minute by default)."""
    rounds, chunk = 6, RECENT_VACUUM_ROWS // 2
    store = PostgresStore(postgres_url, "r1")
    await store.start()
    try:
        await store.insert_run(make_run("a"))
        # Every episode with a 60x11 motion, stored as recent (none kept for good).
        recs = detail_records("a", rounds * chunk, json_every=0, detail_every=1, kept=False)
        size_of_chunk = 0
        for r in range(rounds):
            first = r * chunk + 1
            assert await append(store, recs[r * chunk : (r + 1) * chunk]) == [None] * chunk
            if r == 0:
                size_of_chunk = (await recent_table(postgres_url))[1]
            assert await store.settle_details("a", first, first + chunk - 1, []) == chunk
            vacuums = (r + 1) * chunk // RECENT_VACUUM_ROWS
            assert (await recent_table(postgres_url))[0] <= vacuums  # never before the count

            async def vacuumed(at_least: int = vacuums) -> bool:
                return (await recent_table(postgres_url))[0] >= at_least

            await until(vacuumed, f"{vacuums} vacuum(s) of recent_details after round {r + 1}")
        _, size = await recent_table(postgres_url)
        # Without the vacuums the table would hold all six chunks' motions (dead); with them,
        # the space freed after every second chunk is taken again by the next two.
        assert size < 3 * size_of_chunk, (size, size_of_chunk)
        assert await store.read_episodes("a", 1, 2) == [r.scalars for r in recs[:2]]
    finally:
        await store.close()
