"""The ``trainwire`` CLI through its entry point (``trainwire.cli.main`` and the installed console
script) against an in-process fake gateway on port 0 (tests/fakes_gateway.py)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeAlias

import pytest
from PIL import Image

from tests.fakes_gateway import FakeGateway, ThreadedServer, WatchFault, serve_in_thread, wait_until
from trainwire import client as tc
from trainwire.cli import main

pytestmark = pytest.mark.timeout(60)

Run: TypeAlias = tc.Run
_REPO = pathlib.Path(__file__).resolve().parents[2]
_SCRIPT = _REPO / ".venv" / "bin" / "trainwire"


@dataclass
class Gateway:
    """A served fake gateway and a client to it."""

    fake: FakeGateway
    served: ThreadedServer
    client: tc.GatewayClient

    @property
    def target(self) -> str:
        return self.served.target

    def cli(self, *argv: str) -> int:
        return main(["--gateway", self.target, *argv])


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., Gateway]]:
    stack: list[tuple[tc.GatewayClient, AbstractContextManager[ThreadedServer]]] = []

    def make(**options: Any) -> Gateway:
        fake = FakeGateway(**options)
        context = serve_in_thread(fake)
        served = context.__enter__()
        client = tc.GatewayClient(served.target, timeout=5)
        stack.append((client, context))
        return Gateway(fake, served, client)

    yield make
    for client, context in reversed(stack):
        client.close()
        context.__exit__(None, None, None)


@pytest.fixture
def gateway(make_gateway: Callable[..., Gateway]) -> Gateway:
    """A gateway whose runs publish only when a test says so."""
    return make_gateway(publish_interval=None, keepalive_interval=0.05)


def _create(gw: Gateway, episodes: int = 40, clip: str = "wave") -> str:
    run = gw.client.create_run(tc.imitation_task(clip=clip), tc.train_config(episodes))
    return run.id


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_runs_create_get_list_control_and_delete(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gateway.cli("runs", "create", "imitation", "--clip", "wave", "-q", "--speed", "2") == 0
    run_id = capsys.readouterr().out.strip()
    assert run_id == "r-1"
    assert gateway.cli("runs", "get", run_id) == 0
    out = capsys.readouterr().out
    assert "state:       RUNNING" in out and "task:        imitation wave/stickman" in out
    assert "rate:        10/s x 2" in out

    _create(gateway)
    assert gateway.cli("runs", "list") == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == ["ID", "r-2", "r-1"]

    for argv, expected in (
        (("pause", run_id), "paused: run r-1  PAUSED"),
        (("resume", run_id), "resumed: run r-1  RUNNING"),
        (("speed", run_id, "3.5"), "speed set: run r-1  RUNNING"),
        (("stop", run_id), "stopped: run r-1  STOPPED"),
    ):
        assert gateway.cli(*argv) == 0
        assert capsys.readouterr().out.startswith(expected)
    assert gateway.client.get_run(run_id).speed == 3.5

    assert gateway.cli("runs", "list", "--state", "stopped") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["ID", "r-1"]
    assert gateway.cli("runs", "delete", run_id) == 0
    assert capsys.readouterr().out.strip() == "deleted run r-1"
    assert gateway.cli("runs", "get", run_id) == 1
    captured = capsys.readouterr()
    assert captured.err == "error: NOT_FOUND: run r-1 not found\n"
    assert captured.out == ""


def test_json_output(gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "runs", "create", "imitation", "--clip", "jump", "--episodes", "30"]
    assert gateway.cli(*argv, "--name", "demo", "--request-id", "rq-1", "--seed", "4") == 0
    created = json.loads(capsys.readouterr().out)
    assert created["id"] == "r-1" and created["state"] == "STATE_RUNNING"
    assert created["task"]["imitation"]["clip_name"] == "jump"
    assert created["config"] == {"max_episodes": 30, "seed": 4}
    assert (created["display_name"], created["request_id"]) == ("demo", "rq-1")
    # The same request id returns the same run.
    assert gateway.cli(*argv, "--request-id", "rq-1") == 0
    assert json.loads(capsys.readouterr().out)["id"] == "r-1"

    assert gateway.cli("runs", "list", "--json") == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["r-1"]
    assert gateway.cli("runs", "get", "r-1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["episode"] == 0
    assert gateway.cli("runs", "get", "r-404", "--json") == 1
    error = json.loads(capsys.readouterr().err)["error"]
    assert error == {"code": "NOT_FOUND", "message": "run r-404 not found", "field_violations": []}


def test_create_grpo(gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "runs",
        "create",
        "grpo",
        "--model",
        "models/tiny-vlm",
        "--dataset",
        "data/rows.jsonl",
        "--reward",
        "exact_match, length",
        "--num-generations",
        "4",
        "--batch-size",
        "8",
        "--beta",
        "0.04",
        "--episodes",
        "3",
        "--json",
    ]
    assert gateway.cli(*argv) == 0
    grpo = json.loads(capsys.readouterr().out)["task"]["grpo"]
    assert grpo["model_path"] == "models/tiny-vlm"
    assert grpo["reward_functions"] == ["exact_match", "length"]
    assert (grpo["num_generations"], grpo["batch_size"], grpo["beta"]) == (4, 8, 0.04)
    assert "dataloader_num_workers" not in grpo  # unset optional fields stay unset


def test_a_bad_request_lists_its_fields_in_one_error(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["runs", "create", "imitation", "--clip", "moonwalk", "--group-size", "1"]
    assert gateway.cli(*argv, "--episodes", "0") == 1
    captured = capsys.readouterr()
    first, *rest = captured.err.splitlines()
    assert first.startswith("error: INVALID_ARGUMENT: invalid run: task.imitation.clip_name")
    assert "config.max_episodes" in first
    assert rest == []  # every field is already in the message
    assert "Traceback" not in captured.err and captured.out == ""


def test_illegal_transitions_and_an_unreachable_gateway(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.0)
    run_id = _create(gw, 5)  # published at once: DONE
    assert gw.cli("pause", run_id) == 1
    assert capsys.readouterr().err == (
        "error: FAILED_PRECONDITION: run r-1 is done; it cannot be changed\n"
    )
    port = _closed_port()
    assert main(["--gateway", f"127.0.0.1:{port}", "--timeout", "3", "runs", "list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: UNAVAILABLE: cannot reach the gateway at 127.0.0.1:{port}")
    assert len(err.splitlines()) == 1


def test_watch_shows_the_run_to_done_through_a_dropped_stream(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.002, faults=[WatchFault(0, 20)])
    run_id = _create(gw, 50)
    assert gw.cli("watch", run_id) == 0
    captured = capsys.readouterr()
    for part in (f"run {run_id}", "50/50", "DONE", "best", "resumed 1x"):
        assert part in captured.out, part
    assert captured.err.strip() == f"run {run_id} done after episode 50"
    assert [r.after_episode for r in gw.fake.watch_requests] == [0, 20]


def test_watch_exits_1_with_the_runs_error(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(
        publish_interval=0.001, fail_at=15, error_message="The training service stopped responding."
    )
    run_id = _create(gw, 50)
    assert gw.cli("watch", run_id) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out and "14/50" in captured.out
    assert captured.err.strip() == (
        f"error: run {run_id} failed: The training service stopped responding."
    )


def test_watch_exits_3_when_the_run_is_stopped(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(gateway)
    gateway.served.call(gateway.fake.publish(run_id, 5))
    with ThreadPoolExecutor(1) as pool:
        exit_code = pool.submit(gateway.cli, "watch", run_id)
        wait_until(gateway.served, gateway.fake, lambda: gateway.fake.active_watchers == 1)
        gateway.client.stop_run(run_id)
        assert exit_code.result(timeout=10) == 3
    captured = capsys.readouterr()
    assert "STOPPED" in captured.out and "5/40" in captured.out


def test_watch_json_prints_one_line_per_event_exactly_once(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(
        publish_interval=0.0, batch_size=8, faults=[WatchFault(0, 13), WatchFault(1, 4)]
    )
    run_id = _create(gw, 30)
    assert gw.cli("watch", run_id, "--json") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [next(iter(line)) for line in lines]
    assert [line["episode"]["episode"] for line in lines if "episode" in line] == list(range(1, 31))
    assert [line["reconnect"]["after_episode"] for line in lines if "reconnect" in line] == [
        13,
        17,
    ]
    assert kinds[-1] == "finished" and lines[-1]["finished"]["state"] == "STATE_DONE"
    assert kinds.count("caught_up") == 1
    assert lines[kinds.index("reconnect")]["reconnect"]["code"] == "UNAVAILABLE"


def test_watch_after_skips_earlier_episodes(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.0)
    run_id = _create(gw, 12)
    assert gw.cli("--json", "watch", run_id, "--after", "9") == 0
    episodes = [
        json.loads(line)["episode"]["episode"]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith('{"episode"')
    ]
    assert episodes == [10, 11, 12]


def test_create_and_watch(
    make_gateway: Callable[..., Gateway], capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.001)
    argv = ("runs", "create", "imitation", "--clip", "walk", "--episodes", "20", "--watch")
    assert gw.cli(*argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("created run r-1") and "20/20" in out and "DONE" in out


def test_plot_and_avatar_pictures(
    make_gateway: Callable[..., Gateway], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.0)
    run_id = _create(gw, 60)
    curve, strip, gif = tmp_path / "curve.png", tmp_path / "avatar.png", tmp_path / "avatar.gif"
    assert gw.cli("plot", run_id, "--out", str(curve)) == 0
    assert capsys.readouterr().out.strip() == f"wrote {curve} (60 episodes of run {run_id})"
    assert gw.cli("avatar", run_id, "--out", str(strip), "--poses", "5") == 0
    assert gw.cli("avatar", run_id, "--out", str(gif), "--gif", "--json") == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-1]) == {"run_id": run_id, "out": str(gif), "frames": 60}

    from trainwire import render

    image = Image.open(curve)
    assert image.format == "PNG" and image.size == (900, 500)
    colours = {c for _, c in image.convert("RGB").getcolors(1 << 16) or []}
    assert {render.MEAN, render.BEST, render.REWARD} <= colours
    image = Image.open(strip)
    assert image.format == "PNG" and image.size == (5 * 186 + 6, 236)  # 5 panels of 180 px
    colours = {c for _, c in image.convert("RGB").getcolors(1 << 16) or []}
    assert {render.TARGET, render.LEARNED} <= colours
    animation = Image.open(gif)
    assert animation.format == "GIF" and getattr(animation, "n_frames", 1) == 60


def test_picture_errors(
    gateway: Gateway, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = _create(gateway, 10)
    assert gateway.cli("plot", empty, "--out", str(tmp_path / "c.png")) == 1
    assert capsys.readouterr().err == f"error: run {empty} has no episodes yet; nothing to plot\n"
    gateway.served.call(gateway.fake.publish(empty, 5))
    assert gateway.cli("avatar", empty, "--out", str(tmp_path / "a.png")) == 1
    assert "has no learned motion yet" in capsys.readouterr().err
    assert gateway.cli("plot", empty, "--out", str(tmp_path / "missing" / "c.png")) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot write {tmp_path}/missing/c.png")

    grpo = gateway.client.create_run(tc.grpo_task(model="m", dataset="d.jsonl"), tc.train_config(3))
    assert gateway.cli("avatar", grpo.id, "--out", str(tmp_path / "a.png")) == 1
    assert capsys.readouterr().err == (
        f"error: run {grpo.id} is a grpo run; avatar needs an imitation run\n"
    )


def test_the_live_view_needs_rich_but_json_does_not(
    make_gateway: Callable[..., Gateway],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gw: Gateway = make_gateway(publish_interval=0.0)
    run_id = _create(gw, 3)
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)
    assert gw.cli("watch", run_id) == 1
    assert capsys.readouterr().err == (
        "error: the live view needs rich: pip install 'trainwire[cli]' (or use --json)\n"
    )
    assert gw.cli("watch", run_id, "--json") == 0
    assert len(capsys.readouterr().out.splitlines()) == 3 + 2  # episodes, caught_up, finished


# -- the installed console script --------------------------------------------------------------


def _env(target: str) -> dict[str, str]:
    env = dict(os.environ)
    env["TRAINWIRE_GATEWAY"] = target
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_console_script_reads_the_gateway_from_the_environment(gateway: Gateway) -> None:
    run_id = _create(gateway)
    done = subprocess.run(
        [str(_SCRIPT), "runs", "get", run_id, "--json"],
        env=_env(gateway.target),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["id"] == run_id
    missing = subprocess.run(
        [str(_SCRIPT), "stop", "r-404"],
        env=_env(gateway.target),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert missing.returncode == 1
    assert missing.stderr == "error: NOT_FOUND: run r-404 not found\n"


def test_ctrl_c_detaches_without_stopping_the_run(gateway: Gateway) -> None:
    run_id = _create(gateway)
    gateway.served.call(gateway.fake.publish(run_id, 3))
    process = subprocess.Popen(
        [str(_SCRIPT), "watch", run_id],
        env=_env(gateway.target),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(gateway.served, gateway.fake, lambda: gateway.fake.active_watchers == 1)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    # The client may have read fewer than the 3 published episodes when the signal lands.
    detached = re.fullmatch(
        rf"detached from run {run_id} after episode ([0-3]); it keeps running "
        rf"\(trainwire watch {run_id} --after \1 to follow it again\)\n",
        err,
    )
    assert detached is not None, err
    assert "Traceback" not in err
    assert f"{detached.group(1)}/40" in out
    wait_until(gateway.served, gateway.fake, lambda: gateway.fake.active_watchers == 0)
    assert gateway.client.get_run(run_id).state == Run.State.STATE_RUNNING
    assert "StopRun" not in gateway.fake.calls


def test_the_cli_imports_without_rich_pillow_or_torch(gateway: Gateway) -> None:
    _create(gateway)
    code = (
        "import sys\n"
        "sys.modules['rich'] = sys.modules['PIL'] = sys.modules['torch'] = None\n"
        "import trainwire.cli, trainwire.client, trainwire.render\n"
        "sys.exit(trainwire.cli.main(['runs', 'list']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(gateway.target),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].startswith("r-1")
