"""With ``--log-format json`` a real trainer process running a GRPO job writes only JSON lines.

GRPO pulls in transformers, TRL, datasets and torch, each with its own progress bars, logging
handlers and ``warnings.warn`` calls, and decodes images in DataLoader worker processes. Every
line the process writes to stderr must be one JSON log record; stdout carries only the start-up
announcement (``trainer listening on HOST:PORT``, which scripts wait for) and nothing from the
job. One image makes PIL warn inside a worker, so worker output is covered too.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
from typing import IO

import grpc
from PIL import Image

from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.grpo_fixtures import DATASET_FILE, grpo_data_root, tiny_grpo_task
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _pump(stream: IO[str], sink: list[str], first: queue.Queue[str] | None = None) -> None:
    for line in stream:
        sink.append(line)
        if first is not None:
            first.put(line)
            first = None


def _dataset_with_a_warning_image(root: pathlib.Path) -> str:
    """The demo rows, every image a palette PNG whose transparency makes PIL warn on decode."""
    demo = root / DATASET_FILE
    target = root / "datasets" / "json-logs"
    target.mkdir(parents=True, exist_ok=True)
    image = Image.new("P", (16, 16))
    image.putpalette([(i * 37) % 256 for i in range(768)])
    image.save(target / "palette.png", transparency=bytes(range(256)))
    rows = [json.loads(line) for line in demo.read_text().splitlines() if line.strip()]
    for row in rows:
        row["image_paths"] = ["palette.png"]
    (target / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return "datasets/json-logs/train.jsonl"


def test_grpo_job_writes_only_json_lines(grpo_data_root: pathlib.Path) -> None:
    dataset = _dataset_with_a_warning_image(grpo_data_root)
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    # Whatever the developer's environment asks for, the libraries' own output must not leak.
    env.pop("TRANSFORMERS_VERBOSITY", None)
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "trainer_service", "--port", "0", "--log-format", "json"),
            *("--device", "cpu", "--data-root", str(grpo_data_root), "--log-level", "debug"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout: list[str] = []
    stderr: list[str] = []
    first: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, stdout, first), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, stderr), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    try:
        listening = first.get(timeout=TIMEOUT).strip()
        assert listening.startswith("trainer listening on 127.0.0.1:"), listening
        port = int(listening.rsplit(":", 1)[1])
        # Two DataLoader workers: their output goes to the same stderr.
        request = trainer_service_pb2.TrainRequest(
            run_id="run-grpo-json",
            task=tiny_grpo_task(dataset_path=dataset, workers=2),
            config=episode_pb2.TrainConfig(max_episodes=3, seed=1),
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            responses = list(stub.Train(request, timeout=JOB_TIMEOUT))
        episodes = [r.episode for r in responses if r.WhichOneof("event") == "episode"]
        assert [e.episode for e in episodes] == [1, 2, 3]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
        for pump in pumps:
            pump.join(timeout=TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()
    assert stdout == [listening + "\n"], stdout
    assert stderr, "no log lines"
    records = []
    for line in stderr:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            everything = "".join(stderr)
            raise AssertionError(f"not a JSON line on stderr: {line!r}\n{everything}") from None
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
    # The job really ran through the GRPO stack and said so, in JSON.
    messages = [r["message"] for r in records]
    assert any("GRPO training started" in m for m in messages), messages
    assert any("GRPO training ended after 3 steps" in m for m in messages), messages
    # PIL's warning, raised while decoding in a worker process, arrived as a JSON record.
    warned = [
        r for r in records if r["logger"] == "py.warnings" and "Palette images" in r["message"]
    ]
    assert warned, messages
