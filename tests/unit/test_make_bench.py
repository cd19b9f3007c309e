"""`make bench` runs the benchmarks' entry points only: never a `_` helper (one starts a gateway
and would not return), a GPU benchmark in its CPU dry mode, and not the ten-minute chaos soak
(that is `make soak`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_bench_runs_only_entry_points() -> None:
    plan = subprocess.run(
        ["make", "-n", "--no-print-directory", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    loop = re.search(r"for b in (.*?); do", plan)
    assert loop, plan
    benches = loop.group(1).split()
    assert "bench/_long_runs_gateway.py" not in benches
    assert not [b for b in benches if Path(b).name.startswith("_")]
    assert {"bench/contract_check.py", "bench/long_runs.py", "bench/gpu_real_size.py"} <= set(
        benches
    )
    for bench in benches:
        assert 'if __name__ == "__main__":' in (ROOT / bench).read_text(), bench
    expected = {
        p.as_posix()
        for p in (q.relative_to(ROOT) for q in (ROOT / "bench").glob("[!_]*.py"))
        if 'if __name__ == "__main__":' in (ROOT / p).read_text()
    }
    assert "bench/chaos.py" in expected
    assert set(benches) == expected - {"bench/chaos.py"}
    assert 'gpu_real_size) args="--dry-run"' in plan
