"""The CLI's experiment commands through its entry point against the real gateway (in-memory
store): ``runs create --label``, ``runs label``, ``runs rename``, ``compare`` and ``plot RUN RUN``
with the fake trainer behind it; ``runs fork`` and ``set`` with the real imitation trainer (a
process on the CPU, writing checkpoints to a directory the gateway reads)."""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from PIL import Image

from tests.fakes.gateway_harness import running_gateway, trainer_process
from tests.fakes.live import LiveStack, live_stack
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.fakes.watch_faults import ThreadedServer
from trainwire import client as tc
from trainwire import render
from trainwire.cli import main
from trainwire.v1 import episode_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


@dataclass
class Gateway:
    """A real gateway, a client to it, and the CLI pointed at it."""

    stack: LiveStack
    client: tc.GatewayClient

    def cli(self, *argv: str) -> int:
        return main(["--gateway", self.stack.target, *argv])

    def finished(self, run_id: str) -> tc.Run:
        final = list(self.client.watch(run_id, after_episode=5000))[-1]
        assert isinstance(final, tc.Run)
        return final


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with live_stack() as stack, tc.GatewayClient(stack.target, timeout=TIMEOUT) as client:
        yield Gateway(stack, client)


def _create(gw: Gateway, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    base = ("runs", "create", "imitation", "--clip", "wave", "--rate=-1", "-q")
    assert gw.cli(*base, *argv) == 0
    return capsys.readouterr().out.strip()


def test_labels_are_set_on_create_and_changed_by_label_and_rename(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _create(
        gateway, capsys, "--episodes", "20", "--label", "team=vision", "--label", "sweep=lr"
    )
    assert dict(gateway.client.get_run(run_id).labels) == {"team": "vision", "sweep": "lr"}
    gateway.finished(run_id)  # a finished run is relabelled too

    assert gateway.cli("runs", "label", run_id, "sweep-", "best=yes", "team=nlp") == 0
    out = capsys.readouterr().out
    assert "labels:      best=yes, team=nlp" in out
    assert dict(gateway.client.get_run(run_id).labels) == {"best": "yes", "team": "nlp"}

    assert gateway.cli("runs", "rename", run_id, "high lr") == 0
    assert "name:        high lr" in capsys.readouterr().out
    run = gateway.client.get_run(run_id)
    assert (run.display_name, dict(run.labels)) == ("high lr", {"best": "yes", "team": "nlp"})

    assert gateway.cli("--json", "runs", "label", run_id, "team-") == 0
    assert json.loads(capsys.readouterr().out)["run"]["labels"] == {"best": "yes"}

    # A bad key is refused by name, the labels left as they were.
    assert gateway.cli("runs", "label", run_id, "bad_=x") == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: INVALID_ARGUMENT: cannot update run '{run_id}': run.labels[bad_]"
    )
    assert dict(gateway.client.get_run(run_id).labels) == {"best": "yes"}
    assert gateway.cli("runs", "create", "imitation", "--clip", "wave", "--label", "a=b c") == 1
    assert "labels[a]" in capsys.readouterr().err
    assert gateway.cli("runs", "label", "no-such-run", "a=b") == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_compare_prints_what_differs_and_each_runs_figures(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    high = _create(
        gateway,
        capsys,
        "--episodes",
        "40",
        "--learning-rate",
        "0.001",
        "--label",
        "sweep=lr",
        "--name",
        "high",
    )
    low = _create(
        gateway, capsys, "--episodes", "40", "--learning-rate", "0.0003", "--label", "sweep=lr"
    )
    done = [gateway.finished(run_id) for run_id in (high, low)]

    assert gateway.cli("compare", high, low) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "NAME", "STATE", "EPISODE", "REWARD", "BEST"]
    for line, run in zip(lines[1:3], done, strict=True):
        cells = line.split()
        assert cells[0] == run.id and cells[2:4] == ["DONE", "40/40"]
        assert (float(cells[4]), float(cells[5])) == pytest.approx(
            (run.reward, run.best_reward), rel=1e-5
        )
    fields = {line.split()[0]: line.split()[1:] for line in lines[4:]}
    assert fields["FIELD"] == [high, low]
    assert fields["task.imitation.learning_rate"] == ["0.001", "0.0003"]
    assert "labels.sweep" not in fields and "config.max_episodes" not in fields  # the same

    assert gateway.cli("--json", "compare", high, low, "--all") == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["displayName"], r["state"], r["episode"]) for r in data["runs"]] == [
        (high, "high", "STATE_DONE", 40),
        (low, "", "STATE_DONE", 40),
    ]
    every = {f["field"]: f["values"] for f in data["fields"]}
    assert every["labels.sweep"] == ["lr", "lr"]
    assert every["config.max_episodes"] == [40, 40]
    assert every["task.imitation.learning_rate"] == [0.001, 0.0003]

    assert gateway.cli("compare", high, "no-such-run") == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert gateway.cli("compare", high) == 1
    assert capsys.readouterr().err == f"error: give at least 2 different runs (got {high})\n"


