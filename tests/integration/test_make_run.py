"""`make run`'s script (scripts/run.sh) starts both services, runs the demo and stops cleanly.

It runs exactly what a new user runs, with ports picked by the OS, an unpaced short demo and
STAY_UP=0 so the script returns once the demo is done.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_script(tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "PY": sys.executable,
        "VAR": str(tmp_path / "var"),
        "STAY_UP": "0",
        "GATEWAY_PORT": "0",
        "HTTP_PORT": "0",
        "TRAINER_PORT": "0",
        "GATEWAY_METRICS_PORT": "0",
        "TRAINER_METRICS_PORT": "0",
        **env,
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run.sh")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_demo_runs_watches_and_draws_pictures(tmp_path: pathlib.Path) -> None:
    result = run_script(tmp_path, DEMO_EPISODES="40", DEMO_RATE="-1")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "run " in out and "done after episode 40" in out
    for name, min_size in (("demo-curve.png", (400, 200)), ("demo-avatar.png", (400, 100))):
        path = tmp_path / "var" / name
        with Image.open(path) as image:
            assert image.size[0] >= min_size[0] and image.size[1] >= min_size[1]
            colours = image.convert("RGB").getcolors(maxcolors=1 << 24)
            assert colours is not None and len(colours) > 5, f"{name} looks blank"
    for recipe in ("list", "describe trainwire.v1.GatewayService", "WatchRun", "Health/Check"):
        assert recipe in out
    # Where the trained model is and how to download it: the run's final checkpoint.
    run_id = re.search(r"demo run (\w+):", out)
    assert run_id, out
    assert re.search(r"^40\s+\S+ \S+\s+[\d.]+ KiB\s+[0-9a-f]{64}$", out, re.M), out
    assert f"checkpoints/{run_id[1]}/" in out
    assert f"trainwire runs download {run_id[1]} --out" in out
    assert f"/v1/runs/{run_id[1]}/checkpoints/0:download" in out
    marker = tmp_path / "var" / "checkpoints" / run_id[1] / f"{40:012d}.json"
    assert marker.is_file(), "the demo's final checkpoint is not in var/checkpoints"
    assert re.search(
        r"Prometheus metrics: http://127.0.0.1:\d+/metrics \(gateway\), "
        r"http://127.0.0.1:\d+/metrics \(trainer\)",
        out,
    ), out
    assert "stopping services" in out
    gateway_log = (tmp_path / "var" / "logs" / "gateway.log").read_text()
    assert "gateway listening on" in gateway_log


def test_services_only_without_demo(tmp_path: pathlib.Path) -> None:
    result = run_script(tmp_path, DEMO="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo run" not in result.stdout
    assert "trainer  on 127.0.0.1:" in result.stdout and "gateway  on 127.0.0.1:" in result.stdout
    assert not (tmp_path / "var" / "demo-curve.png").exists()


def test_ctrl_c_of_make_run_in_a_terminal_stops_the_services_and_exits_0(
    tmp_path: pathlib.Path,
) -> None:
    """What a user does: `make run` in a terminal, then Ctrl+C. The services stop, and make
    exits 0 without `make: *** [run] Interrupt` / `Error 130`."""
    import pty
    import select
    import time

    environment = {
        **os.environ,
        "VAR": str(tmp_path / "var"),
        "DEMO": "0",
        "GATEWAY_PORT": "0",
        "HTTP_PORT": "0",
        "TRAINER_PORT": "0",
        "METRICS": "0",
    }
    pid, terminal = pty.fork()
    if pid == 0:  # the child: make in a terminal of its own
        os.chdir(REPO)
        os.execvpe("make", ["make", "run"], environment)
    output = b""
    interrupted = False
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([terminal], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(terminal, 4096)
                except OSError:  # the terminal closed: everything on it exited
                    break
                if not chunk:
                    break
                output += chunk
            if not interrupted and b"Ctrl+C stops them" in output:
                os.write(terminal, b"\x03")  # what the terminal sends for Ctrl+C
                interrupted = True
        else:  # hung: fail rather than wait for ever
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(terminal)
    text = output.decode(errors="replace")
    assert interrupted, text
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "stopping services" in text and "make: ***" not in text, text
    gateway_log = (tmp_path / "var" / "logs" / "gateway.log").read_text()
    assert "signal received: shutting down" in gateway_log, gateway_log
