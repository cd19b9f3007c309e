"""The chaos soak's invariants, checked on the recorded history once every run ended, and its
one table (``bench/chaos.py``).

Each check adds a line per violation to ``report["violations"]``:

- *ended*: every run ended DONE or STOPPED, or ERROR with a message a fault explains (the
  trainer lost or its process gone, restarts spent, the store unreachable) and a fault of that
  kind during the run's life;
- *watchers*: every watcher saw its episodes exactly once and in order (after where it started,
  through the run's last when it saw ``finished``), each with the reward the store holds;
- *store*: the store holds each of a run's episodes once: base+1..N, N rows (read from
  PostgreSQL itself);
- *restarts*: restarts <= max_restarts;
- *checkpoints*: every recorded checkpoint's digest is that of its files in the store;
- *grpo*: a DONE GRPO run's final checkpoint, downloaded, loads with transformers (a process of
  its own);
- *drivers*: never two replicas driving one run (sampled every second, three samples in a row);
- *processes*: no job process outlived its trainer (killed) or the trainer's end of its job
  (every trainer has no job process left once every run ended and the detach grace passed);
- *memory*: gateway memory stayed bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
from _chaos_cluster import (
    DETACH_GRACE_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_RESTARTS,
    ROOT,
    Cluster,
    _env,
    alive,
)
from _chaos_load import FINAL, FaultLog, History, RunLog, State, pb

from trainwire import aio
from trainwire.errors import CheckpointNotFound
from trainwire.v1 import gateway_service_pb2_grpc
from trainwire_ops.checkpoints import canonical_tar_digest

#: Error messages a fault explains, with the fault kinds that can cause each.
TRAINER_FAULTS = {
    "trainer_kill",
    "trainer_stop",
    "proxy_blackhole",
    "proxy_reset",
    "proxy_drop",
    "proxy_delay",
}
EXPLAINED = [
    ("The training service stopped responding.", TRAINER_FAULTS),
    ("A process of the training job", TRAINER_FAULTS),
    ("Gave up after", TRAINER_FAULTS),
    ("Interrupted: the gateway restarted", {"gateway_kill"}),
    ("could not save this run's history", {"postgres_restart"}),
]
#: Gateway RSS bounds: absolute, and growth within one process's life.
MEMORY_CAP = 1536 << 20
GROWTH_SLACK = 96 << 20

_LOAD_MODEL = r"""
import sys
from transformers import AutoModelForImageTextToText, AutoProcessor
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], local_files_only=True)
AutoProcessor.from_pretrained(sys.argv[1], local_files_only=True)
print(type(model).__name__, sum(p.numel() for p in model.parameters()))
"""


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def check(cluster: Cluster, history: History) -> dict[str, Any]:
    violations: list[str] = []
    notes: list[str] = []
    gateway = next(g for g in cluster.gateways if g.up)
    channel = grpc.aio.insecure_channel(gateway.address)
    stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
    try:
        finals: dict[str, Any] = {}
        for run in history.runs.values():
            reply = await stub.GetRun(pb.GetRunRequest(run_id=run.id), timeout=10)
            finals[run.id] = reply.run
        violations += _ended(history, finals)
        stored = await asyncio.to_thread(_stored, cluster)
        violations += _store(history, finals, stored)
        violations += await _watchers(history, finals, stub)
        violations += [
            f"run {r}: {finals[r].restarts} restarts > {MAX_RESTARTS}"
            for r in finals
            if finals[r].restarts > MAX_RESTARTS
        ]
        checked, bad = await _checkpoints(cluster, history, stub)
        violations += bad
        notes.append(f"{checked} checkpoint digests verified")
        loaded, grpo_bad = await _grpo(cluster, history, finals, gateway.address)
        violations += grpo_bad
        notes.append(loaded)
    finally:
        await channel.close()
    violations += history.two_drivers
    violations += history.leftovers
    violations += history.undrained
    violations += await asyncio.to_thread(_no_job_processes, cluster)
    violations += _memory(cluster)
    return _report(history, finals, violations, notes, cluster)


def _fault_kinds_during(history: History, run: RunLog, final: Any) -> set[str]:
    """The kinds of the faults whose time overlapped the run's life (a second of slack)."""
    end = run.created + 1e9
    if final.HasField("end_time"):
        end = time.monotonic() - (time.time() - final.end_time.ToNanoseconds() / 1e9)
    return {
        f.kind
        for f in history.faults
        if f.start <= end + 1 and max(f.end, f.start) >= run.created - 1
    }


