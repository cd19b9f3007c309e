"""The CLI's pieces without a server: argument parsing, text and JSON formatting, and the live
view's bookkeeping (rate, ETA, connection indicator)."""

from __future__ import annotations

import argparse
import json
import shlex
from argparse import SUPPRESS
from typing import TypeAlias

import grpc
import pytest
from google.protobuf import json_format

from trainwire import client as tc
from trainwire.cli import _format, build_parser
from trainwire.cli._watch import WatchView
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2, gateway_service_pb2

Run: TypeAlias = gateway_service_pb2.Run


def test_common_options_go_before_or_after_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINWIRE_GATEWAY", raising=False)
    parser = build_parser()
    before = parser.parse_args(["--gateway", "h:1", "--json", "--timeout", "3", "runs", "get", "x"])
    after = parser.parse_args(["runs", "get", "x", "--gateway", "h:1", "--json", "--timeout", "3"])
    for args in (before, after):
        assert (args.gateway, args.json, args.timeout, args.run_id) == ("h:1", True, 3.0, "x")
    plain = parser.parse_args(["pause", "r-1"])
    assert (plain.gateway, plain.json, plain.timeout) == ("localhost:50051", False, 10.0)


def test_the_gateway_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWIRE_GATEWAY", "gw.example:7000")
    assert build_parser().parse_args(["runs", "list"]).gateway == "gw.example:7000"
    args = build_parser().parse_args(["runs", "list", "--gateway", "other:1"])
    assert args.gateway == "other:1"


def test_create_options() -> None:
    args = build_parser().parse_args(
        shlex.split(
            "runs create imitation --clip walk --rig stickman --episodes 50 --rate 5 "
            "--speed 2 --seed 3 --group-size 8 --name demo --request-id rq -q"
        )
    )
    assert (args.clip, args.rig, args.episodes, args.rate, args.speed) == (
        "walk",
        "stickman",
        50,
        5.0,
        2.0,
    )
    assert (args.seed, args.group_size, args.name, args.request_id, args.quiet) == (
        3,
        8,
        "demo",
        "rq",
        True,
    )
    grpo = build_parser().parse_args(
        shlex.split(
            "runs create grpo --model m --dataset d.jsonl --reward exact_match,length "
            "--num-generations 4 --beta 0.1 --workers 0 --processes 2"
        )
    )
    assert (grpo.model, grpo.dataset, grpo.reward, grpo.beta, grpo.workers, grpo.processes) == (
        "m",
        "d.jsonl",
        [("exact_match", None), ("length", None)],
        0.1,
        0,
        2,
    )
    assert grpo.prefetch is None


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "create", "imitation"],  # --clip is required
        ["runs", "list", "--state", "sleeping"],
        ["watch", "r-1", "--after", "-1"],
        ["--timeout", "0", "runs", "list"],
        ["speed", "r-1"],
        ["frobnicate"],
    ],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from trainwire.cli import main

    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_state_filter_parses_short_names() -> None:
    args = build_parser().parse_args(["runs", "list", "--state", "running"])
    assert args.state == Run.State.STATE_RUNNING


def _run(**fields: object) -> Run:
    run = Run(id="r-1", state=Run.State.STATE_RUNNING, episodes_per_second=10, speed=1)
    run.config.max_episodes = 100
    run.task.imitation.clip_name = "wave"
    run.task.imitation.rig_name = "stickman"
    for key, value in fields.items():
        setattr(run, key, value)
    return run


def test_the_trainers_of_a_run() -> None:
    assert "trainer:     -" in _format.run_details(_run())
    one = _run(trainer="a:1")
    one.trainers.append("a:1")
    assert "trainer:     a:1\n" in _format.run_details(one)
    two = _run(trainer="a:1")
    two.trainers.extend(["a:1", "b:2"])
    assert "trainer:     a:1, b:2 (rank 0 on a:1)" in _format.run_details(two)


def test_run_texts() -> None:
    run = _run(episode=12, reward=0.5, best_reward=0.75, display_name="demo")
    line = _format.run_line(run)
    assert line.startswith("run r-1  RUNNING  episode 12/100  reward 0.5 (best 0.75)")
    details = _format.run_details(run)
    assert "task:        imitation wave/stickman" in details
    assert "rate:        10/s x 1" in details
    assert "name:        demo" in details
    table = _format.runs_table([run, _run(id="r-22", state=Run.State.STATE_DONE)]).splitlines()
    assert table[0].split() == [
        "ID",
        "STATE",
        "EPISODE",
        "REWARD",
        "BEST",
        "TASK",
        "NAME",
        "CREATED",
    ]
    assert table[2].split()[:3] == ["r-22", "DONE", "0/100"]
    failed = _format.run_line(_run(state=Run.State.STATE_ERROR, error_message="boom"))
    assert failed.endswith("error: boom")


