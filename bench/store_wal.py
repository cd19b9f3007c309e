"""Store WAL benchmark: sustained unpaced ingest through the gateway, its WAL, and restarts.

Compares the legacy store thread (``LEGACY_REV``: group commit of whatever is queued, one
statement pair per episode, a PASSIVE checkpoint once a second, no limit on the WAL) with this
tree's, both in a real gateway process (``python -m gateway``; the legacy one through this
file's ``--legacy-gateway`` entry, which swaps the store thread in and runs the same ``main``),
fed by the scripted fake trainer in a child process. Per mode, two ingests on fresh databases:

(a) 40 runs x 5000 small episodes (no motion detail but on the last), created at once,
    unpaced: ingest episodes/s (first CreateRun to the last run finished) and the gateway
    process's CPU time per episode (steadier than the rate on a shared machine), the WAL file
    size sampled every 10 ms (peak) next to the database size at the end, store operations per
    commit (the gateway's own metrics), and the latency (trainer send -> watcher receive) of
    a probe run streaming 50 episodes/s alongside. Targets: WAL peak <= max(64 MiB, database);
    ingest episodes/s at least the legacy's.
(b) the first ingest ends with SIGTERM (clean shutdown), the second with kill -9 as soon as the
    last run finished (the WAL it leaves is shown); then ``python -m gateway`` (this tree)
    starts on a copy of what was left on disk: time from spawn to the first answers (GetRun
    and ListRuns).
    Target: kill -9 within 1.5x of the clean shutdown. The restarts take turns (each kind of
    restart once, five rounds) and the median of each kind is shown.

The machine is shared: ingests alternate between the modes, and the best rate of the two
ingests of a mode is shown. Run: ``.venv/bin/python bench/store_wal.py`` (about 5 minutes on
2 busy CPUs; ``BENCH_RUNS`` / ``BENCH_EPISODES`` shrink it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402
import psutil  # noqa: E402

import tests.fakes.gateway_harness as harness  # noqa: E402
from tests.fakes.gateway_harness import create_request, gateway_process  # noqa: E402
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

#: The last commit with the unbounded WAL; its StoreThread is the legacy mode.
LEGACY_REV = "b9529b65dabcc31b9778504fbe4b4c71ecae01bd"
RUNS = int(os.environ.get("BENCH_RUNS", "40"))
EPISODES = int(os.environ.get("BENCH_EPISODES", "5000"))
PROBE_INTERVAL_S = 0.02  # the probe run's trainer sends 50 episodes/s
SAMPLE_S = 0.01
RESTARTS = 5
MIB = 2**20
LEGACY_FLAG = "--legacy-gateway"
pb = gateway_service_pb2


# -- the legacy gateway (a child process) -----------------------------------------------------


def _legacy_module() -> ModuleType:
    """gateway/core/store.py as of LEGACY_REV, imported under another name."""
    source = subprocess.run(
        ["git", "-C", ROOT, "show", f"{LEGACY_REV}:gateway/core/store.py"],
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="store-legacy-") as tmp:
        path = os.path.join(tmp, "legacy_store.py")
        with open(path, "wb") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location("legacy_store", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["legacy_store"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def _legacy_gateway(argv: list[str]) -> int:
    """``python -m gateway ARGV`` with the legacy store thread over this tree's schema."""
    import sqlite3

    import gateway.core.store.sqlite_backend as backend
    from gateway.__main__ import main
    from gateway.core.store import SqliteStore

    legacy = _legacy_module()

    class LegacySqliteStore(SqliteStore):
        """This tree's schema and queries with the legacy WAL settings and checkpoint."""

        def __init__(self, path: str, migrate: bool = False) -> None:
            super().__init__(path, migrate)
            self.journal_size_limit(-1)  # the legacy store never truncated the WAL file

        def checkpoint(self) -> tuple[int, int, int]:
            conn = sqlite3.connect(self.path, isolation_level=None)
            try:
                busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            finally:
                conn.close()
            return busy, frames, copied

    class LegacyStoreThread(legacy.StoreThread):  # type: ignore[name-defined,misc]
        """The legacy thread, built the way this tree's backend builds its thread."""

        def __init__(
            self, store: Any, loop: Any, on_commit: Any = None, *, wal_limit_bytes: Any = None
        ) -> None:
            del wal_limit_bytes  # the legacy thread knew no limit
            super().__init__(store, loop, on_commit)

    backend.SqliteStore = LegacySqliteStore  # type: ignore[misc]
    backend.StoreThread = LegacyStoreThread  # type: ignore[misc]
    return main(argv)