def _ended(history: History, finals: dict[str, Any]) -> list[str]:
    found = []
    for run in history.runs.values():
        final = finals[run.id]
        if final.state not in FINAL:
            found.append(f"run {run.id}: not ended ({State.Name(final.state)})")
            continue
        if final.state == State.STATE_STOPPED and not run.stopped_by_us:
            found.append(f"run {run.id}: STOPPED, but nobody stopped it")
        if final.state != State.STATE_ERROR:
            continue
        during = _fault_kinds_during(history, run, final)
        message = final.error_message
        causes = [kinds for text, kinds in EXPLAINED if text in message]
        if not causes or not any(kinds & during for kinds in causes):
            found.append(
                f"run {run.id}: ERROR {message!r} not explained by the faults during it "
                f"({', '.join(sorted(during)) or 'none'})"
            )
    return found


def _stored(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    import psycopg

    with psycopg.connect(cluster.db_url) as conn:
        rows = conn.execute(
            "SELECT run_id, count(*), min(episode), max(episode) FROM episodes GROUP BY run_id"
        ).fetchall()
    return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}


def _store(
    history: History, finals: dict[str, Any], stored: dict[str, tuple[int, int, int]]
) -> list[str]:
    found = []
    for run in history.runs.values():
        final = finals[run.id]
        n = int(final.episode)
        count, first, last = stored.get(run.id, (0, run.base + 1, run.base))
        if n == run.base:
            if count:
                found.append(f"run {run.id}: {count} stored episodes, none published")
            continue
        if (count, first, last) != (n - run.base, run.base + 1, n):
            found.append(
                f"run {run.id}: the store holds {count} episodes {first}..{last}; "
                f"published {run.base + 1}..{n}"
            )
    return found


async def _replay(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, run_id: str
) -> dict[int, float]:
    rewards: dict[int, float] = {}
    call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=120)
    async for message in call:
        kind = message.WhichOneof("event")
        episodes = (
            [message.episode]
            if kind == "episode"
            else list(message.batch.episodes)
            if kind == "batch"
            else []
        )
        for episode in episodes:
            if episode.episode in rewards:
                rewards[-1] = 1.0  # a duplicate: caught below
            rewards[episode.episode] = episode.reward
    return rewards


async def _watchers(
    history: History, finals: dict[str, Any], stub: gateway_service_pb2_grpc.GatewayServiceStub
) -> list[str]:
    found = []
    truth: dict[str, dict[int, float]] = {}
    for run in history.runs.values():
        truth[run.id] = await _replay(stub, run.id)
        expected = list(range(run.base + 1, int(finals[run.id].episode) + 1))
        if sorted(truth[run.id]) != expected:
            found.append(f"run {run.id}: a replay from the store is not {run.base + 1}..N once")
    for log in history.watchers:
        run = history.runs[log.run_id]
        numbers = [e for e, _ in log.episodes]
        first = max(log.start_after, run.base) + 1
        expected = list(range(first, first + len(numbers)))
        if numbers != expected:
            gap = next(
                (i for i, (a, b) in enumerate(zip(numbers, expected, strict=False)) if a != b), None
            )
            at = "" if gap is None else f" (at #{gap}: {numbers[gap]} for {expected[gap]})"
            found.append(
                f"watcher {log.name} of run {log.run_id}: {len(numbers)} episodes not "
                f"{first}.. in order exactly once{at}"
            )
            continue
        if log.finished is not None and numbers and numbers[-1] != int(finals[run.id].episode):
            found.append(
                f"watcher {log.name} of run {log.run_id}: finished at {numbers[-1]}, run "
                f"ended at {finals[run.id].episode}"
            )
        if log.kind == "grpc" and log.name.startswith("recorder-") and log.finished is None:
            found.append(f"recorder of run {log.run_id} never saw finished")
        rewards = truth[run.id]
        wrong = [e for e, r in log.episodes if e in rewards and abs(rewards[e] - r) > 1e-6]
        if wrong:
            found.append(
                f"watcher {log.name} of run {log.run_id}: rewards differ from the store at "
                f"episodes {wrong[:5]}"
            )
    return found