def test_json_is_the_protobuf_json_mapping_with_default_options() -> None:
    run = _run(episode=3)
    data = json.loads(_format.dumps(_format.run_json(run)))
    # What grpcurl and the HTTP API print for GetRun: camelCase, int64 as strings, enum names,
    # default values left out.
    assert data == json_format.MessageToDict(gateway_service_pb2.GetRunResponse(run=run))
    assert data["run"]["episode"] == "3"
    assert data["run"]["state"] == "STATE_RUNNING"
    assert data["run"]["config"]["maxEpisodes"] == 100
    assert "errorMessage" not in data["run"]
    assert json_format.ParseDict(data, gateway_service_pb2.GetRunResponse()).run == run


def test_error_lines() -> None:
    bad = tc.InvalidArgument(
        "invalid run: config.max_episodes: 0; need 1..10000000",
        field_violations=[
            FieldViolation("config.max_episodes", "0; need 1..10000000"),
            FieldViolation("task.imitation.group_size", "1; need 2..1024"),
        ],
    )
    lines = _format.error_lines(bad, "h:1", 10)
    assert lines == [
        "error: INVALID_ARGUMENT: invalid run: config.max_episodes: 0; need 1..10000000",
        "  task.imitation.group_size: 1; need 2..1024",
    ]
    down = tc.Unavailable("failed to connect to all addresses")
    assert _format.error_lines(down, "h:1", 10) == [
        "error: UNAVAILABLE: cannot reach the gateway at h:1 (failed to connect to all addresses)"
    ]
    slow = tc.DeadlineExceeded("Deadline Exceeded")
    assert "within 2.5 s; see --timeout" in _format.error_lines(slow, "h:1", 2.5)[0]
    # Without server details: a google.rpc.Status of its code and message.
    assert json.loads(_format.error_json(bad)) == {
        "error": {"code": 3, "message": "invalid run: config.max_episodes: 0; need 1..10000000"}
    }
    detail_lines = _format.error_detail_lines(bad)
    assert detail_lines[0] == "  grpc code: INVALID_ARGUMENT (3)"
    assert "  bad field: task.imitation.group_size: 1; need 2..1024" in detail_lines
    assert tc.NotFound("run r-1 not found").code == grpc.StatusCode.NOT_FOUND


def test_sparkline() -> None:
    assert _format.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert _format.sparkline([5, 5, 5]) == "▅▅▅"
    assert _format.sparkline([]) == ""
    long = _format.sparkline([float(i) for i in range(1000)], width=20)
    assert len(long) == 20 and long[0] == "▁" and long[-1] == "█"


def test_duration_text() -> None:
    assert _format.duration_text(5.2) == "5 s"
    assert _format.duration_text(125) == "2:05"
    assert _format.duration_text(3723) == "1:02:03"
    assert _format.duration_text(float("inf")) == "-"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _episode(n: int, reward: float) -> episode_pb2.Episode:
    return episode_pb2.Episode(episode=n, reward=reward, best_reward=reward)


def test_watch_view_rate_counts_live_episodes_only() -> None:
    clock = _Clock()
    view = WatchView(_run(), clock=clock)
    assert view.rate() == 10.0  # the paced rate until live episodes arrive
    for n in range(1, 31):  # replayed history arrives in a burst
        view.on_event(_episode(n, n / 100))
    view.on_event(gateway_service_pb2.CaughtUp(last_episode=30))
    assert view.rate() == 10.0
    for n in range(31, 41):
        clock.now += 0.5
        view.on_event(_episode(n, n / 100))
    assert view.rate() == pytest.approx(2.0)
    assert view.eta() == pytest.approx(30.0)
    assert (view.episode, view.reward, view.best_reward) == (40, 0.4, 0.4)
    assert len(view.rewards) == 40


def test_watch_view_connection_indicator() -> None:
    clock = _Clock()
    view = WatchView(_run(), clock=clock)
    assert view.connection_text() == ("connected", "green")
    view.on_reconnect(tc.Reconnect(2, 0.4, grpc.StatusCode.UNAVAILABLE, "shutting down", 17))
    text, style = view.connection_text()
    assert text == "reconnecting (attempt 2, UNAVAILABLE) after episode 17"
    assert style == "bold yellow"
    clock.now += 5
    view.on_event(gateway_service_pb2.Keepalive(last_episode=17, state=Run.State.STATE_PAUSED))
    clock.now += 3
    text, style = view.connection_text()
    assert text == "connected, quiet for 3 s (1 keepalives), resumed 1x"
    assert view.state == Run.State.STATE_PAUSED
    assert view.eta() is None  # paused: no ETA
    final = _run(state=Run.State.STATE_ERROR, error_message="boom")
    view.on_event(final)
    assert view.finished == final
    assert view.connection_text() == ("stream closed, resumed 1x", "dim")


