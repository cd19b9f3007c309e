"""``trainwire plot`` from the curve the gateway summarises (GetRunCurve): the drawing of buckets
(band, mean, best, metric panels), the rolling mean over buckets, the flags, and the command
over a grpc_testing channel (what it asks for, what it says); ``watch --scalars``."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias, cast

import grpc
import grpc_testing
import pytest
from PIL import Image

from tests.fakes.waiting import TIMEOUT
from trainwire import client as tc
from trainwire import render
from trainwire.cli import build_parser
from trainwire.cli._commands import cmd_plot
from trainwire.cli._follow import cmd_watch
from trainwire.cli._output import CliError, Output
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = pytest.mark.timeout(30)

_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
Bucket: TypeAlias = gateway_service_pb2.CurveBucket


def _long_curve(episodes: int = 1_000_000, buckets: int | None = None) -> list[Bucket]:
    """A rising reward with a spread of +-0.3 around its mean, in contiguous buckets."""
    count = buckets or render.curve_buckets()
    out, best = [], -math.inf
    for i in range(count):
        first, last = i * episodes // count + 1, (i + 1) * episodes // count
        mean = 1 - math.exp(-4 * last / episodes)
        best = max(best, mean + 0.3)
        out.append(
            Bucket(
                first_episode=first,
                last_episode=last,
                reward_min=mean - 0.3,
                reward_max=mean + 0.3,
                reward_mean=mean,
                best_reward=best,
                metrics_mean={"loss": 2 - mean} if i % 50 else {},
            )
        )
    return out


def _rows(image: Image.Image, column: int, colour: tuple[int, int, int]) -> list[int]:
    return [y for y in range(image.height) if image.getpixel((column, y)) == colour]


def _count(image: Image.Image, colour: tuple[int, int, int]) -> int:
    colours = cast("list[tuple[int, tuple[int, int, int]]]", image.getcolors(1 << 16))
    return sum(n for n, c in colours if c == colour)


# -- drawing -------------------------------------------------------------------------------------


def test_a_million_episode_curve_draws_its_band_mean_and_best(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "curve.png"
    render.plot_buckets(_long_curve(), out, title="run r-1")
    image = Image.open(out)
    assert image.format == "PNG" and image.size == render.CURVE_SIZE
    rgb = image.convert("RGB")
    assert _count(rgb, render.REWARD) > 20_000  # a filled band, not a line
    assert _count(rgb, render.MEAN) > 1_000 and _count(rgb, render.BEST) > 500
    column = 450  # mid-plot, clear of the legend in the lower right
    band, mean, best = (_rows(rgb, column, c) for c in (render.REWARD, render.MEAN, render.BEST))
    assert band and mean and best
    # Image rows grow downwards: best over the band's top, the mean inside the band.
    assert max(best) <= min(band) + 3
    assert min(band) < min(mean) and max(mean) < max(band)


def test_each_metric_gets_a_panel_below_the_reward(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "metrics.png"
    render.plot_buckets(_long_curve(), out, metrics=["loss", "absent"])
    rgb = Image.open(out).convert("RGB")
    width, height = render.CURVE_SIZE
    assert rgb.size == (width, height + 2 * render.METRIC_PANEL_HEIGHT)
    loss_colour = render.METRIC_COLOURS[0]
    reward_area = rgb.crop((0, 0, width, height - 56))
    loss_panel = rgb.crop((0, height - 56, width, height - 56 + render.METRIC_PANEL_HEIGHT))
    assert _count(reward_area, loss_colour) == 0
    assert _count(loss_panel, loss_colour) > 500  # its line, gaps where buckets lack it
    assert _count(rgb, render.METRIC_COLOURS[1]) == 0  # no bucket has "absent": no line


def test_one_episode_buckets_draw_the_reward_as_a_line(tmp_path: pathlib.Path) -> None:
    episodes = [
        episode_pb2.Episode(episode=n, reward=n / 100, best_reward=1.0) for n in range(1, 101)
    ]
    buckets = render.episode_buckets(episodes)
    assert [(b.first_episode, b.last_episode, b.reward_min, b.reward_max) for b in buckets[:2]] == [
        (1, 1, 0.01, 0.01),
        (2, 2, 0.02, 0.02),
    ]
    out = tmp_path / "episodes.png"
    render.plot_buckets(buckets, out, window=50)
    rgb = Image.open(out).convert("RGB")
    # A band of no height is its edge: the ramp as a thin line above its lagging mean.
    assert 300 < _count(rgb, render.REWARD) < 3_000


def test_a_single_bucket_and_bad_input(tmp_path: pathlib.Path) -> None:
    one = [Bucket(first_episode=1, last_episode=7, reward_min=0, reward_max=1, reward_mean=0.4)]
    render.plot_buckets(one, tmp_path / "one.png")
    assert Image.open(tmp_path / "one.png").size == render.CURVE_SIZE
    with pytest.raises(ValueError, match="no episodes"):
        render.plot_buckets([], tmp_path / "none.png")
    with pytest.raises(ValueError, match="window"):
        render.plot_buckets(one, tmp_path / "w.png", window=0)


def test_bucket_means_roll_over_whole_buckets() -> None:
    rewards = [math.sin(i) for i in range(1, 41)]
    singles = [
        Bucket(first_episode=n, last_episode=n, reward_mean=r) for n, r in enumerate(rewards, 1)
    ]
    assert render.bucket_means(singles, 7) == pytest.approx(render.rolling_mean(rewards, 7))
    tens = [
        Bucket(first_episode=10 * i + 1, last_episode=10 * i + 10, reward_mean=float(i))
        for i in range(5)
    ]
    assert render.bucket_means(tens, 5) == [0.0, 1.0, 2.0, 3.0, 4.0]  # a bucket is its mean
    assert render.bucket_means(tens, 20) == [0.0, 0.5, 1.5, 2.5, 3.5]  # two buckets at a time
    uneven = [
        Bucket(first_episode=1, last_episode=1, reward_mean=4.0),
        Bucket(first_episode=2, last_episode=4, reward_mean=0.0),
    ]
    assert render.bucket_means(uneven, 10) == [4.0, 1.0]  # weighted by episodes


def test_a_curve_asks_for_one_bucket_per_pixel_column() -> None:
    assert render.curve_buckets() == render.CURVE_SIZE[0] - 90
    assert render.curve_buckets(50) == 1
    assert [render.default_window(n) for n in (10, 200, 10_000_000)] == [3, 10, 50]


# -- flags ---------------------------------------------------------------------------------------


def test_plot_and_watch_flags() -> None:
    parser = build_parser()
    plain = parser.parse_args(["plot", "r-1", "--out", "c.png"])
    assert (plain.window, plain.metrics) == (None, [])
    args = parser.parse_args(
        ["plot", "r-1", "--out", "c.png", "--window", "25", "--metrics", "loss, kl,,"]
    )
    assert (args.window, args.metrics) == (25, ["loss", "kl"])
    assert parser.parse_args(["watch", "r-1"]).scalars is False
    assert parser.parse_args(["watch", "r-1", "--scalars"]).scalars is True


@pytest.mark.parametrize("window", ["0", "-3", "wide"])
def test_a_window_below_one_is_bad_usage(window: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["plot", "r-1", "--out", "c.png", "--window", window])
    assert caught.value.code == 2
    assert "argument --window:" in capsys.readouterr().err


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


def _answer(channel: grpc_testing.Channel, method: str, response: Any) -> Any:
    _, request, rpc = channel.take_unary_unary(_SERVICE.methods_by_name[method])
    rpc.terminate(response, (), grpc.StatusCode.OK, "")
    return request


def _run_reply() -> gateway_service_pb2.GetRunResponse:
    run = gateway_service_pb2.Run(id="r-1", task=tc.imitation_task(clip="walk"))
    return gateway_service_pb2.GetRunResponse(run=run)


def _plot_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plot", "r-1", *argv])


def test_plot_draws_the_curve_it_asked_the_gateway_for(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "curve.png"
    args = _plot_args("--out", str(out), "--metrics", "loss", "--json")
    future = pool.submit(cmd_plot, client, args, Output(json_mode=True))
    _answer(channel, "GetRun", _run_reply())
    curve = gateway_service_pb2.GetRunCurveResponse(buckets=_long_curve(), last_episode=1_000_003)
    request = _answer(channel, "GetRunCurve", curve)
    assert future.result(timeout=TIMEOUT) == 0
    assert request == gateway_service_pb2.GetRunCurveRequest(
        run_id="r-1", buckets=render.curve_buckets(), metrics=["loss"]
    )
    # The episodes drawn: those the buckets cover.
    assert json.loads(capsys.readouterr().out) == {
        "runId": "r-1",
        "out": str(out),
        "episodes": 1_000_000,
    }
    width, height = render.CURVE_SIZE
    assert Image.open(out).size == (width, height + render.METRIC_PANEL_HEIGHT)


def test_plot_of_a_run_without_episodes_says_so(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    tmp_path: pathlib.Path,
) -> None:
    args = _plot_args("--out", str(tmp_path / "c.png"))
    future = pool.submit(cmd_plot, client, args, Output(json_mode=False))
    _answer(channel, "GetRun", _run_reply())
    _answer(channel, "GetRunCurve", gateway_service_pb2.GetRunCurveResponse())
    with pytest.raises(CliError, match=r"^run r-1 has no episodes yet; nothing to plot$"):
        future.result(timeout=TIMEOUT)
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize(
    ("argv", "view"),
    [
        (["--scalars"], gateway_service_pb2.EPISODE_VIEW_SCALARS),
        ([], gateway_service_pb2.EPISODE_VIEW_FULL),
    ],
)
def test_watch_json_streams_scalars_when_asked(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    view: int,
) -> None:
    args = build_parser().parse_args(["--json", "watch", "r-1", *argv])
    future = pool.submit(cmd_watch, client, args, Output(json_mode=True))
    _, request, rpc = channel.take_unary_stream(_SERVICE.methods_by_name["WatchRun"])
    done = gateway_service_pb2.Run(id="r-1", state=gateway_service_pb2.Run.State.STATE_DONE)
    rpc.send_response(gateway_service_pb2.WatchRunResponse(finished=done))
    rpc.terminate((), grpc.StatusCode.OK, "")
    assert future.result(timeout=TIMEOUT) == 0
    assert request.view == view
    assert json.loads(capsys.readouterr().out)["finished"]["state"] == "STATE_DONE"


def test_plot_replays_the_history_of_a_gateway_without_get_run_curve(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "curve.png"
    args = _plot_args("--out", str(out), "--metrics", "loss")
    future = pool.submit(cmd_plot, client, args, Output(json_mode=False))
    _answer(channel, "GetRun", _run_reply())
    _, _, rpc = channel.take_unary_unary(_SERVICE.methods_by_name["GetRunCurve"])
    rpc.terminate(None, (), grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    _, request, rpc = channel.take_unary_stream(_SERVICE.methods_by_name["WatchRun"])
    episodes = [
        episode_pb2.Episode(episode=n, reward=n / 10, best_reward=n / 10, metrics={"loss": 1 / n})
        for n in range(1, 31)
    ]
    batch = gateway_service_pb2.EpisodeBatch(episodes=episodes)
    rpc.send_response(gateway_service_pb2.WatchRunResponse(batch=batch))
    caught_up = gateway_service_pb2.CaughtUp(last_episode=30)
    rpc.send_response(gateway_service_pb2.WatchRunResponse(caught_up=caught_up))
    assert future.result(timeout=TIMEOUT) == 0
    rpc.terminate((), grpc.StatusCode.CANCELLED, "")
    assert (request.after_episode, request.view) == (0, gateway_service_pb2.EPISODE_VIEW_SCALARS)
    assert capsys.readouterr().out == f"wrote {out} (30 episodes of run r-1)\n"
    rgb = Image.open(out).convert("RGB")
    width, height = render.CURVE_SIZE
    assert rgb.size == (width, height + render.METRIC_PANEL_HEIGHT)
    assert _count(rgb, render.METRIC_COLOURS[0]) > 100  # the episodes' own loss