# -- the fake trainer (a child process) -------------------------------------------------------


def _trainer_main(conn: Connection) -> None:
    from tests.fakes.fake_trainer import FakeTrainer, Script

    small = 10**9  # motion detail on the last episode only
    fake = FakeTrainer(slots=RUNS + 8, default=Script(detail_every=small))
    conn.send(fake.start())
    while conn.recv() is not None:  # "probe": the next Train call is the probe's
        fake.push(Script(interval=PROBE_INTERVAL_S, detail_every=small))
        conn.send("ok")
    fake.kill()


# -- one ingest -------------------------------------------------------------------------------


class WalSampler:
    """Samples the size of ``DB-wal`` on a thread; ``peak`` is the largest size seen."""

    def __init__(self, db: Path) -> None:
        self.wal = Path(f"{db}-wal")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(FileNotFoundError):
                self.peak = max(self.peak, self.wal.stat().st_size)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def _finished(stub: Any, run_id: str) -> None:
    call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id, after_episode=EPISODES), timeout=900)
    async for msg in call:
        if msg.WhichOneof("event") == "finished":
            return


async def _probe(stub: Any, run_id: str, latencies: list[tuple[float, float]]) -> None:
    """Records (receive time, latency in ms) of every live episode of the probe run."""
    call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=900)
    live = False
    async for msg in call:
        kind = msg.WhichOneof("event")
        if kind == "caught_up":
            live = True
        elif live and kind in ("episode", "batch"):
            now = time.time_ns()
            episodes = [msg.episode] if kind == "episode" else list(msg.batch.episodes)
            for ep in episodes:
                latencies.append((now / 1e9, (now - ep.produce_time.ToNanoseconds()) / 1e6))


async def _ingest(
    legacy: bool, kill: bool, trainer_conn: Connection, trainer: str, tmp: Path
) -> dict[str, Any]:
    name = f"{'legacy' if legacy else 'bounded'}-{'kill' if kill else 'clean'}"
    db, log = tmp / f"{name}.sqlite3", tmp / f"{name}.log"
    command = (os.path.abspath(__file__), LEGACY_FLAG) if legacy else ("-m", "gateway")
    flags = ("--db", str(db), "--metrics-port", "0", "--log-level", "WARNING")
    async with gateway_process(trainer, log, *flags, command=command) as (proc, address):
        assert proc.stdout is not None
        line = ""
        while not line.startswith("gateway metrics on "):
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, f"the gateway ended; log: {log.read_text()[-2000:]}"
        url = line.split()[-1]
        sampler = WalSampler(db)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            trainer_conn.send("probe")
            trainer_conn.recv()
            probe_id = (
                await stub.CreateRun(create_request(max_episodes=EPISODES), timeout=30)
            ).run.id
            latencies: list[tuple[float, float]] = []
            probe = asyncio.create_task(_probe(stub, probe_id, latencies))
            start = time.perf_counter()
            t0 = time.time()
            ids = [
                (await stub.CreateRun(create_request(max_episodes=EPISODES), timeout=30)).run.id
                for _ in range(RUNS)
            ]
            await asyncio.gather(*(_finished(stub, run_id) for run_id in ids))
            elapsed = time.perf_counter() - start
            t1 = time.time()
            cpu = psutil.Process(proc.pid).cpu_times()
            metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            await stub.StopRun(pb.StopRunRequest(run_id=probe_id), timeout=30)
            # kill -9: no chance to flush or checkpoint anything
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            await proc.wait()
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        peak = sampler.stop()
    during = sorted(ms for at, ms in latencies if t0 <= at <= t1)
    ops = _metric(metrics, "trainwire_gateway_store_operations_total")
    commits = _metric(metrics, "trainwire_gateway_store_commits_total")
    return {
        "rate": RUNS * EPISODES / elapsed,
        "cpu": (cpu.user + cpu.system) / (RUNS * EPISODES),
        "peak": peak,
        "db": db.stat().st_size,
        "ops_per_commit": ops / commits,
        "probe": during,
        "wal_left": Path(f"{db}-wal").stat().st_size if Path(f"{db}-wal").exists() else 0,
        "files": (db, ids[-1]),
        "restarts": [],
    }