def test_watch_view_renders_every_part() -> None:
    from rich.console import Console

    view = WatchView(_run(), clock=_Clock())
    for n in range(1, 21):
        view.on_event(_episode(n, n / 20))
    view.on_event(_run(state=Run.State.STATE_ERROR, error_message="boom", episode=20))
    console = Console(width=100, record=True, color_system=None)
    console.print(view.render())
    text = console.export_text()
    for part in ("run r-1", "imitation wave/stickman", "20/100", "ERROR", "1.0000", "▁", "boom"):
        assert part in text, part


def test_server_text_never_reaches_the_terminal_raw() -> None:
    hostile = "clear\x1b[2J ring\x07 back\r csi\x9b31m"
    run = gateway_service_pb2.Run(
        id="r1",
        display_name=hostile,
        error_message=hostile,
        state_detail=hostile,
        state=gateway_service_pb2.Run.STATE_ERROR,
    )
    texts = [_format.run_line(run), _format.run_details(run), _format.runs_table([run])]
    for text in texts:
        assert not any(ch in text for ch in "\x1b\x07\r\x9b"), repr(text)
        assert "clear\\x1b[2J ring\\x07 back\\x0d csi\\x9b31m" in text
    line = _format.dumps(_format.to_dict(run))
    assert not any(ch in line for ch in "\x1b\x07\r\x9b")
    assert json.loads(line)["displayName"] == hostile  # escaped, not lost
    error = tc.NotFound(hostile, field_violations=[FieldViolation("run_id", hostile)])
    assert not any(ch in "\n".join(_format.error_lines(error, "gw:1", 5.0)) for ch in "\x1b\x07")


_GLOBAL_FLAGS = (
    "--gateway", "--json", "--timeout", "--ca", "--cert", "--key", "--server-name", "--token", "-v",
)  # fmt: skip


def _subcommand_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append(((*path, name), sub))
                found.extend(_subcommand_paths(sub, (*path, name)))
    return found


def test_every_subcommand_names_the_global_flags_once_as_inherited() -> None:
    """gh's layout: a command's own flags, then the global ones listed once, whose help is the
    root's (`trainwire --help`)."""
    paths = _subcommand_paths(build_parser())
    assert {"watch", "plot", "grpo", "runs", "create", "list"} <= {p[-1] for p, _ in paths}
    for path, sub in paths:
        text = sub.format_help()
        heading = "\nInherited flags (before or after the command; see `trainwire --help`):\n"
        own, inherited = text.split(heading)
        listed = inherited.split("\n\n")[0]
        for flag in _GLOBAL_FLAGS:
            assert f"  {flag}" in listed, (path, flag)
            assert f"  {flag}" not in own, (path, flag)
        assert "deadline of each call" not in text, path  # the help is the root's alone
        assert "==SUPPRESS==" not in text, path
    root = build_parser().format_help()
    assert "deadline of each call" in root and "Inherited flags" not in root


def test_every_grpo_flag_has_help_and_its_default() -> None:
    (grpo,) = [sub for path, sub in _subcommand_paths(build_parser()) if path[-1] == "grpo"]
    for action in grpo._actions:
        if not action.option_strings or action.dest in ("help",) or action.help == SUPPRESS:
            continue  # a positional, --help, an inherited global flag
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
        if not action.required and action.dest not in ("quiet", "watch", "json", "verbose"):
            assert "default" in action.help, action.option_strings


def test_grpo_lora_and_memory_flags_build_the_task() -> None:
    from trainwire.cli._commands import grpo_task_of

    def parse(flags: str) -> episode_pb2.GrpoTask:
        command = f"runs create grpo --model m --dataset d.jsonl {flags}"
        return grpo_task_of(build_parser().parse_args(shlex.split(command))).grpo

    full = parse("")
    assert not full.HasField("lora") and not full.gradient_checkpointing
    defaults = parse("--lora")
    assert defaults.HasField("lora") and defaults.lora == episode_pb2.LoraConfig()
    tuned = parse(
        "--lora-rank 8 --lora-alpha 4 --lora-dropout 0.1 --lora-targets 'q_proj, v_proj' "
        "--gradient-checkpointing"
    )
    assert tuned.lora == episode_pb2.LoraConfig(
        rank=8, alpha=4.0, dropout=0.1, target_modules=["q_proj", "v_proj"]
    )
    assert tuned.gradient_checkpointing
    assert parse("--lora-rank 4").lora.rank == 4  # any --lora-* flag asks for LoRA


@pytest.mark.parametrize(
    "argv",
    [
        "--timeout x runs list",
        "runs list --limit many",
        "watch r1 --idle-timeout soon",
        "speed r1 fast",
        "runs create grpo --model m --dataset d --num-generations lots",
        "runs create imitation --clip wave --rate quick",
    ],
)
def test_usage_errors_never_name_internal_functions(
    argv: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainwire.cli import main

    assert main(shlex.split(argv)) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "is not a" in err
    assert "_positive" not in err and "_non_negative" not in err and "invalid" not in err