async def _checkpoints(
    cluster: Cluster, history: History, stub: gateway_service_pb2_grpc.GatewayServiceStub
) -> tuple[int, list[str]]:
    found, checked = [], 0
    for run in history.runs.values():
        listed = await stub.ListCheckpoints(pb.ListCheckpointsRequest(run_id=run.id), timeout=10)
        for record in listed.checkpoints:
            directory = cluster.store / run.id / f"{record.episode:012d}"
            if not directory.is_dir():
                found.append(f"run {run.id}: checkpoint {record.episode} recorded, not stored")
                continue
            digest, size = await asyncio.to_thread(canonical_tar_digest, directory)
            checked += 1
            if (digest, size) != (record.sha256, record.size_bytes):
                found.append(
                    f"run {run.id}: checkpoint {record.episode} digest {digest[:12]} "
                    f"({size} B) is not the recorded {record.sha256[:12]} "
                    f"({record.size_bytes} B)"
                )
    return checked, found


def store_faults_during(history: History, run: RunLog) -> list[FaultLog]:
    """The faults of the checkpoint store (unwritable, full) during ``run``'s life: a run that
    ended DONE while its checkpoints could not be written has none to download."""
    end = max(run.recorder.arrivals.values(), default=time.monotonic())
    return [
        f
        for f in history.faults
        if f.kind in ("store_unwritable", "store_full")
        and f.start <= end
        and (f.end or end) >= run.created
    ]


async def _grpo(
    cluster: Cluster, history: History, finals: dict[str, Any], address: str
) -> tuple[str, list[str]]:
    done = [
        r
        for r in history.runs.values()
        if r.kind == "grpo" and finals[r.id].state == State.STATE_DONE
    ]
    if not done:
        states = [State.Name(finals[r.id].state) for r in history.runs.values() if r.kind == "grpo"]
        return f"no GRPO run ended DONE ({', '.join(states) or 'none'}): no model loaded", []
    found = []
    async with aio.GatewayClient(address) as client:
        for run in done:
            out = cluster.work / f"download-{run.id}"
            try:
                record = await client.download_checkpoint(run.id, out, timeout=300)
                break
            except CheckpointNotFound:
                if not store_faults_during(history, run):
                    found.append(f"run {run.id}: DONE with no checkpoint, and no store fault")
        else:
            return "no DONE GRPO run has a checkpoint: no model loaded", found
    model = next((p.parent for p in out.rglob("config.json")), None)
    if model is None:
        return "", [f"run {run.id}: its downloaded checkpoint has no model"]
    loaded = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _LOAD_MODEL, str(model)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    if loaded.returncode != 0:
        found.append(f"run {run.id}: its final model does not load: {loaded.stderr[-500:]}")
    what = loaded.stdout.strip()
    return f"GRPO run {run.id}: final checkpoint {record.episode} loads ({what})", found


def _job_processes(cluster: Cluster) -> list[Any]:
    """Every job process (a GRPO rank names its trainer's pid in its title) of any trainer
    process the soak started, orphans of killed ones included."""
    import psutil

    titles = [f"trainer {pid})" for pid in cluster.trainer_pids]
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if "(GRPO rank" in line and any(t in line for t in titles) and alive(process):
            found.append(process)
    return found


def _no_job_processes(cluster: Cluster) -> list[str]:
    """Once every run ended, every job process ends within the detach grace."""
    deadline = time.monotonic() + DETACH_GRACE_S + 20.0
    while True:
        left = _job_processes(cluster)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return [
        f"job process {p.pid} ({' '.join(p.cmdline())[:100]}) left after every run ended"
        for p in left
        if alive(p)
    ]


def _memory(cluster: Cluster) -> list[str]:
    found = []
    for gateway in cluster.gateways:
        by_pid: dict[int, list[tuple[float, int]]] = {}
        for pid, age, rss in gateway.memory:
            by_pid.setdefault(pid, []).append((age, rss))
        for pid, samples in by_pid.items():
            peak = max(r for _, r in samples)
            if peak > MEMORY_CAP:
                found.append(f"gateway{gateway.index} pid {pid}: RSS {peak >> 20} MiB")
            if samples[-1][0] >= 180:
                third = samples[-1][0] / 3
                early = max(r for a, r in samples if a <= third)
                late = max(r for a, r in samples if a >= 2 * third)
                if late > 1.5 * early + GROWTH_SLACK:
                    found.append(
                        f"gateway{gateway.index} pid {pid}: RSS grew {early >> 20} -> "
                        f"{late >> 20} MiB"
                    )
    return found


def _gateway_records(cluster: Cluster) -> Iterator[tuple[dict[str, Any], float]]:
    """Every JSON record of the gateways' logs that names a run, with when it was written
    (Unix seconds)."""
    import datetime

    for gateway in cluster.gateways:
        for line in gateway.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                if record.get("run_id"):
                    when = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
                    yield record, when.timestamp()


