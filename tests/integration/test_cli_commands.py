"""The ``trainwire`` CLI through its entry point (``trainwire.cli.main`` and the installed console
script) against the real gateway (in-memory store, the fake trainer behind it; a ``FaultProxy``
where a test needs dropped streams or a count of open watch streams)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeAlias

import grpc
import pytest
from google.protobuf import json_format
from PIL import Image

from tests.fakes.fake_trainer import Script
from tests.fakes.live import LiveStack, live_stack
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.fakes.watch_faults import WatchFault
from trainwire import client as tc
from trainwire import motion
from trainwire.cli import main
from trainwire.v1 import gateway_service_pb2

pytestmark = pytest.mark.timeout(60)

Run: TypeAlias = tc.Run
_REPO = pathlib.Path(__file__).resolve().parents[2]
_SCRIPT = _REPO / ".venv" / "bin" / "trainwire"
_GRPCURL = _REPO / ".venv" / "bin" / "grpcurl"


@dataclass
class Gateway:
    """A real gateway, a client to it, and the CLI pointed at it."""

    stack: LiveStack
    client: tc.GatewayClient

    @property
    def target(self) -> str:
        return self.stack.target

    def cli(self, *argv: str, target: str | None = None) -> int:
        return main(["--gateway", target or self.target, *argv])

    def running(self, run_id: str) -> None:
        wait_for(lambda: self.client.get_run(run_id).state != Run.State.STATE_PENDING, "a slot")

    def finished(self, run_id: str) -> Run:
        final = list(self.client.watch(run_id, after_episode=5000))[-1]
        assert isinstance(final, Run)
        return final

    def published(self, run_id: str, count: int) -> None:
        wait_for(lambda: self.client.get_run(run_id).episode >= count, f"{count} episodes")


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with (
        live_stack(http_port=0) as stack,
        tc.GatewayClient(stack.target, timeout=TIMEOUT) as client,
    ):
        yield Gateway(stack, client)


def _create(gw: Gateway, episodes: int = 40, clip: str = "wave", rate: float = -1.0) -> str:
    run = gw.client.create_run(
        tc.imitation_task(clip=clip), tc.train_config(episodes), episodes_per_second=rate
    )
    return run.id


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_runs_create_get_list_control_and_delete(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("runs", "create", "imitation", "--clip", "wave", "-q", "--speed", "2", "--rate", "1")
    assert gateway.cli(*argv, "--episodes", "500") == 0
    run_id = capsys.readouterr().out.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", run_id), run_id
    gateway.running(run_id)
    assert gateway.cli("runs", "get", run_id) == 0
    out = capsys.readouterr().out
    assert "state:       RUNNING" in out and "task:        imitation wave/stickman" in out
    assert "rate:        1/s x 2" in out

    second = _create(gateway, rate=1.0)
    assert gateway.cli("runs", "list") == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == ["ID", second, run_id]

    for argv2, expected in (
        (("pause", run_id), f"paused: run {run_id}  PAUSED"),
        (("resume", run_id), f"resumed: run {run_id}  RUNNING"),
        (("speed", run_id, "3.5"), f"speed set: run {run_id}  RUNNING"),
        (("stop", run_id), f"stopped: run {run_id}  STOPPED"),
    ):
        assert gateway.cli(*argv2) == 0
        assert capsys.readouterr().out.startswith(expected)
    assert gateway.client.get_run(run_id).speed == 3.5

    assert gateway.cli("runs", "list", "--state", "stopped") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["ID", run_id]
    assert gateway.cli("runs", "delete", run_id) == 0
    assert capsys.readouterr().out.strip() == f"deleted run {run_id}"
    assert gateway.cli("runs", "get", run_id) == 1
    captured = capsys.readouterr()
    assert captured.err == f"error: NOT_FOUND: run '{run_id}' not found\n"
    assert captured.out == ""


def test_json_output_is_the_protobuf_json_mapping(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "runs", "create", "imitation", "--clip", "jump", "--episodes", "30"]
    argv += ["--name", "demo", "--request-id", "rq-1", "--seed", "4"]
    assert gateway.cli(*argv) == 0
    created = json.loads(capsys.readouterr().out)["run"]
    run_id = created["id"]
    assert created["state"] in ("STATE_PENDING", "STATE_RUNNING")
    assert created["task"]["imitation"]["clipName"] == "jump"
    assert created["config"] == {"maxEpisodes": 30, "seed": "4"}  # int64 as a string
    assert (created["displayName"], created["requestId"]) == ("demo", "rq-1")
    # The same request id returns the same run.
    assert gateway.cli(*argv) == 0
    assert json.loads(capsys.readouterr().out)["run"]["id"] == run_id

    assert gateway.cli("runs", "list", "--json") == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [run_id]
    gateway.finished(run_id)
    assert gateway.cli("runs", "get", run_id, "--json") == 0
    assert json.loads(capsys.readouterr().out)["run"]["episode"] == "30"
    assert gateway.cli("runs", "get", "r-404", "--json") == 1
    error = json.loads(capsys.readouterr().err)["error"]
    assert error == {
        "code": grpc.StatusCode.NOT_FOUND.value[0],
        "message": "run 'r-404' not found",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "RUN_NOT_FOUND",
                "domain": "trainwire",
                "metadata": {"run_id": "r-404"},
            }
        ],
    }


def test_cli_grpcurl_and_the_http_api_print_the_same_json(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(gateway, 12)
    gateway.finished(run_id)  # nothing changes any more
    assert gateway.cli("runs", "get", run_id, "--json") == 0
    from_cli = json.loads(capsys.readouterr().out)
    with urllib.request.urlopen(f"{gateway.stack.http}/v1/runs/{run_id}", timeout=TIMEOUT) as reply:
        from_http = json.loads(reply.read())
    done = subprocess.run(
        [
            str(_GRPCURL),
            "-plaintext",
            "-max-time",
            "20",
            "-d",
            json.dumps({"run_id": run_id}),
            gateway.target,
            "trainwire.v1.GatewayService/GetRun",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # The CLI prints what the HTTP API sends, byte for byte after parsing; grpcurl 1.8.6 keeps
    # the proto field names (its jsonpb OrigName), otherwise the same mapping, so it parses to
    # the same message.
    assert from_cli == from_http
    assert from_cli["run"]["config"]["maxEpisodes"] == 12
    from_grpcurl = json.loads(done.stdout)
    assert from_grpcurl["run"]["config"]["max_episodes"] == 12
    parse = json_format.ParseDict
    response = gateway_service_pb2.GetRunResponse
    assert parse(from_grpcurl, response()) == parse(from_cli, response())


def test_verbose_errors_show_the_grpc_code_and_details(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gateway.cli("-v", "runs", "get", "nope") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: NOT_FOUND: run 'nope' not found"
    assert "  grpc code: NOT_FOUND (5)" in err
    assert "  grpc details: run 'nope' not found" in err
    assert "  reason: RUN_NOT_FOUND (run_id=nope)" in err
    assert gateway.cli("runs", "get", "nope") == 1
    assert capsys.readouterr().err == "error: NOT_FOUND: run 'nope' not found\n"  # without -v


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
    grpo = json.loads(capsys.readouterr().out)["run"]["task"]["grpo"]
    assert grpo["modelPath"] == "models/tiny-vlm"
    assert grpo["rewardFunctions"] == ["exact_match", "length"]
    assert (grpo["numGenerations"], grpo["batchSize"], grpo["beta"]) == (4, 8, 0.04)
    assert "dataloaderNumWorkers" not in grpo  # unset optional fields stay unset


def test_a_bad_request_lists_its_fields_in_one_error(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["runs", "create", "imitation", "--clip", "moonwalk", "--group-size", "1"]
    assert gateway.cli(*argv, "--episodes", "0") == 1
    captured = capsys.readouterr()
    first, *rest = captured.err.splitlines()
    assert first.startswith("error: INVALID_ARGUMENT: ")
    assert "task.imitation.clip_name" in first and "config.max_episodes" in first
    assert "task.imitation.group_size" in first
    assert rest == []  # every field is already in the message
    assert "Traceback" not in captured.err and captured.out == ""


def test_illegal_transitions_and_an_unreachable_gateway(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(gateway, 5)
    gateway.finished(run_id)
    assert gateway.cli("pause", run_id) == 1
    assert capsys.readouterr().err == (
        f"error: FAILED_PRECONDITION: cannot pause run '{run_id}': it is DONE\n"
    )
    port = _closed_port()
    assert main(["--gateway", f"127.0.0.1:{port}", "--timeout", "3", "runs", "list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: UNAVAILABLE: cannot reach the gateway at 127.0.0.1:{port}")
    assert len(err.splitlines()) == 1


def test_watch_shows_the_run_to_done_through_a_dropped_stream(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = gateway.stack.proxy(WatchFault(0, 20))
    run_id = _create(gateway, 50, rate=100.0)
    assert gateway.cli("watch", run_id, target=proxy.target) == 0
    captured = capsys.readouterr()
    for part in (f"run {run_id}", "50/50", "DONE", "best", "resumed 1x"):
        assert part in captured.out, part
    assert captured.err.strip() == f"run {run_id} done after episode 50"
    assert [r.after_episode for r in proxy.watch_requests] == [0, 20]


def test_watch_exits_1_with_the_runs_error(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.stack.fake.push(
        Script(
            abort_after=14,
            abort_code=grpc.StatusCode.FAILED_PRECONDITION,
            localized="The model could not be loaded.",
        )
    )
    run_id = _create(gateway, 50)
    assert gateway.cli("watch", run_id) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out and "14/50" in captured.out
    assert captured.err.strip() == f"error: run {run_id} failed: The model could not be loaded."


def test_watch_exits_3_when_the_run_is_stopped(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.stack.fake.push(Script(hold_at=6))
    run_id = _create(gateway)
    gateway.published(run_id, 5)
    proxy = gateway.stack.proxy()
    with ThreadPoolExecutor(1) as pool:
        exit_code = pool.submit(gateway.cli, "watch", run_id, target=proxy.target)
        wait_for(lambda: proxy.active_watchers == 1, "the watcher")
        gateway.client.stop_run(run_id)
        assert exit_code.result(timeout=TIMEOUT) == 3
    captured = capsys.readouterr()
    assert "STOPPED" in captured.out and "5/40" in captured.out


def test_watch_json_prints_one_line_per_event_exactly_once(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(gateway, 30)
    gateway.finished(run_id)  # replayed as one batch: the proxy cuts it at 13, then at 4
    proxy = gateway.stack.proxy(WatchFault(0, 13), WatchFault(1, 4))
    assert gateway.cli("watch", run_id, "--json", target=proxy.target) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [next(iter(line)) for line in lines]
    episodes = [int(line["episode"]["episode"]) for line in lines if "episode" in line]
    assert episodes == list(range(1, 31))
    reconnects = [line["reconnect"] for line in lines if "reconnect" in line]
    assert [r["afterEpisode"] for r in reconnects] == ["13", "17"]
    assert {r["code"] for r in reconnects} == {"UNAVAILABLE"}
    assert kinds[-1] == "finished" and lines[-1]["finished"]["state"] == "STATE_DONE"
    assert kinds.count("caughtUp") == 1


def test_watch_after_skips_earlier_episodes(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(gateway, 12)
    gateway.finished(run_id)
    assert gateway.cli("--json", "watch", run_id, "--after", "9") == 0
    episodes = [
        int(json.loads(line)["episode"]["episode"])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith('{"episode"')
    ]
    assert episodes == [10, 11, 12]


def test_create_and_watch(gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("runs", "create", "imitation", "--clip", "walk", "--episodes", "20", "--rate", "-1")
    assert gateway.cli(*argv, "--watch") == 0
    out = capsys.readouterr().out
    assert out.startswith("created run ") and "20/20" in out and "DONE" in out


def test_plot_and_avatar_pictures(
    gateway: Gateway, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.stack.fake.push(Script(motion=True))  # the motion of the task's own rig and clip
    run_id = _create(gateway, 60)
    gateway.finished(run_id)
    curve, strip, gif = tmp_path / "curve.png", tmp_path / "avatar.png", tmp_path / "avatar.gif"
    assert gateway.cli("plot", run_id, "--out", str(curve)) == 0
    assert capsys.readouterr().out.strip() == f"wrote {curve} (60 episodes of run {run_id})"
    assert gateway.cli("avatar", run_id, "--out", str(strip), "--poses", "5") == 0
    assert gateway.cli("avatar", run_id, "--out", str(gif), "--gif", "--json") == 0
    lines = capsys.readouterr().out.splitlines()
    frames = motion.clip_from_task(tc.imitation_task(clip="wave").imitation).frame_count
    assert json.loads(lines[-1]) == {"runId": run_id, "out": str(gif), "frames": frames}

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
    assert animation.format == "GIF" and getattr(animation, "n_frames", 1) == frames


def test_picture_errors(
    gateway: Gateway, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.stack.fake.push(Script(hold_at=1), Script(hold_at=6))
    empty = _create(gateway, 10)
    gateway.running(empty)
    assert gateway.cli("plot", empty, "--out", str(tmp_path / "c.png")) == 1
    assert capsys.readouterr().err == f"error: run {empty} has no episodes yet; nothing to plot\n"
    five = _create(gateway, 10)  # episodes 1..5 carry no motion (every 10th does)
    gateway.published(five, 5)
    assert gateway.cli("avatar", five, "--out", str(tmp_path / "a.png")) == 1
    assert "has no learned motion yet" in capsys.readouterr().err
    assert gateway.cli("plot", five, "--out", str(tmp_path / "missing" / "c.png")) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot write {tmp_path}/missing/c.png")

    grpo = gateway.client.create_run(tc.grpo_task(model="m", dataset="d.jsonl"), tc.train_config(3))
    assert gateway.cli("avatar", grpo.id, "--out", str(tmp_path / "a.png")) == 1
    assert capsys.readouterr().err == (
        f"error: run {grpo.id} is a grpo run; avatar needs an imitation run\n"
    )


def test_the_live_view_needs_rich_but_json_does_not(
    gateway: Gateway,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = _create(gateway, 3)
    gateway.finished(run_id)
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)
    assert gateway.cli("watch", run_id) == 1
    assert capsys.readouterr().err == (
        "error: the live view needs rich: pip install 'trainwire[cli]' (or use --json)\n"
    )
    assert gateway.cli("watch", run_id, "--json") == 0
    assert len(capsys.readouterr().out.splitlines()) == 3 + 2  # episodes, caughtUp, finished


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
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run"]["id"] == run_id
    missing = subprocess.run(
        [str(_SCRIPT), "stop", "r-404"],
        env=_env(gateway.target),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert missing.returncode == 1
    assert missing.stderr == "error: NOT_FOUND: run 'r-404' not found\n"


def test_ctrl_c_detaches_without_stopping_the_run(gateway: Gateway) -> None:
    gateway.stack.fake.push(Script(hold_at=4))
    run_id = _create(gateway)
    gateway.published(run_id, 3)
    proxy = gateway.stack.proxy()
    process = subprocess.Popen(
        [str(_SCRIPT), "watch", run_id],
        env=_env(proxy.target),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: proxy.active_watchers == 1, "the watcher")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=TIMEOUT)
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
    wait_for(lambda: proxy.active_watchers == 0, "the stream's end")
    assert gateway.client.get_run(run_id).state == Run.State.STATE_RUNNING
    assert proxy.calls == ["GetRun", "WatchRun"]  # no StopRun: the run keeps going


def test_the_cli_imports_without_rich_pillow_or_torch(gateway: Gateway) -> None:
    run_id = _create(gateway)
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
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].startswith(run_id)
