"""The chaos soak's fault records: a fault that could not be done counts once, with why
(``bench/_chaos_load.py``), whether it raised before or after it started its log; a DONE run
without a checkpoint is explained by the store faults during its life
(``bench/_chaos_checks.py``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

# The soak's helpers import each other by their file names (bench/ is their folder).
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from _chaos_checks import store_faults_during
from _chaos_load import FaultLog, History, Plan, RunLog, Soak, Step, WatchLog


class _Cluster:
    """A cluster whose PostgreSQL restart crashes and that has no trainer."""

    trainers: list[object] = []
    gateways: list[object] = []

    def restart_postgres(self) -> None:
        raise subprocess.CalledProcessError(-11, ["pg_ctl", "-m", "fast", "stop"])


def _faults(*kinds: str) -> list[tuple[str, str, str, bool]]:
    plan = Plan(seed=1, seconds=1.0, faults=[Step(0.0, k, 0, 0.0, 0.0) for k in kinds], actions=[])
    soak = Soak(_Cluster(), plan)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(soak._fault_loop(), timeout=30))
    return [(f.kind, f.target, f.note, f.end >= f.start) for f in soak.history.faults]


def test_a_fault_that_raised_after_it_started_is_one_fault_with_its_note() -> None:
    (fault,) = _faults("postgres_restart")
    kind, target, note, ended = fault
    assert (kind, target, ended) == ("postgres_restart", "postgres", True)
    assert "CalledProcessError(-11" in note


def test_a_fault_that_raised_before_it_started_is_one_fault_with_its_note() -> None:
    # No trainer to choose: it raises before its log is started.
    (fault,) = _faults("trainer_kill")
    kind, target, note, ended = fault
    assert (kind, target, ended) == ("trainer_kill", "?", True)
    assert "ZeroDivisionError" in note


def test_each_failed_fault_counts_once() -> None:
    kinds = ("postgres_restart", "trainer_kill", "postgres_restart")
    assert [kind for kind, *_ in _faults(*kinds)] == list(kinds)


def test_the_store_faults_during_a_run_are_those_that_overlap_its_life() -> None:
    history = History(Plan(seed=1, seconds=60.0, faults=[], actions=[]), started=0.0)
    recorder = WatchLog("recorder", "r", "grpc", 0.0, 0)
    recorder.arrivals.update({1: 12.0, 4: 20.0})
    run = RunLog("r", "grpo", 10.0, 4, 0, 2, recorder)
    before = FaultLog("store_unwritable", "store", 2.0, 9.0)
    during = FaultLog("store_full", "store", 5.0, 12.0)
    ongoing = FaultLog("store_unwritable", "store", 15.0, 0.0)  # not healed yet
    after = FaultLog("store_unwritable", "store", 25.0, 30.0)
    other = FaultLog("trainer_kill", "trainer0", 11.0, 13.0)
    history.faults += [before, during, ongoing, after, other]
    assert store_faults_during(history, run) == [during, ongoing]