def _placements_logged(cluster: Cluster) -> dict[str, list[float]]:
    """run id -> when (Unix seconds) each placement again answered: the new trainer took the
    job (the gateways' ``placed_again`` log events)."""
    found: dict[str, list[float]] = {}
    for record, when in _gateway_records(cluster):
        if record.get("event") == "placed_again":
            found.setdefault(record["run_id"], []).append(when)
    return found


def _split(
    fault: FaultLog,
    run_id: str,
    recovered: float,
    restarts: dict[str, list[tuple[float, int]]],
    placements: dict[str, list[float]],
) -> tuple[float, float, float] | None:
    """A killed trainer's recovery of one run in its three parts (seconds): the fault to the
    restart decided (detection), to the job placed again and answering (waiting for a free
    slot, the placement), and to the run's next published episode (the job's start-up: its
    processes, the checkpoint restored, its first episode). None where the logs lack a part."""
    decided = min((t for t, _ in restarts.get(run_id, []) if t >= fault.wall - 0.5), default=None)
    if decided is None:
        return None
    placed = min((t for t in placements.get(run_id, []) if t >= decided), default=None)
    if placed is None:
        return None
    first = fault.wall + (recovered - fault.start)
    return max(0.0, decided - fault.wall), max(0.0, placed - decided), max(0.0, first - placed)


def _restarts_logged(cluster: Cluster) -> dict[str, list[tuple[float, int]]]:
    """run id -> (when, Unix seconds; the checkpoint episode it started from) of each restart
    (the gateways' logs)."""
    found: dict[str, list[tuple[float, int]]] = {}
    pattern = re.compile(r"restart \d+ of \d+ from the checkpoint at episode (\d+)")
    for record, when in _gateway_records(cluster):
        match = pattern.search(record.get("message", ""))
        if match:
            found.setdefault(record["run_id"], []).append((when, int(match.group(1))))
    return found


def _report(
    history: History,
    finals: dict[str, Any],
    violations: list[str],
    notes: list[str],
    cluster: Cluster,
) -> dict[str, Any]:
    recovery: dict[str, list[float]] = {}
    overlapped = 0
    restored = _restarts_logged(cluster)
    placements = _placements_logged(cluster)
    parts: list[tuple[float, float, float]] = []  # a killed trainer's recoveries, split
    for fault in history.faults:
        for run_id, reached in fault.hit.items():
            run = history.runs[run_id]
            after = [t for e, t in run.recorder.arrivals.items() if e > reached]
            if not after:
                continue
            recovered = min(after)
            if any(fault.start - 1 <= t <= recovered for t in run.paused_at):
                continue  # we paused it meanwhile: its pause, not the fault, held it
            if any(
                fault.start < later.start <= recovered and run_id in later.hit
                for later in history.faults
            ):
                overlapped += 1  # another fault hit it before it recovered from this one
                continue
            recovery.setdefault(fault.kind, []).append(max(0.0, recovered - fault.start))
            if fault.kind == "trainer_kill":
                split = _split(fault, run_id, recovered, restored, placements)
                if split is not None:
                    parts.append(split)
    faults: dict[str, int] = {}
    for fault in history.faults:
        faults[fault.kind] = faults.get(fault.kind, 0) + 1
    lost: list[tuple[int, int]] = []  # (episodes lost, checkpoint interval)
    for fault in history.faults:
        window = fault.wall + max(0.0, fault.end - fault.start) + 3 * HEARTBEAT_TIMEOUT_S + 5
        for run_id, trained in fault.trainer_episode.items():
            after = [e for t, e in restored.get(run_id, []) if fault.wall <= t <= window]
            if after:  # (a trainer cut off trains on past the fault: nothing lost then)
                lost.append((max(0, trained - after[0]), history.runs[run_id].checkpoint_every))
    startups = [
        r.recorder.arrivals[r.base + 1] - r.created
        for r in history.runs.values()
        if r.kind == "imitation" and (r.base + 1) in r.recorder.arrivals
    ]
    episodes = sum(int(f.episode) - history.runs[r].base for r, f in finals.items())
    states: dict[str, int] = {}
    for final in finals.values():
        name = State.Name(final.state).removeprefix("STATE_")
        states[name] = states.get(name, 0) + 1
    return {
        "violations": violations,
        "notes": notes,
        "faults": faults,
        "fault_notes": [f"{f.kind}: {f.note}" for f in history.faults if f.note]
        + [f"helper process: {h}" for h in history.helpers_left],
        "recoveries_overlapped": overlapped,
        "fault_timeline": [
            {
                "kind": f.kind,
                "target": f.target,
                "at_s": round(f.start - history.started, 1),
                "for_s": round(max(0.0, f.end - f.start), 1),
                "runs_hit": len(f.hit),
            }
            for f in history.faults
        ],
        "runs": len(finals),
        "run_states": states,
        "restarts": sum(f.restarts for f in finals.values()),
        "episodes": episodes,
        "watchers": len(history.watchers),
        "watcher_reconnects": sum(w.reconnects for w in history.watchers),
        "actions": history.actions,
        "action_refusals": history.action_refusals,
        "recovery_s": {
            kind: {
                "n": len(values),
                "p50": round(_p(values, 0.5), 2),
                "p99": round(_p(values, 0.99), 2),
                "max": round(max(values), 2),
            }
            for kind, values in sorted(recovery.items())
        },
        "trainer_kill_split_s": {
            name: {
                "n": len(parts),
                "p50": round(_p([p[i] for p in parts], 0.5), 2),
                "p99": round(_p([p[i] for p in parts], 0.99), 2),
            }
            for i, name in enumerate(("detect", "place", "start"))
        }
        if parts
        else {},
        "startup_s_p50": round(statistics.median(startups), 2) if startups else None,
        "work_lost": {
            "restarts": len(lost),
            "mean_episodes": round(statistics.mean(x for x, _ in lost), 1) if lost else None,
            "max_episodes": max((x for x, _ in lost), default=None),
            "mean_interval": round(statistics.mean(c for _, c in lost), 1) if lost else None,
            "within_interval": sum(1 for x, c in lost if x <= c),
        },
        "gateway_rss_mib_max": max(
            (rss >> 20 for g in cluster.gateways for _, _, rss in g.memory), default=0
        ),
    }


