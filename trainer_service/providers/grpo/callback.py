"""A rank's ``TrainerCallback``: each optimizer step's log becomes an episode, and each step waits
for the trainer's go.

:class:`StepGate` runs in every rank of a GRPO job (:mod:`.worker`). At each step's ``on_log``
(after the step's collectives are done) rank 0 turns the step's log record into the next episode
(:class:`EpisodeMaker`) and sends it; then every rank waits for the trainer's next message: the
step after (train on) or a stop (training stops after this step); a checkpoint of the step asked
for meanwhile is written by the channel before it returns (:mod:`.worker`). A paused run thus
waits with no collective pending, and every rank takes the same decision at every step
boundary. The last step waits too, so the trainer can checkpoint it before the ranks end.

Reward on every step: TRL logs ``reward`` only for steps that generated completions. With
``steps_per_generation`` > ``gradient_accumulation_steps`` (or ``num_iterations`` > 1) some
optimizer steps reuse the completions of an earlier generation batch and log no reward. Such a
step trained on exactly that generation batch, so its episode carries that batch's reward (the
latest logged one) and ``metrics["reward_carried"] = 1.0``; steps that generated carry their own
reward and ``reward_carried = 0.0``. The sample completions follow the same rule (they come from
the :class:`~.rewards.CompletionTap`, which holds the latest scored batch).

Hyperparameters on every step: ``learning_rate`` (TRL logs the rate the step's optimizer used),
``temperature`` and ``beta`` (the values the step sampled and weighed the KL with), so a live
change shows at the step it applied to.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

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
        #: The sampling temperature and beta the step used (``learning_rate`` is in TRL's own
        #: log record: the step's scheduled rate); None: not reported.
        self.hyperparameters: Callable[[], Mapping[str, float]] | None = None

    def make(self, logs: Mapping[str, Any]) -> episode_pb2.Episode:
        """The next episode from one step's log record."""
        metrics = finite_metrics(logs)
        if self.hyperparameters is not None:
            metrics.update(self.hyperparameters())
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


class StepChannel(Protocol):
    """What :class:`StepGate` needs of a rank's channel to the trainer."""

    last_step: int  #: the last optimizer step this rank finished

    def send_episode(self, episode: episode_pb2.Episode) -> None:
        """Sends an episode to the trainer."""
        ...

    def wait_step(self, step: int) -> bool:
        """Blocks for the trainer's next message: True to run ``step``, False to stop (a
        checkpoint asked for meanwhile is written first)."""
        ...


class StepGate(TrainerCallback):  # type: ignore[misc]
    """Sends rank 0's episodes and gates every optimizer step (see the module docstring).

    Args:
        maker: Builds episodes (rank 0); ``None`` on other ranks.
        channel: The rank's channel to the trainer.
        max_steps: The job's optimizer steps.
    """

    def __init__(self, maker: EpisodeMaker | None, channel: StepChannel, max_steps: int) -> None:
        self.maker = maker
        self.channel = channel
        self.max_steps = max_steps
        self.last_step = 0

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        if logs is None or not is_step_log(logs, state.global_step, self.last_step):
            return control
        self.last_step = self.channel.last_step = state.global_step
        if self.maker is not None and not self.maker.counter.finished:
            self.channel.send_episode(self.maker.make(logs))
        # Every rank reads the same message here, after the step's collectives: all run the
        # next step or all stop, and none waits inside a collective while a run is paused.
        # After the last step the trainer's word is a stop, perhaps after a checkpoint.
        if not self.channel.wait_step(state.global_step + 1):
            control.should_training_stop = True
        return control
