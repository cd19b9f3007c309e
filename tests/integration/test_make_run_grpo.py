"""``DEMO=grpo make run`` builds the offline tiny VLM and data, trains, watches and draws a curve.

The same script a new user runs (scripts/run.sh), with ports picked by the OS, a short unpaced
demo and STAY_UP=0 so it returns once the demo is done. Learning itself is checked by
``test_grpo_learning.py``; this proves the wiring: the tools write what the run names, the
CLI's grpo run reaches DONE through both services, and the curve is drawn.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_demo_grpo_builds_trains_and_draws_the_curve(tmp_path: pathlib.Path) -> None:
    var = tmp_path / "var"
    environment = {
        **os.environ,
        "PY": sys.executable,
        "VAR": str(var),
        "DEMO": "grpo",
        "DEMO_EPISODES": "6",
        "DEMO_RATE": "-1",
        "STAY_UP": "0",
        "METRICS": "0",
        "GATEWAY_PORT": "0",
        "HTTP_PORT": "0",
        "TRAINER_PORT": "0",
    }
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "run.sh")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "GRPO from random weights" in out and "done after episode 6" in out, out
    assert (var / "data" / "models" / "tiny-vlm" / "config.json").is_file()
    assert (var / "data" / "datasets" / "colours" / "train.jsonl").is_file()
    with Image.open(var / "demo-curve.png") as image:
        assert image.size[0] >= 400 and image.size[1] >= 200
        colours = image.convert("RGB").getcolors(maxcolors=1 << 24)
        assert colours is not None and len(colours) > 5, "the curve looks blank"
