"""``trainwire watch`` on a GRPO run shows its latest answers: each answer beside the expected
one and its reward, from the latest episode that carried samples; model output and dataset text
reach the terminal as plain, escaped text. Through the CLI's entry point against the real
gateway over the fake trainer (whose GRPO steps carry ``scripted_samples``), and the view alone
for what a server could send."""

from __future__ import annotations

import pytest
from rich.console import Console

from tests.fakes.episodes import scripted_samples
from tests.fakes.fake_trainer import Script
from tests.integration.test_cli_commands import Gateway, gateway
from trainwire import client as tc
from trainwire.cli._watch import SHOWN_ANSWERS, WatchView
from trainwire.client import EpisodeView
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = pytest.mark.timeout(60)

__all__ = ["gateway"]  # the fixture, re-exported for pytest


def test_watch_shows_the_latest_answers_of_a_grpo_run(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway.stack.fake.push(Script(motion=True))  # GRPO steps with two samples each
    run = gateway.client.create_run(
        tc.grpo_task(model="models/tiny-vlm", dataset="colours.jsonl"),
        tc.train_config(9),
        episodes_per_second=-1.0,
    )
    gateway.finished(run.id)
    proxy = gateway.stack.proxy()
    assert gateway.cli("watch", run.id, target=proxy.target) == 0
    # The history as numbers; the samples (thumbnails) of the latest episode on only.
    views = [(r.after_episode, r.view) for r in proxy.watch_requests]
    assert sorted(views) == [
        (0, EpisodeView.EPISODE_VIEW_SCALARS),
        (8, EpisodeView.EPISODE_VIEW_FULL),
    ]
    out = capsys.readouterr().out
    assert "9/9" in out and "DONE" in out
    assert "latest answers (episode 9)" in out
    lines = out.splitlines()
    for sample in scripted_samples(9):
        row = next(line for line in lines if sample.completion in line)
        assert sample.solution in row and f"{sample.reward:.2f}" in row, row
    assert "<b>" in out  # markup in an answer is text, not a style


def _view_with(*samples: episode_pb2.GrpoSample) -> str:
    run = gateway_service_pb2.Run(
        id="r-9", config=episode_pb2.TrainConfig(max_episodes=10), task=episode_pb2.TrainTask()
    )
    view = WatchView(run)
    shown = episode_pb2.Episode(episode=3, reward=1.0, best_reward=1.0)
    shown.grpo.samples.extend(samples)
    view.on_event(shown)
    later = episode_pb2.Episode(episode=4, reward=0.5, best_reward=1.0)
    later.grpo.sample_completions.append("a completion, no samples")
    view.on_event(later)  # an episode without samples keeps the latest ones shown
    console = Console(width=120, record=True, color_system=None)
    console.print(view.render())
    return console.export_text()


def test_answers_are_shown_as_escaped_text_and_at_most_a_few() -> None:
    hostile = episode_pb2.GrpoSample(
        completion="[bold]red[/bold]\x1b[2J\nsecond line " + "x" * 80,
        solution="red\x07",
        reward=-0.5,
        rewards={"exact_match": 0.0},
    )
    plain = episode_pb2.GrpoSample(completion="blue", reward=2.0)
    text = _view_with(hostile, *[plain] * SHOWN_ANSWERS)
    assert "latest answers (episode 3)" in text
    assert "[bold]red[/bold]\\x1b[2J second line xxx" in text  # one line, escaped, no markup
    assert "…" in text and "x" * 80 not in text  # cut
    assert "red\\x07" in text and "\x1b" not in text and "\x07" not in text
    assert "-0.50" in text and text.count("blue") == SHOWN_ANSWERS - 1