async def _restart(db: Path, run_id: str, trainer: str, log: Path) -> float:
    """Seconds from spawning ``python -m gateway`` on a copy of ``db`` (and its WAL and
    shared-memory files, as left on disk) to its answers to GetRun and ListRuns."""
    copy = db.with_name(f"{db.stem}-copy.sqlite3")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{db}{suffix}").exists():
            shutil.copyfile(f"{db}{suffix}", f"{copy}{suffix}")
    start = time.perf_counter()
    async with (
        gateway_process(trainer, log, "--db", str(copy)) as (_, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=30)
        await stub.ListRuns(pb.ListRunsRequest(), timeout=30)
        elapsed = time.perf_counter() - start
    assert run.run.episode == EPISODES, run.run
    for suffix in ("", "-wal", "-shm", ".lock"):
        Path(f"{copy}{suffix}").unlink(missing_ok=True)
    return elapsed


# -- the report -------------------------------------------------------------------------------


def _row(label: str, *cells: str) -> None:
    print(f"{label:<46}" + "".join(f"{c:>16}" for c in cells))


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def main() -> None:
    harness.TIMEOUT = 120.0  # a gateway starting on a busy machine (the tests allow it 20 s)
    ctx = mp.get_context("spawn")
    trainer_conn, child = ctx.Pipe()
    trainer_proc = ctx.Process(target=_trainer_main, args=(child,), daemon=True)
    trainer_proc.start()
    trainer = trainer_conn.recv()
    tmp = Path(tempfile.mkdtemp(prefix="store-wal-bench-"))
    try:
        _legacy_module()
        modes = (True, False)
    except (OSError, subprocess.CalledProcessError):
        print(f"(git or {LEGACY_REV[:7]} not available: this tree only)")
        modes = (False,)
    print(
        f"{RUNS} runs x {EPISODES} small episodes, unpaced, + a 50 episodes/s probe run; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[tuple[bool, bool], dict[str, Any]] = {}
    done = False
    try:
        for kill in (False, True):
            for legacy in modes:
                results[legacy, kill] = await _ingest(legacy, kill, trainer_conn, trainer, tmp)
        # Round robin, so that every kind of restart sees the same load on the machine.
        for _ in range(RESTARTS):
            for result in results.values():
                db, run_id = result["files"]
                log = tmp / "restart.log"
                result["restarts"].append(await _restart(db, run_id, trainer, log))
        for result in results.values():
            result["restart"] = statistics.median(result["restarts"])
        done = True
    finally:
        trainer_conn.send(None)
        trainer_proc.join(10)
        if done:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"(databases and logs kept in {tmp})")

    cols = [m for m in (True, False) if m in modes]
    header = [f"legacy {LEGACY_REV[:7]}" if m else "bounded" for m in cols]
    print()
    _row("", *header, *(["bounded/legacy"] if len(cols) == 2 else []))

    def line(label: str, fmt: str, value: Any, ratio: bool = True) -> None:
        cells = [value(results[m, False], results[m, True]) for m in cols]
        extra = [f"{cells[1] / cells[0]:.2f}x"] if ratio and len(cells) == 2 else []
        _row(label, *(fmt.format(c) for c in cells), *extra)

    line("ingest episodes/s (best of 2)", "{:,.0f}", lambda a, b: max(a["rate"], b["rate"]))
    line(
        "gateway CPU per episode (us, mean of 2)",
        "{:.0f}",
        lambda a, b: (a["cpu"] + b["cpu"]) / 2 * 1e6,
    )
    line("WAL peak, sampled (MiB)", "{:.1f}", lambda a, b: max(a["peak"], b["peak"]) / MIB)
    line("database at the end (MiB)", "{:.1f}", lambda a, b: max(a["db"], b["db"]) / MIB, False)
    line(
        "WAL peak / max(64 MiB, database) (<= 1)",
        "{:.2f}",
        lambda a, b: max(r["peak"] / max(64 * MIB, r["db"]) for r in (a, b)),
        False,
    )
    line(
        "store operations per commit",
        "{:.1f}",
        lambda a, b: (a["ops_per_commit"] + b["ops_per_commit"]) / 2,
    )
    for label, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        line(
            f"probe latency during ingest, {label} (ms)",
            "{:.1f}",
            lambda a, b, q=q: _quantile(sorted(a["probe"] + b["probe"]), q),
        )
    print()
    line("WAL left after kill -9 (MiB)", "{:.1f}", lambda _, b: b["wal_left"] / MIB, False)
    line("first answer after a clean shutdown (ms)", "{:.0f}", lambda a, _: a["restart"] * 1e3)
    line("first answer after kill -9 (ms)", "{:.0f}", lambda _, b: b["restart"] * 1e3)
    line(
        "kill -9 / clean shutdown (<= 1.5)",
        "{:.2f}x",
        lambda a, b: b["restart"] / a["restart"],
        False,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == LEGACY_FLAG:
        sys.exit(_legacy_gateway(sys.argv[2:]))
    asyncio.run(main())
