"""The streaming callback, the episode hand-off and the provider's threads (with a fake trainer)."""

from __future__ import annotations

import math
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import TrainerControl, TrainerState

from tests.grpo_fixtures import make_job, tiny_grpo_task
from trainer_service.core.provider import EpisodeCounter
from trainer_service.providers.grpo import provider
from trainer_service.providers.grpo.callback import (
    EpisodeHandoff,
    StreamingCallback,
    _End,
    finite_metrics,
    truncate_utf8,
)
from trainer_service.providers.grpo.rewards import CompletionTap
from trainwire.contract import MAX_COMPLETION_BYTES, StreamChecker
from trainwire.v1 import episode_pb2

ARGS: Any = None  # the callback never reads TrainingArguments


def _step_logs(reward: float | None) -> dict[str, float]:
    logs = {"loss": 0.5, "grad_norm": 1.0, "learning_rate": 1e-5, "entropy": float("nan")}
    if reward is not None:
        logs["reward"] = reward
        logs["reward_std"] = 0.1
    return logs


def _drain(handoff: EpisodeHandoff) -> list[episode_pb2.Episode]:
    out = []
    while not handoff._queue.empty():
        item = handoff.get()
        assert not isinstance(item, _End)
        out.append(item)
    return out


def test_finite_metrics_and_truncation() -> None:
    logs = {"a": 1, "b": float("inf"), "c": "text", "d": True, "e": 2.5, "f": float("nan")}
    assert finite_metrics(logs) == {"a": 1.0, "e": 2.5}
    text = "é" * 3000  # 6000 bytes
    cut = truncate_utf8(text)
    assert len(cut.encode("utf-8")) <= MAX_COMPLETION_BYTES and text.startswith(cut)
    assert truncate_utf8("short") == "short"


def test_episodes_carry_a_reward_on_every_step() -> None:
    counter = EpisodeCounter(4)
    handoff = EpisodeHandoff(capacity=8)
    tap = CompletionTap()
    callback = StreamingCallback(counter, handoff, threading.Event(), tap)
    state, control = TrainerState(), TrainerControl()
    checker = StreamChecker("grpo", 4, "run-cb")
    # Steps 1 and 3 generated; steps 2 and 4 reused their generation batch and logged no reward.
    for step, reward, texts in [
        (1, 0.25, ["a", "b"]),
        (2, None, None),
        (3, 0.75, ["x" * 5000] * 6),
        (4, None, None),
    ]:
        if texts is not None:
            tap.record([[{"role": "assistant", "content": t}] for t in texts])
        state.global_step = step
        callback.on_step_end(ARGS, state, control)
        callback.on_log(ARGS, state, control, logs=_step_logs(reward))
        callback.on_log(ARGS, state, control, logs=_step_logs(reward))  # same step again: ignored
    state.global_step = 4
    callback.on_log(ARGS, state, control, logs={"train_runtime": 1.0, "train_loss": 0.5})
    episodes = _drain(handoff)
    for episode in episodes:
        checker.check(episode)
    checker.finish()
    assert [e.reward for e in episodes] == [0.25, 0.25, 0.75, 0.75]
    assert [e.metrics["reward_carried"] for e in episodes] == [0.0, 1.0, 0.0, 1.0]
    assert [e.best_reward for e in episodes] == [0.25, 0.25, 0.75, 0.75]
    assert [e.done for e in episodes] == [False, False, False, True]
    assert "entropy" not in episodes[0].metrics and episodes[0].metrics["loss"] == 0.5
    assert list(episodes[1].grpo.sample_completions) == ["a", "b"]
    assert len(episodes[2].grpo.sample_completions) == 4
    assert all(len(t.encode()) <= MAX_COMPLETION_BYTES for t in episodes[2].grpo.sample_completions)
    assert all(math.isfinite(v) for e in episodes for v in e.metrics.values())
    assert not control.should_training_stop


def test_stop_event_stops_at_step_end() -> None:
    stop = threading.Event()
    callback = StreamingCallback(EpisodeCounter(10), EpisodeHandoff(), stop)
    control = TrainerControl()
    callback.on_step_end(ARGS, TrainerState(), control)
    assert not control.should_training_stop
    stop.set()
    callback.on_step_end(ARGS, TrainerState(), control)
    assert control.should_training_stop


