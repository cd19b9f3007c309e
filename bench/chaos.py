"""A chaos soak with invariants: real processes, faults and user actions for ``--minutes``, then
every invariant checked on the recorded history; prints one table and every violation (0 is
the bar; the exit status is 1 with any).

The cluster (``bench/_chaos_cluster.py``): two gateway replicas on PostgreSQL, three CPU
trainers sharing a checkpoint store, a fault-injecting TCP proxy between the gateways and each
trainer. The load (``bench/_chaos_load.py``): imitation runs and short GRPO runs on the tiny
VLM, created, paused, resumed, stopped, forked, sped up and given new hyperparameters; one
recording gRPC watcher per run and gRPC and server-sent-event watchers that come and go, some of
them slow. The faults: kill -9, SIGSTOP/SIGCONT of trainers; kill -9 of gateways; a PostgreSQL
restart; the checkpoint store unwritable or full for a while; proxy delays, drops, resets and
black holes. The same ``--seed`` gives the same schedule of faults and actions (what an action
picks among the runs then alive depends on how the system answered).

After the fault phase every fault is healed and the runs drain (resumed, sped up) to their end;
then ``bench/_chaos_checks.py`` checks: every run ended DONE or STOPPED, or ERROR with a message
a fault explains; every watcher saw its episodes exactly once, in order; the store holds each
episode once; restarts <= max_restarts; every recorded checkpoint's digest verifies; a
downloaded final GRPO model loads; one driver per run at any time; no job process outlived its
trainer; gateway memory stayed bounded. The table: faults injected by kind, runs, episodes,
violations, recovery time p50/p99 by fault kind (fault -> the run's first episode trained after
it), and the work lost per restart against the checkpoint interval.

Usage: ``python bench/chaos.py [--minutes 10] [--seed 1] [--json OUT] [--work DIR]``
(``make soak`` runs the full one; ``tests/integration/test_chaos_soak.py`` a one-minute one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import _chaos_checks
import _chaos_load
from _chaos_cluster import ROOT, Cluster, ensure_data_root


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _machine() -> str:
    cpus = len(__import__("os").sched_getaffinity(0))
    return f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"


async def soak(minutes: float, seed: int, work: pathlib.Path, data_root: pathlib.Path) -> dict:
    cluster = Cluster(work, ensure_data_root(data_root))
    await asyncio.to_thread(cluster.start)
    try:
        plan = _chaos_load.Plan.make(seed, minutes * 60.0)
        history = await _chaos_load.Soak(cluster, plan).run()
        report = await _chaos_checks.check(cluster, history)
    finally:
        await asyncio.to_thread(cluster.close)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="fault phase (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the report here")
    parser.add_argument("--work", type=pathlib.Path, help="work directory (default: a temp one)")
    parser.add_argument(
        "--data-root",
        type=pathlib.Path,
        default=ROOT / "var" / "chaos-data",
        help="where the tiny VLM and its dataset are built once (default var/chaos-data)",
    )
    args = parser.parse_args(argv)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="trainwire-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = asyncio.run(soak(args.minutes, args.seed, work, args.data_root))
    report["seed"] = args.seed
    report["minutes"] = args.minutes
    report["commit"] = _commit()
    report["machine"] = _machine()
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(_chaos_checks.table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True))
    if not report["violations"] and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory (logs): {work}", file=sys.stderr)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