def table(report: dict[str, Any]) -> str:
    """The soak's one table."""
    lines = [
        f"chaos soak: seed {report.get('seed')}, {report.get('minutes')} min, commit "
        f"{report.get('commit')}, {report.get('machine')}, {report.get('wall_s')} s wall",
        "",
        f"{'fault':<18} {'injected':>8} {'measured':>8} {'p50 s':>7} {'p99 s':>7} {'max s':>7}",
    ]
    for kind, count in sorted(report["faults"].items()):
        rec = report["recovery_s"].get(kind)
        if rec:
            lines.append(
                f"{kind:<18} {count:>8} {rec['n']:>8} {rec['p50']:>7} {rec['p99']:>7} "
                f"{rec['max']:>7}"
            )
        else:
            lines.append(f"{kind:<18} {count:>8} {0:>8} {'-':>7} {'-':>7} {'-':>7}")
    split = report.get("trainer_kill_split_s") or {}
    if split:
        d, pl, st = split["detect"], split["place"], split["start"]
        lines += [
            "",
            f"trainer_kill recoveries, split ({d['n']}; p50 / p99 s): detected (restart "
            f"decided) {d['p50']} / {d['p99']}; placed again (a free slot, the new trainer "
            f"answering) {pl['p50']} / {pl['p99']}; job start-up to the next episode "
            f"{st['p50']} / {st['p99']}",
        ]
    lost = report["work_lost"]
    states = ", ".join(f"{k} {v}" for k, v in sorted(report["run_states"].items()))
    lines += [
        "",
        f"runs {report['runs']} ({states}), restarts {report['restarts']}, episodes "
        f"{report['episodes']}, watchers {report['watchers']} "
        f"({report['watcher_reconnects']} reconnects)",
        f"recoveries left out as another fault hit the run first: "
        f"{report['recoveries_overlapped']}",
        f"job start-up p50 {report['startup_s_p50']} s; gateway RSS max "
        f"{report['gateway_rss_mib_max']} MiB",
        f"work lost per restart: mean {lost['mean_episodes']} episodes, max "
        f"{lost['max_episodes']} (checkpoint interval mean {lost['mean_interval']}; "
        f"{lost['within_interval']} of {lost['restarts']} within one interval)",
        f"actions: {json.dumps(report['actions'], sort_keys=True)}",
        f"refused: {json.dumps(report['action_refusals'], sort_keys=True)}",
        *report["notes"],
        *report["fault_notes"],
        "",
        f"violations: {len(report['violations'])}",
        *(f"  - {v}" for v in report["violations"]),
    ]
    return "\n".join(lines)


__all__ = ["check", "pathlib", "table"]
