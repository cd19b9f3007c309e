"""``bash bench/gpu_check.sh --dry-run``: the command a user runs on a bare GPU machine, run here on
the CPU at tiny size, so a broken import, flag or path in it fails the suite rather than a GPU
machine's session.

The dry run runs every part the GPU check runs (the preflight, ``tests/gpu``, which skips
without CUDA once collected, ``bench/gpu_grpo.sh`` and ``bench/gpu_real_size.py``: a Trainwire
job through a trainer process and the gateway against bare TRL, full fine-tuning and LoRA) with
the repository's interpreter and no carried wheels, and prints the same table.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARTS = ("preflight", "tests/gpu", "bench/gpu_grpo.sh", "bench/gpu_real_size.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _check(*args: str, logs: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "bench/gpu_check.sh", *args, "--logs", str(logs)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=1100,
    )


def _table(stdout: str) -> dict[str, list[str]]:
    """The closing table's rows by part: [status, seconds, figures...]."""
    lines = stdout.split("== gpu_check (", 1)[1].splitlines()[2:]
    return {line.split()[0]: line.split()[1:] for line in lines if line.strip()}


def test_the_gpu_check_passes_its_dry_run(
    tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The suite's temporary root, open to others as the embedded PostgreSQL needs it: the
    # check's own pytest must leave it so (one that shares it makes it 0700 again).
    base = tmp_path_factory.getbasetemp()
    shared = next((p for p in base.parents if p.name.startswith("pytest-of-")), base)
    shared.chmod(shared.stat().st_mode | 0o055)
    done = _check("--dry-run", logs=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert shared.stat().st_mode & 0o055 == 0o055, oct(shared.stat().st_mode)
    rows = _table(done.stdout)
    assert tuple(rows) == PARTS, rows
    assert all(row[0] == "ok" for row in rows.values()), rows
    # Collected (a broken import fails here), then skipped: no CUDA.
    assert "skipped" in rows["tests/gpu"] and "failed" not in rows["tests/gpu"], rows
    assert any(f.startswith("median_step_time_ms=") for f in rows["bench/gpu_grpo.sh"]), rows
    assert "status=dry-run" in rows["bench/gpu_real_size.py"], rows
    # Both sides trained both modes, every step timed.
    figures = json.loads((tmp_path / "real_size.json").read_text())
    assert set(figures["rows"]) == {
        "trainwire/full",
        "bare TRL/full",
        "trainwire/lora",
        "bare TRL/lora",
    }
    for row in figures["rows"].values():
        assert row["steps_per_s"] > 0 and len(row["walls_s"]) == figures["size"]["steps"]
    assert set(figures["ratios"]) == {"full_steps_ratio", "lora_steps_ratio"}
    assert (tmp_path / "real_size_trainer.log").is_file()


def test_a_part_that_fails_fails_the_check(tmp_path: pathlib.Path) -> None:
    done = _check("--dry-run", logs=tmp_path, PYTHON="false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert _table(done.stdout)["preflight"][0] == "FAIL", done.stdout
