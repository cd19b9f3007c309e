"""Streams GRPOTrainer's optimizer steps out as episodes, and stops training on request.

``GRPOTrainer.train()`` runs in a worker thread owned by the provider; :class:`StreamingCallback`
(a ``TrainerCallback``) turns each step's log record into an ``Episode`` and hands it to the
consuming generator through an :class:`EpisodeHandoff` (a bounded queue, so a consumer that stops
reading — a paused run — stalls training instead of piling up episodes).

Reward on every step: TRL logs ``reward`` only for steps that generated completions. With
``steps_per_generation`` > ``gradient_accumulation_steps`` (or ``num_iterations`` > 1) some
optimizer steps reuse the completions of an earlier generation batch and log no reward. Such a
step trained on exactly that generation batch, so its episode carries that batch's reward (the
latest logged one) and ``metrics["reward_carried"] = 1.0``; steps that generated carry their own
reward and ``reward_carried = 0.0``. The sample completions follow the same rule (they come from
the :class:`~.rewards.CompletionTap`, which holds the latest scored batch).

Stop: ``on_step_end`` sets ``control.should_training_stop`` when the job's stop event is set or
the consumer went away, so ``train()`` returns after the current step.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer_service.core.provider import EpisodeCounter
from trainer_service.providers.grpo.rewards import CompletionTap
from trainwire.contract import MAX_COMPLETION_BYTES
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Sample completions attached to each episode.
SAMPLE_COMPLETIONS = 4
# Keys of Trainer's end-of-training summary log; that record is not a step.
_SUMMARY_KEYS = frozenset({"train_runtime", "train_loss", "train_samples_per_second"})


class _End:
    """Queue sentinel: training finished (``error`` set when it failed)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class EpisodeHandoff:
    """A bounded hand-off of episodes from the training thread to the consuming generator.

    Args:
        capacity: Episodes that may wait unread before the training thread blocks.
    """

    def __init__(self, capacity: int = 2) -> None:
        self._queue: queue.Queue[episode_pb2.Episode | _End] = queue.Queue(maxsize=capacity)
        self.closed = threading.Event()

    def put(self, episode: episode_pb2.Episode) -> bool:
        """Blocks until the episode is queued; returns False (dropping it) once closed."""
        while not self.closed.is_set():
            try:
                self._queue.put(episode, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def finish(self, error: BaseException | None = None) -> None:
        """Marks the end of training (never blocks: the end marker always fits)."""
        while True:
            try:
                self._queue.put_nowait(_End(error))
                return
            except queue.Full:
                if self.closed.is_set():
                    return
                # Make room: an unread episode matters less than the end marker once closing.
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue

    def get(self) -> episode_pb2.Episode | _End:
        """The next episode or the end marker (blocks)."""
        return self._queue.get()

    def close(self) -> None:
        """The consumer is gone: pending and future puts are dropped."""
        self.closed.set()


def finite_metrics(logs: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a log record (bools, strings and NaN/inf dropped)."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        number = float(value)
        if math.isfinite(number):
            out[key] = number
    return out


def truncate_utf8(text: str, limit: int = MAX_COMPLETION_BYTES) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, never splitting a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return data[:limit].decode("utf-8", errors="ignore")


def is_step_log(logs: Mapping[str, Any] | None, step: int, last_step: int) -> bool:
    """Whether a log record is a new optimizer step's (not the end-of-training summary)."""
    return bool(logs) and not (_SUMMARY_KEYS & logs.keys()) and step > last_step  # type: ignore[union-attr]


class EpisodeMaker:
    """Turns one step's log record into the next episode (see the module docstring for rewards).

    Shared by the in-thread :class:`StreamingCallback` and the job processes' step gate.

    Args:
        counter: Numbers episodes and tracks ``best_reward`` / ``done``.
        tap: Holds the latest scored batch's completions.
        samples: Sample completions per episode.
    """

    def __init__(
        self,
        counter: EpisodeCounter,
        tap: CompletionTap | None = None,
        samples: int = SAMPLE_COMPLETIONS,
    ) -> None:
        self.counter = counter
        self.tap = tap
        self.samples = samples
        self.last_reward: float | None = None

    def make(self, logs: Mapping[str, Any]) -> episode_pb2.Episode:
        """The next episode from one step's log record."""
        metrics = finite_metrics(logs)
        reward = metrics.get("reward")
        carried = reward is None
        if reward is not None:
            self.last_reward = reward
        elif self.last_reward is not None:
            reward = self.last_reward
        else:
            # Only possible if the very first step logged no (finite) reward: every reward
            # function returned None for every completion.
            _LOGGER.warning("step %d logged no reward; reporting 0.0", self.counter.next_episode)
            reward = 0.0
        metrics["reward"] = reward
        metrics["reward_carried"] = 1.0 if carried else 0.0
        detail = episode_pb2.GrpoDetail()
        if self.tap is not None:
            _, texts = self.tap.latest()
            detail.sample_completions.extend(truncate_utf8(t) for t in texts[: self.samples])
        return self.counter.make(reward, metrics, grpo=detail)


class StreamingCallback(TrainerCallback):
    """Turns GRPOTrainer step logs into episodes and stops training on request.

    Args:
        counter: Numbers episodes and tracks ``best_reward`` / ``done``.
        handoff: Where episodes go.
        stop_event: The job's stop event (cancel or shutdown).
        tap: Holds the latest scored batch's completions.
        samples: Sample completions per episode.
    """

    def __init__(
        self,
        counter: EpisodeCounter,
        handoff: EpisodeHandoff,
        stop_event: threading.Event,
        tap: CompletionTap | None = None,
        samples: int = SAMPLE_COMPLETIONS,
    ) -> None:
        self.counter = counter
        self.handoff = handoff
        self.stop_event = stop_event
        self.tap = tap
        self.maker = EpisodeMaker(counter, tap, samples)
        self.last_step = 0

    def _should_stop(self) -> bool:
        return self.stop_event.is_set() or self.handoff.closed.is_set()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        if self._should_stop():
            control.should_training_stop = True
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        if not is_step_log(logs, state.global_step, self.last_step) or logs is None:
            return control
        if self.counter.finished:
            return control
        self.last_step = state.global_step
        episode = self.build_episode(logs)
        if not self.handoff.put(episode):
            control.should_training_stop = True
        return control

    def build_episode(self, logs: Mapping[str, Any]) -> episode_pb2.Episode:
        """The next episode from one step's log record (see the module docstring for rewards)."""
        return self.maker.make(logs)
