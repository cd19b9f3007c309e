"""The chaos soak, always on: ``bench/chaos.py`` for one minute with a fixed seed (two gateway
replicas on PostgreSQL, three trainers behind fault-injecting proxies, faults and actions from
the seed's schedule, one short GRPO run), and every invariant it checks holds: 0 violations.
The full soak (``make soak``) runs ten minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import postgres_fixtures
from tests.fakes.gateway_harness import ROOT
from tests.grpo_fixtures import grpo_data_root

SEED = 11
MINUTES = 1

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not postgres_fixtures.ENABLED, reason="TRAINWIRE_POSTGRES_TESTS=0"),
]

__all__ = ["grpo_data_root"]  # the session fixture (the tiny VLM, built once), for pytest


def test_a_one_minute_chaos_soak_has_no_violation(tmp_path: Path, grpo_data_root: Path) -> None:
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--minutes",
            str(MINUTES),
            "--seed",
            str(SEED),
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(report_path),
            "--data-root",
            str(grpo_data_root),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    print(done.stdout)
    assert report_path.exists(), done.stderr[-5000:]
    report = json.loads(report_path.read_text())
    assert report["violations"] == [], done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    # It did something: faults of several kinds, runs that ended, watchers that watched.
    assert sum(report["faults"].values()) >= 3
    assert report["runs"] >= 3 and report["episodes"] > 0
    assert report["watchers"] > report["runs"]
