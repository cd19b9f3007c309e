"""The CLI's experiment commands without a server: the flags of ``runs label``, ``runs rename``,
``runs fork``, ``set``, ``compare`` and ``plot RUN RUN...``; the label changes; compare's field
diff on synthetic runs (text and JSON); a fork's task and config from its parent's; the
overlay drawing; and the commands over a grpc_testing channel (the calls they make, in order)."""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
import grpc_testing
import pytest
from PIL import Image

from tests.fakes.waiting import TIMEOUT
from trainwire import client as tc
from trainwire import motion, render
from trainwire.cli import _compare, _format, build_parser
from trainwire.cli._commands import cmd_plot
from trainwire.cli._experiments import (
    apply_label_changes,
    cmd_compare,
    cmd_fork,
    cmd_label,
    cmd_rename,
    cmd_set,
    fork_config,
    fork_task,
)
from trainwire.cli._output import CliError, Output
from trainwire.v1 import gateway_service_pb2 as pb

pytestmark = pytest.mark.timeout(30)

_SERVICE = pb.DESCRIPTOR.services_by_name["GatewayService"]
_DONE = pb.Run.State.STATE_DONE


def _parse(argv: str) -> argparse.Namespace:
    return build_parser().parse_args(shlex.split(argv))


def _usage_error(argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        _parse(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


# -- flags ---------------------------------------------------------------------------------------


def test_label_changes_set_and_remove() -> None:
    args = _parse("runs label r-1 team=vision lr- note= a/b=c=d")
    assert args.run_id == "r-1"
    assert args.changes == [("team", "vision"), ("lr", None), ("note", ""), ("a/b", "c=d")]
    assert apply_label_changes({"lr": "1e-3", "keep": "x"}, args.changes) == {
        "keep": "x",
        "team": "vision",
        "note": "",
        "a/b": "c=d",
    }
    # Removing an absent label is no error; later changes win.
    assert apply_label_changes({}, [("a", None), ("b", "1"), ("b", "2")]) == {"b": "2"}


@pytest.mark.parametrize("bad", ["team", "=x", "-"])
def test_a_label_change_that_is_neither_set_nor_remove_is_bad_usage(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(f"runs label r-1 {bad}", capsys)
    assert "KEY" in err


def test_runs_create_takes_repeated_labels(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("runs create imitation --clip wave --label team=vision --label sweep=lr")
    assert args.labels == [("team", "vision"), ("sweep", "lr")]
    grpo = _parse("runs create grpo --model m --dataset d.jsonl --lr 1e-5")
    assert (grpo.labels, grpo.learning_rate) == ([], 1e-5)
    # The README's sweep: --lr on create, as fork and set spell it.
    sweep = _parse(
        "runs create imitation --clip walk --episodes 2000 --rate -1 --lr 0.03 "
        "--label sweep=walk-lr --label lr=0.03 --name 'walk lr=0.03' -q"
    )
    assert (sweep.learning_rate, sweep.rate, sweep.labels) == (
        0.03,
        -1.0,
        [("sweep", "walk-lr"), ("lr", "0.03")],
    )
    assert "is not KEY=VALUE" in _usage_error("runs create imitation --clip wave --label x", capsys)


def test_fork_flags_default_to_the_parent() -> None:
    plain = _parse("runs fork p")
    for name in (
        "learning_rate",
        "temperature",
        "beta",
        "num_generations",
        "group_size",
        "episodes",
        "seed",
        "rate",
    ):
        assert getattr(plain, name) is None, name
    assert (plain.episode, plain.labels, plain.speed, plain.name) == (0, [], 0.0, "")
    args = _parse(
        "runs fork p --episode 120 --lr 1e-4 --temperature 0.7 --beta 0.02 --episodes 400 "
        "--seed 9 --label sweep=low --label old- --name low -q"
    )
    assert (args.episode, args.learning_rate, args.temperature, args.beta) == (
        120,
        1e-4,
        0.7,
        0.02,
    )
    assert (args.episodes, args.seed, args.name, args.quiet) == (400, 9, "low", True)
    assert args.labels == [("sweep", "low"), ("old", None)]
    assert _parse("runs fork p --learning-rate 0.5").learning_rate == 0.5


def test_set_rename_compare_and_plot_flags(capsys: pytest.CaptureFixture[str]) -> None:
    live = _parse("set r-1 --lr 3e-4 --beta 0")
    assert (live.learning_rate, live.temperature, live.beta) == (3e-4, None, 0.0)
    assert _parse("runs rename r-1 'new name'").name == "new name"
    compare = _parse("compare a b c")
    assert (compare.run_ids, compare.all) == (["a", "b", "c"], False)
    assert _parse("compare a b --all").all is True
    plot = _parse("plot a b --out c.png --metrics loss")
    assert (plot.run_ids, plot.metrics) == (["a", "b"], ["loss"])
    assert "--lr" in _usage_error("set r-1 --lr fast", capsys)


# -- compare's field diff ------------------------------------------------------------------------


def _imitation(run_id: str, lr: float, **labels: str) -> pb.Run:
    return pb.Run(
        id=run_id,
        state=_DONE,
        episode=200,
        reward=0.8,
        best_reward=0.9,
        task=tc.imitation_task(clip="wave", learning_rate=lr, group_size=16),
        config=tc.train_config(200, seed=1),
        labels=labels,
    )


def test_compare_lists_the_fields_that_differ() -> None:
    a = _imitation("a", 1e-3, team="vision", sweep="lr")
    b = _imitation("b", 3e-4, team="vision")
    b.fork_from.CopyFrom(pb.ForkSource(run_id="a", episode=100))
    b.config.max_episodes = 400
    rows = _compare.field_rows([a, b])
    every = {row.field: row.values for row in rows}
    assert every["task"] == ("imitation", "imitation")
    assert every["task.imitation.clip_name"] == ("wave", "wave")
    assert every["config.seed"] == (1, 1)
    diff = [(row.field, row.values) for row in _compare.differing(rows)]
    assert diff == [
        ("task.imitation.learning_rate", (1e-3, 3e-4)),
        ("config.max_episodes", (200, 400)),
        ("labels.sweep", ("lr", None)),
        ("fork_from", (None, "a@100")),
    ]


def test_compare_of_different_task_kinds_and_optional_fields() -> None:
    imitation = _imitation("a", 1e-3)
    with_beta = pb.Run(id="g1", task=tc.grpo_task(model="m", dataset="d.jsonl", beta=0.0))
    without = pb.Run(id="g2", task=tc.grpo_task(model="m", dataset="d.jsonl"))
    diff = {
        row.field: row.values
        for row in _compare.differing(_compare.field_rows([with_beta, without]))
    }
    # An unset optional differs from one set to its zero.
    assert diff == {"task.grpo.beta": (0.0, None)}
    mixed = {
        row.field: row.values
        for row in _compare.differing(_compare.field_rows([imitation, with_beta]))
    }
    assert mixed["task"] == ("imitation", "grpo")
    assert mixed["task.imitation.clip_name"] == ("wave", None)
    assert mixed["task.grpo.model_path"] == (None, "m")


def test_compare_summarises_a_custom_clip() -> None:
    clip = motion.builtin_clip("jump")
    a = pb.Run(id="a", task=tc.imitation_task(clip=clip))
    b = pb.Run(id="b", task=tc.imitation_task(clip=clip))
    same = _compare.field_rows([a, b])
    angles = next(row for row in same if row.field == "task.imitation.clip.angles")
    assert not angles.differs
    assert isinstance(angles.values[0], str) and angles.values[0].startswith(
        f"{len(a.task.imitation.clip.angles)} items #"
    )
    b.task.imitation.clip.angles[0] += 0.5
    changed = [row.field for row in _compare.differing(_compare.field_rows([a, b]))]
    assert changed == ["task.imitation.clip.angles"]


def test_compare_text_and_json() -> None:
    a = _imitation("a", 1e-3, team="x")
    b = _imitation("b", 3e-4)
    b.display_name, b.state, b.episode = "low\x1b[2J lr", pb.Run.State.STATE_RUNNING, 50
    pending = pb.Run(id="c", task=a.task, config=a.config, state=pb.Run.State.STATE_PENDING)
    runs = [a, b, pending]
    rows = _compare.differing(_compare.field_rows(runs))
    text = _compare.compare_text(runs, rows, every=False).splitlines()
    assert text[0].split() == ["RUN", "NAME", "STATE", "EPISODE", "REWARD", "BEST"]
    assert text[1].split() == ["a", "-", "DONE", "200/200", "0.8", "0.9"]
    assert text[2].split() == ["b", "low\\x1b[2J", "lr", "RUNNING", "50/200", "0.8", "0.9"]
    assert text[3].split() == ["c", "-", "PENDING", "0/200", "-", "-"]
    assert text[4] == ""
    assert text[5].split() == ["FIELD", "a", "b", "c"]
    assert text[6].split() == ["task.imitation.learning_rate", "0.001", "0.0003", "0.001"]
    assert text[7].split() == ["labels.team", "x", "-", "-"]
    data = json.loads(_format.dumps(_compare.compare_json(runs, rows)))
    assert data["runs"][2] == {
        "id": "c",
        "displayName": "",
        "state": "STATE_PENDING",
        "episode": 0,
        "maxEpisodes": 200,
        "reward": None,
        "bestReward": None,
    }
    assert data["fields"] == [
        {"field": "task.imitation.learning_rate", "values": [0.001, 0.0003, 0.001]},
        {"field": "labels.team", "values": ["x", None, None]},
    ]
    same = _compare.compare_text([a, a], [], every=False)
    assert same.endswith("\n\nno config field differs")


# -- fork's task and config ----------------------------------------------------------------------


def _fork_args(argv: str = "") -> argparse.Namespace:
    return _parse(f"runs fork p {argv}")


def test_a_fork_keeps_the_parents_task_but_for_the_changes() -> None:
    parent = _imitation("p", 1e-3)
    parent.config.checkpoint_every = 25
    task = fork_task(parent, _fork_args("--lr 1e-4 --group-size 32"))
    assert (task.imitation.learning_rate, task.imitation.group_size) == (1e-4, 32)
    assert task.imitation.clip_name == "wave"
    assert parent.task.imitation.learning_rate == 1e-3  # the parent is left alone
    assert fork_task(parent, _fork_args()) == parent.task
    config = fork_config(parent, _fork_args("--episodes 500 --seed 4"))
    assert (config.max_episodes, config.seed, config.checkpoint_every) == (500, 4, 25)
    grpo = pb.Run(id="g", task=tc.grpo_task(model="m", dataset="d.jsonl", learning_rate=1e-5))
    changed = fork_task(
        grpo, _fork_args("--lr 2e-5 --temperature 0.8 --beta 0 --num-generations 8")
    )
    assert (changed.grpo.learning_rate, changed.grpo.temperature) == (2e-5, 0.8)
    assert changed.grpo.HasField("beta") and changed.grpo.num_generations == 8


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ("--temperature 0.5", "--temperature applies to grpo runs; run p is an imitation run"),
        ("--beta 0.1", "--beta applies to grpo runs"),
        ("--num-generations 4", "--num-generations applies to grpo runs"),
    ],
)
def test_a_fork_refuses_a_setting_its_task_kind_lacks(argv: str, words: str) -> None:
    with pytest.raises(CliError, match=words):
        fork_task(_imitation("p", 1e-3), _fork_args(argv))


def test_group_size_is_imitations() -> None:
    grpo = pb.Run(id="g", task=tc.grpo_task(model="m", dataset="d.jsonl"))
    with pytest.raises(CliError, match="--group-size applies to imitation runs"):
        fork_task(grpo, _fork_args("--group-size 8"))


# -- the commands over a channel -------------------------------------------------------------------


@pytest.fixture
def channel() -> grpc_testing.Channel:
    return grpc_testing.channel([_SERVICE], grpc_testing.strict_real_time())


@pytest.fixture
def client(channel: grpc_testing.Channel) -> Iterator[tc.GatewayClient]:
    with tc.GatewayClient(channel=channel, timeout=4.0, idle_timeout=None) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _answer(
    channel: grpc_testing.Channel,
    method: str,
    response: Any,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    details: str = "",
) -> Any:
    _, request, rpc = channel.take_unary_unary(_SERVICE.methods_by_name[method])
    rpc.terminate(response, (), code, details)
    return request


def test_runs_label_merges_the_changes_into_the_runs_labels(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("runs label r-1 team=vision old-")
    future = pool.submit(cmd_label, client, args, Output(json_mode=False))
    current = _imitation("r-1", 1e-3, old="x", keep="y")
    _answer(channel, "GetRun", pb.GetRunResponse(run=current))
    updated = _imitation("r-1", 1e-3, keep="y", team="vision")
    request = _answer(channel, "UpdateRun", pb.UpdateRunResponse(run=updated))
    assert future.result(timeout=TIMEOUT) == 0
    assert list(request.update_mask.paths) == ["labels"]
    assert dict(request.run.labels) == {"keep": "y", "team": "vision"}
    out = capsys.readouterr().out
    assert "labels:      keep=y, team=vision" in out and "id:          r-1" in out


def test_runs_rename_sets_only_the_display_name(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("--json runs rename r-1 best")
    future = pool.submit(cmd_rename, client, args, Output(json_mode=True))
    renamed = pb.Run(id="r-1", display_name="best")
    request = _answer(channel, "UpdateRun", pb.UpdateRunResponse(run=renamed))
    assert future.result(timeout=TIMEOUT) == 0
    assert (list(request.update_mask.paths), request.run.display_name) == (["display_name"], "best")
    assert json.loads(capsys.readouterr().out) == {"run": {"id": "r-1", "displayName": "best"}}


def test_runs_fork_creates_the_parents_task_with_a_fork_source(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("runs fork p --episode 100 --lr 1e-4 --label sweep=low --label old- -q")
    future = pool.submit(cmd_fork, client, args, Output(json_mode=False))
    parent = _imitation("p", 1e-3, old="x", team="vision")
    parent.episodes_per_second = 25.0
    _answer(channel, "GetRun", pb.GetRunResponse(run=parent))
    request = _answer(channel, "CreateRun", pb.CreateRunResponse(run=pb.Run(id="child")))
    assert future.result(timeout=TIMEOUT) == 0
    assert request.fork_from == pb.ForkSource(run_id="p", episode=100)
    assert request.task.imitation.learning_rate == 1e-4
    assert request.task.imitation.clip_name == "wave"
    assert request.config == parent.config
    assert dict(request.labels) == {"team": "vision", "sweep": "low"}
    assert (request.episodes_per_second, request.speed) == (25.0, 0.0)
    assert capsys.readouterr().out == "child\n"


def test_a_refused_fork_propagates_the_gateways_error(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    future = pool.submit(cmd_fork, client, _parse("runs fork p --episode 7"), Output(False))
    _answer(channel, "GetRun", pb.GetRunResponse(run=_imitation("p", 1e-3)))
    message = "cannot fork run 'p': no checkpoint at episode 7"
    _answer(channel, "CreateRun", None, grpc.StatusCode.FAILED_PRECONDITION, message)
    with pytest.raises(tc.FailedPrecondition, match="no checkpoint at episode 7"):
        future.result(timeout=TIMEOUT)


def test_set_sends_the_values_and_says_what_is_in_effect(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("set r-1 --lr 3e-4 --temperature 0.9")
    future = pool.submit(cmd_set, client, args, Output(json_mode=False))
    run = pb.Run(
        id="r-1",
        state=pb.Run.State.STATE_RUNNING,
        task=tc.grpo_task(model="m", dataset="d", learning_rate=3e-4, temperature=0.9),
    )
    request = _answer(channel, "SetRunHyperparameters", pb.SetRunHyperparametersResponse(run=run))
    assert future.result(timeout=TIMEOUT) == 0
    assert request.HasField("learning_rate") and request.HasField("temperature")
    assert not request.HasField("beta")
    assert capsys.readouterr().out.startswith(
        "set learning_rate 0.0003, temperature 0.9: run r-1  RUNNING"
    )


def test_set_without_a_value_is_an_error(client: tc.GatewayClient) -> None:
    with pytest.raises(CliError, match="--learning-rate, --temperature, --beta"):
        cmd_set(client, _parse("set r-1"), Output(json_mode=False))


def test_compare_reads_each_run_once(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parse("--json compare a b a")
    future = pool.submit(cmd_compare, client, args, Output(json_mode=True))
    for run in (_imitation("a", 1e-3), _imitation("b", 1e-4)):
        request = _answer(channel, "GetRun", pb.GetRunResponse(run=run))
        assert request.run_id == run.id
    assert future.result(timeout=TIMEOUT) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in data["runs"]] == ["a", "b"]
    assert data["fields"] == [{"field": "task.imitation.learning_rate", "values": [0.001, 0.0001]}]


def test_compare_needs_two_runs(client: tc.GatewayClient) -> None:
    with pytest.raises(CliError, match="at least 2 different runs"):
        cmd_compare(client, _parse("compare a a"), Output(json_mode=False))


# -- plot RUN RUN... -----------------------------------------------------------------------------


def _curve(first: int, last: int, level: float, metric: float | None = None) -> list[Any]:
    """Ten buckets over ``first..last`` with a reward that rises to ``level``."""
    out = []
    span = (last - first + 1) // 10
    for i in range(10):
        mean = level * (i + 1) / 10
        out.append(
            pb.CurveBucket(
                first_episode=first + i * span,
                last_episode=first + (i + 1) * span - 1,
                reward_min=mean - 0.1,
                reward_max=mean + 0.1,
                reward_mean=mean,
                best_reward=mean + 0.1,
                metrics_mean={} if metric is None else {"loss": metric - i * 0.01},
            )
        )
    return out


def _colours(image: Image.Image) -> dict[tuple[int, int, int], int]:
    colours = cast("list[tuple[int, tuple[int, int, int]]]", image.getcolors(1 << 18))
    return {c: n for n, c in colours}


def test_an_overlay_draws_each_run_in_its_colour_with_a_legend(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "overlay.png"
    curves = [
        ("lr 1e-3 (a)", _curve(1, 200, 1.0, metric=0.5)),
        ("lr 3e-4 (b)", _curve(1, 200, 0.5, metric=0.9)),
        ("fork (c)", _curve(101, 300, 1.5)),  # a fork: its curve continues from episode 101
    ]
    render.plot_overlay(curves, out, title="3 runs", metrics=["loss"])
    rgb = Image.open(out).convert("RGB")
    width, height = render.CURVE_SIZE
    assert rgb.size == (width, height + render.METRIC_PANEL_HEIGHT)
    reward_area = _colours(rgb.crop((0, 0, width, height - 56)))
    for i in range(3):
        assert reward_area.get(render.run_colour(i), 0) > 300, i  # its mean line (and legend)
    metric_panel = _colours(rgb.crop((0, height - 56, width, rgb.height)))
    assert metric_panel.get(render.run_colour(0), 0) > 100
    assert metric_panel.get(render.run_colour(1), 0) > 100
    assert metric_panel.get(render.run_colour(2), 0) == 0  # run c has no loss
    # The bands are translucent blends, not the runs' solid colours or the single-run band.
    assert render.REWARD not in reward_area
    # The x axis spans every run: the fork's last episode is right of the others'.
    assert reward_area.get(render.run_colour(2), 0) > reward_area.get(render.run_colour(1), 0) // 3


def test_an_overlay_keeps_a_run_without_episodes_in_its_legend(tmp_path: pathlib.Path) -> None:
    render.plot_overlay([("a", _curve(1, 100, 1.0)), ("empty", [])], tmp_path / "o.png")
    legend = _colours(Image.open(tmp_path / "o.png").convert("RGB"))
    assert legend.get(render.run_colour(1), 0) > 0  # the legend's swatch
    with pytest.raises(ValueError, match="no episodes"):
        render.plot_overlay([("a", []), ("b", [])], tmp_path / "none.png")
    assert render.run_colour(len(render.RUN_COLOURS)) == render.run_colour(0)


def test_plot_of_two_runs_asks_for_each_curve_and_overlays_them(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "two.png"
    args = _parse(f"--json plot a b a --out {out} --metrics loss")
    future = pool.submit(cmd_plot, client, args, Output(json_mode=True))
    a = pb.Run(id="a", display_name="high lr", task=tc.imitation_task())
    b = pb.Run(id="b", task=tc.imitation_task())
    for run in (a, b):
        assert _answer(channel, "GetRun", pb.GetRunResponse(run=run)).run_id == run.id
    for run_id, curve in (("a", _curve(1, 100, 1.0, 0.4)), ("b", _curve(1, 200, 0.5, 0.6))):
        request = _answer(channel, "GetRunCurve", pb.GetRunCurveResponse(buckets=curve))
        assert request == pb.GetRunCurveRequest(
            run_id=run_id, buckets=render.curve_buckets(), metrics=["loss"]
        )
    assert future.result(timeout=TIMEOUT) == 0
    assert json.loads(capsys.readouterr().out) == {
        "out": str(out),
        "runs": [{"runId": "a", "episodes": 100}, {"runId": "b", "episodes": 200}],
    }
    rgb = Image.open(out).convert("RGB")
    assert _colours(rgb).get(render.run_colour(1), 0) > 300
    assert _format.run_name(a) == "high lr (a)" and _format.run_name(b) == "b"


def test_plot_of_runs_without_episodes_says_so(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    tmp_path: pathlib.Path,
) -> None:
    args = _parse(f"plot a b --out {tmp_path / 'c.png'}")
    future = pool.submit(cmd_plot, client, args, Output(json_mode=False))
    for run_id in ("a", "b"):
        _answer(channel, "GetRun", pb.GetRunResponse(run=pb.Run(id=run_id)))
    for _ in range(2):
        _answer(channel, "GetRunCurve", pb.GetRunCurveResponse())
    with pytest.raises(CliError, match=r"^runs a, b have no episodes yet; nothing to plot$"):
        future.result(timeout=TIMEOUT)
    assert not (tmp_path / "c.png").exists()
