"""A rank's step gate (its episodes, its waits for the trainer's go) and what a rank's failures
read as, driven like Trainer's loop drives them, without a model."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from transformers import TrainerControl, TrainerState

from tests.fakes.waiting import TIMEOUT
from trainer_service.core.provider import EpisodeCounter, ProviderError
from trainer_service.providers.grpo import wire
from trainer_service.providers.grpo.callback import (
    EpisodeMaker,
    StepGate,
    finite_metrics,
    truncate_utf8,
)
from trainer_service.providers.grpo.lazy_images import DatasetError
from trainer_service.providers.grpo.rewards import CompletionTap, format_reward
from trainer_service.providers.grpo.worker import (
    OUT_OF_MEMORY_ADVICE,
    RankChannel,
    translate_error,
)
from trainwire.contract import MAX_COMPLETION_BYTES, StreamChecker
from trainwire.v1 import episode_pb2

ARGS: Any = None  # the gate never reads TrainingArguments


def _step_logs(reward: float | None) -> dict[str, float]:
    logs = {"loss": 0.5, "grad_norm": 1.0, "learning_rate": 1e-5, "entropy": float("nan")}
    if reward is not None:
        logs["reward"] = reward
        logs["reward_std"] = 0.1
    return logs


class GrantingChannel:
    """A rank's channel whose trainer grants every step: records episodes and waits."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.last_step = 0
        self.episodes: list[episode_pb2.Episode] = []
        self.waits: list[int] = []
        self.stop_at = stop_at

    def send_episode(self, episode: episode_pb2.Episode) -> None:
        self.episodes.append(episode)

    def wait_step(self, step: int) -> bool:
        self.waits.append(step)
        return step != self.stop_at


def test_finite_metrics_and_truncation() -> None:
    logs = {"a": 1, "b": float("inf"), "c": "text", "d": True, "e": 2.5, "f": float("nan")}
    assert finite_metrics(logs) == {"a": 1.0, "e": 2.5}
    text = "é" * 3000  # 6000 bytes
    cut = truncate_utf8(text)
    assert len(cut.encode("utf-8")) <= MAX_COMPLETION_BYTES and text.startswith(cut)
    assert truncate_utf8("short") == "short"


def test_episodes_carry_a_reward_on_every_step() -> None:
    tap = CompletionTap()
    (score,) = tap.wrap([format_reward], ["format"])
    channel = GrantingChannel()
    gate = StepGate(EpisodeMaker(EpisodeCounter(4), tap), channel, max_steps=4)
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
            score(
                prompts=[[]] * len(texts),
                completions=[[{"role": "assistant", "content": t}] for t in texts],
            )
        state.global_step = step
        gate.on_log(ARGS, state, control, logs=_step_logs(reward))
        gate.on_log(ARGS, state, control, logs=_step_logs(reward))  # same step again: ignored
    state.global_step = 4
    gate.on_log(ARGS, state, control, logs={"train_runtime": 1.0, "train_loss": 0.5})
    episodes = channel.episodes
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
    # Each step waits for the trainer's word on the next one (after the last: to end).
    assert channel.waits == [2, 3, 4, 5] and channel.last_step == 4
    assert not control.should_training_stop


def test_a_stop_from_the_trainer_stops_training_after_the_step_and_other_ranks_send_nothing() -> (
    None
):
    channel = GrantingChannel(stop_at=3)
    gate = StepGate(None, channel, max_steps=10)  # a rank other than 0
    state, control = TrainerState(), TrainerControl()
    for step in (1, 2):
        state.global_step = step
        gate.on_log(ARGS, state, control, logs=_step_logs(0.5))
        if control.should_training_stop:
            break
    assert channel.waits == [2, 3] and control.should_training_stop
    assert channel.episodes == [] and channel.last_step == 2


def test_a_step_waits_on_the_rank_channel_for_the_trainer() -> None:
    """A paused run: the step's episode is out and training waits for the next STEP (or STOP)."""
    trainer, rank_end = wire.ChannelEnd.pair()
    channel = RankChannel(wire.ChannelEnd(rank_end), beat_s=60.0)
    channel.start()
    gate = StepGate(EpisodeMaker(EpisodeCounter(10)), channel, max_steps=10)
    controls: list[bool] = []

    def step(n: int) -> threading.Thread:
        def run() -> None:
            state, control = TrainerState(), TrainerControl()
            state.global_step = n
            gate.on_log(ARGS, state, control, logs=_step_logs(0.5))
            controls.append(control.should_training_stop)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        first = step(1)
        message = trainer.recv()
        assert message is not None and message[0] == wire.EPISODE
        assert episode_pb2.Episode.FromString(message[1]).episode == 1
        first.join(0.2)
        assert first.is_alive()  # no grant: training waits, with nothing pending
        assert trainer.send_step(2)
        first.join(TIMEOUT)
        assert not first.is_alive() and controls == [False]
        second = step(2)
        assert trainer.recv() is not None  # episode 2
        assert trainer.send(wire.STOP)
        second.join(TIMEOUT)
        assert controls == [False, True] and channel.stopped.is_set()
        assert channel.last_step == 2
    finally:
        channel.finishing.set()  # the end of file below is expected: no group kill
        trainer.close()


def test_a_rank_failure_reads_as_what_the_user_can_act_on() -> None:
    oom = translate_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"))
    assert isinstance(oom, ProviderError) and oom.user_message == OUT_OF_MEMORY_ADVICE
    assert (oom.code, oom.reason) == ("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY")
    host = translate_error(MemoryError())
    assert isinstance(host, ProviderError) and host.reason == "OUT_OF_MEMORY"
    # A dataset row that failed in a DataLoader worker: torch wraps it with the traceback.
    wrapped = DatasetError(
        "Caught DatasetError in DataLoader worker process 0.\nOriginal Traceback (most recent "
        "call last):\n  ...\ntrainer_service.DatasetError: Dataset line 3 of a.jsonl: bad.\n"
    )
    plain = translate_error(wrapped)
    assert isinstance(plain, DatasetError)
    assert plain.user_message == "Dataset line 3 of a.jsonl: bad." and "Traceback" in plain.detail
    own = ProviderError("The model could not be loaded.")
    assert translate_error(own) is own
    other = RuntimeError("boom")
    assert translate_error(other) is other


def test_the_last_step_waits_for_the_trainers_word_to_end() -> None:
    # The trainer may checkpoint the last step before it lets the ranks end (with a STOP).
    channel = GrantingChannel(stop_at=2)
    gate = StepGate(EpisodeMaker(EpisodeCounter(1)), channel, max_steps=1)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 1
    gate.on_log(ARGS, state, control, logs=_step_logs(1.0))
    assert channel.waits == [2] and [e.done for e in channel.episodes] == [True]
    assert control.should_training_stop
