"""`make run` prints the page's URL, and the demo run is visible there (scripts/run.sh with the
real trainer, ports picked by the OS, an unpaced short demo, services kept up until a signal)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.fakes.gateway_harness import ROOT
from tests.fakes.waiting import TIMEOUT

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
        return bytes(reply.read())


def _read_until(proc: subprocess.Popen[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Reads the script's output up to a line matching ``pattern`` (pytest-timeout bounds it)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"the script ended without {pattern!r}:\n{''.join(seen)}")


def test_make_run_prints_the_page_and_the_demo_run_is_there(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PY": sys.executable,
        "VAR": str(tmp_path / "var"),
        "STAY_UP": "1",
        "GATEWAY_PORT": "0",
        "TRAINER_PORT": "0",
        "HTTP_PORT": "0",
        "METRICS": "0",
        "DEMO_EPISODES": "40",
        "DEMO_RATE": "-1",
    }
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "run.sh")],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        page = _read_until(proc, r"^page     on (http://127\.0\.0\.1:\d+)/ ", seen).group(1)
        link = _read_until(proc, r"in a browser: (\S+)$", seen).group(1)
        run_id = link.rsplit("/", 1)[1]
        assert link == f"{page}/#/runs/{run_id}"
        assert b"/static/app.js" in _get(page + "/")
        listed = json.loads(_get(page + "/v1/runs"))
        assert run_id in [r["id"] for r in listed["runs"]]
        _read_until(proc, r"^Watch and steer runs in a browser: " + re.escape(page) + "/$", seen)
        _read_until(proc, r"^services are up", seen)
        run = json.loads(_get(f"{page}/v1/runs/{run_id}"))["run"]
        assert run["state"] == "STATE_DONE" and run["episode"] == "40"
        assert run["displayName"].startswith("demo: stickman learns to")
        proc.send_signal(signal.SIGTERM)  # the script stops both services, as on Ctrl+C
        proc.wait(60)
        assert proc.stdout is not None
        assert "stopping services" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