def test_plot_overlays_two_runs(
    gateway: Gateway, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fake trainer's reward is a function of the episode: runs of different lengths, so
    # neither mean line hides the other.
    long = _create(gateway, capsys, "--episodes", "80", "--name", "long")
    short = _create(gateway, capsys, "--episodes", "30")
    for run_id in (long, short):
        gateway.finished(run_id)
    out = tmp_path / "overlay.png"
    assert gateway.cli("plot", long, short, "--out", str(out), "--metrics", "loss") == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote {out} (runs {long} (80 episodes), {short} (30 episodes))"
    )
    image = Image.open(out)
    width, height = render.CURVE_SIZE
    assert image.format == "PNG" and image.size == (width, height + render.METRIC_PANEL_HEIGHT)
    colours = dict((c, n) for n, c in image.convert("RGB").getcolors(1 << 18) or [])
    assert colours.get(render.run_colour(0), 0) > 300 and colours.get(render.run_colour(1), 0) > 300
    # One run keeps the single-run look.
    single = tmp_path / "single.png"
    assert gateway.cli("plot", long, "--out", str(single)) == 0
    assert capsys.readouterr().out.strip() == f"wrote {single} (80 episodes of run {long})"
    drawn = {c for _, c in Image.open(single).convert("RGB").getcolors(1 << 16) or []}
    assert {render.MEAN, render.BEST, render.REWARD} <= drawn


# -- fork and set: the real imitation trainer (a process, on the CPU) writing checkpoints ---------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def trainer(checkpoints: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    flags = ("--heartbeat", "0.5", "--checkpoint-store", str(checkpoints))
    with trainer_process(log, *flags, slots=1) as (_, address):
        yield address


@pytest.fixture
def trained(trainer: str, checkpoints: pathlib.Path) -> Iterator[Gateway]:
    """A real gateway in a thread, its trainer the real one, sharing its checkpoint store."""
    stack = contextlib.AsyncExitStack()

    async def start() -> tuple[grpc.aio.Server | None, int]:
        client = await stack.enter_async_context(
            running_gateway(
                (trainer,),
                checkpoint_store=str(checkpoints),
                heartbeat_timeout_s=3.0,
                schedule_poll_s=0.2,
            )
        )
        return client.gateway.server, client.gateway.port

    with (
        ThreadedServer(start, stack.aclose) as served,
        tc.GatewayClient(served.target, timeout=TIMEOUT) as client,
    ):
        yield Gateway(LiveStack(served.target), client)


def _episodes(gw: Gateway, run_id: str) -> list[episode_pb2.Episode]:
    return [e for e in gw.client.watch(run_id) if isinstance(e, episode_pb2.Episode)]