def test_closed_handoff_unblocks_the_trainer_and_stops_it() -> None:
    handoff = EpisodeHandoff(capacity=1)
    callback = StreamingCallback(EpisodeCounter(10), handoff, threading.Event())
    state, control = TrainerState(), TrainerControl()
    state.global_step = 1
    callback.on_log(ARGS, state, control, logs=_step_logs(1.0))  # fills the queue
    state.global_step = 2
    blocked = threading.Thread(
        target=callback.on_log, args=(ARGS, state, control), kwargs={"logs": _step_logs(1.0)}
    )
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # a consumer that does not read stalls training (back-pressure)
    handoff.close()
    blocked.join(5)
    assert not blocked.is_alive()
    assert control.should_training_stop
    handoff.finish(None)  # never blocks once closed


class _FakeTrainer:
    """Calls the callbacks like Trainer's inner loop does, one fake step at a time."""

    lazy_dataset = None  # no rows for the provider's background check

    def __init__(self, callbacks: list[Any], steps: int, step_seconds: float = 0.0) -> None:
        self.callbacks = callbacks
        self.steps = steps
        self.step_seconds = step_seconds
        self.steps_done = 0
        self.thread: threading.Thread | None = None

    def train(self) -> None:
        self.thread = threading.current_thread()
        state, control = TrainerState(), TrainerControl()
        pause = threading.Event()
        for step in range(1, self.steps + 1):
            pause.wait(self.step_seconds)
            state.global_step = step
            self.steps_done = step
            for cb in self.callbacks:
                control = cb.on_step_end(ARGS, state, control)
            for cb in self.callbacks:
                control = cb.on_log(ARGS, state, control, logs=_step_logs(step / 10))
            if control.should_training_stop:
                return
        if self.steps == 99:
            raise RuntimeError("boom")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    made: dict[str, Any] = {}

    def build(job: Any, callbacks: Any, **kwargs: Any) -> _FakeTrainer:
        trainer = _FakeTrainer(list(callbacks), made["steps"], made.get("step_seconds", 0.0))
        made["trainer"] = trainer
        return trainer

    monkeypatch.setattr(provider, "build_trainer", build)
    return made


def _job(max_episodes: int, stop: threading.Event | None = None) -> Any:
    return make_job(
        pathlib.Path("/nonexistent"), tiny_grpo_task(), max_episodes=max_episodes, stop_event=stop
    )


def test_run_streams_every_step_and_joins(fake: dict[str, Any]) -> None:
    fake["steps"] = 5
    episodes = list(provider.run(_job(5)))
    assert [e.episode for e in episodes] == [1, 2, 3, 4, 5] and episodes[-1].done
    assert not fake["trainer"].thread.is_alive()


def test_closing_the_generator_stops_training_and_joins(fake: dict[str, Any]) -> None:
    fake["steps"] = 1000
    fake["step_seconds"] = 0.01
    stream: Iterator[episode_pb2.Episode] = provider.run(_job(1000))
    assert next(stream).episode == 1
    stream.close()  # type: ignore[attr-defined]
    trainer = fake["trainer"]
    assert not trainer.thread.is_alive()  # joined before close() returned
    assert trainer.steps_done <= 4  # 1 read + 2 queued + the step in flight


def test_stop_event_ends_the_stream_within_a_step(fake: dict[str, Any]) -> None:
    fake["steps"] = 1000
    fake["step_seconds"] = 0.01
    stop = threading.Event()
    seen = []
    for episode in provider.run(_job(1000, stop)):
        seen.append(episode.episode)
        if episode.episode == 2:
            stop.set()
    assert seen[-1] <= 5 and not any(e == 1000 for e in seen)
    assert not fake["trainer"].thread.is_alive()


def test_training_errors_reach_the_consumer(fake: dict[str, Any]) -> None:
    fake["steps"] = 99
    with pytest.raises(RuntimeError, match="boom"):
        list(provider.run(_job(200)))
    assert not fake["trainer"].thread.is_alive()