@pytest.mark.timeout(300)
def test_runs_fork_continues_a_checkpoint_with_the_changes(
    trained: Gateway, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = trained
    parent = _create(
        gw,
        capsys,
        "--episodes",
        "100",
        "--checkpoint-every",
        "50",
        "--keep-checkpoints",
        "10",
        "--seed",
        "3",
        "--label",
        "sweep=lr",
        "--label",
        "old=yes",
        "--name",
        "parent",
    )
    assert gw.finished(parent).state == tc.Run.State.STATE_DONE

    argv = ("runs", "fork", parent, "--episode", "50", "--lr", "0.003", "--episodes", "150")
    assert gw.cli(*argv, "--label", "variant=slow", "--label", "old-", "-q") == 0
    child = capsys.readouterr().out.strip()
    assert gw.finished(child).state == tc.Run.State.STATE_DONE
    run = gw.client.get_run(child)
    assert (run.fork_from.run_id, run.fork_from.episode) == (parent, 50)
    assert dict(run.labels) == {"sweep": "lr", "variant": "slow"}
    assert (run.task.imitation.learning_rate, run.config.max_episodes) == (0.003, 150)
    assert (run.config.seed, run.task.imitation.clip_name) == (3, "wave")  # the parent's
    numbers = [e.episode for e in _episodes(gw, child)]
    assert numbers == list(range(51, 151))

    assert gw.cli("runs", "get", child) == 0
    assert f"forked from: run {parent} at episode 50" in capsys.readouterr().out
    assert gw.cli("--json", "compare", parent, child) == 0
    fields = {f["field"]: f["values"] for f in json.loads(capsys.readouterr().out)["fields"]}
    assert fields["fork_from"] == [None, f"{parent}@50"]
    assert fields["config.max_episodes"] == [100, 150]
    assert fields["labels.variant"] == [None, "slow"]
    assert fields["labels.old"] == ["yes", None]
    assert len(fields["task.imitation.learning_rate"]) == 2
    out = tmp_path / "fork.png"
    assert gw.cli("plot", parent, child, "--out", str(out)) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote {out} (runs {parent} (100 episodes), {child} (150 episodes))"
    )

    # What cannot fork is refused by the gateway, which says why; the CLI prints it.
    assert gw.cli("runs", "fork", parent, "--episode", "75") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: ") and "fork_from.episode" in err
    assert gw.cli("runs", "fork", parent, "--episode", "50", "--episodes", "50") == 1
    assert "config.max_episodes" in capsys.readouterr().err
    # A setting the task kind lacks never reaches it.
    assert gw.cli("runs", "fork", parent, "--temperature", "0.5") == 1
    assert capsys.readouterr().err == (
        f"error: --temperature applies to grpo runs; run {parent} is an imitation run\n"
    )


@pytest.mark.timeout(300)
def test_set_changes_a_running_runs_learning_rate(
    trained: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = trained
    assert (
        gw.cli(
            "runs",
            "create",
            "imitation",
            "--clip",
            "wave",
            "--episodes",
            "150",
            "--rate",
            "40",
            "-q",
        )
        == 0
    )
    run_id = capsys.readouterr().out.strip()
    wait_for(lambda: gw.client.get_run(run_id).episode >= 10, "10 episodes")
    assert gw.cli("set", run_id, "--lr", "0.002") == 0
    assert capsys.readouterr().out.startswith(f"set learning_rate 0.002: run {run_id}  ")
    assert gw.finished(run_id).task.imitation.learning_rate == 0.002
    rates = [e.metrics["learning_rate"] for e in _episodes(gw, run_id)]
    assert rates[0] != 0.002 and rates[-1] == 0.002
    changed = rates.index(0.002)
    assert set(rates[changed:]) == {0.002}  # changed once, where it happened

    assert gw.cli("set", run_id, "--lr", "0.001") == 1
    assert capsys.readouterr().err.startswith("error: FAILED_PRECONDITION: ")
    assert gw.cli("set", run_id, "--lr", "2") == 1
    assert "learning_rate: 2.0; need a finite value in (0, 1]" in capsys.readouterr().err
    assert gw.cli("set", run_id) == 1
    assert "give at least one of --learning-rate, --temperature, --beta" in capsys.readouterr().err
