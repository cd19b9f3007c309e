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
reward and ``reward_carried = 0.0``. The samples follow the same rule (they come from the
:class:`~.rewards.CompletionTap`, which holds the latest scored batch).

Samples: ``detail.grpo.samples`` holds up to ``MAX_SAMPLES`` of the batch's scored completions,
each with its prompt, a thumbnail of its row's first image (:mod:`.thumbnails`), its total and
per-function rewards and its row's solution. They are spread over the batch's prompts: the
first completion of each prompt in batch order, then the second of each, and so on, so a batch
of many prompts shows as many different images as it can, and a batch of one prompt several of
its answers. (A batch lists each prompt's completions together: TRL's sampler repeats each row
``num_generations`` times in a row.) A carried step shows its batch's samples again, encoded
once. ``sample_completions`` keeps the first ``SAMPLE_COMPLETIONS`` completions' texts, for
clients that read only those.

Step metrics on every step (:mod:`.step_metrics`): ``step_time``, ``generate_time`` and
``completion_tokens_per_second`` (and ``gpu_memory_peak_gib`` on CUDA) from the maker's
:class:`~.step_metrics.StepMeter`, which the gate tells where each step begins and ends;
``step_time`` replaces TRL's own metric of that name (which leaves out loading the batch and
the optimizer's update).

Hyperparameters on every step: ``learning_rate`` (TRL logs the rate the step's optimizer used),
``temperature`` and ``beta`` (the values the step sampled and weighed the KL with), so a live
change shows at the step it applied to.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer_service.core.provider import EpisodeCounter
from trainer_service.providers.grpo.rewards import CompletionTap, ScoredBatch
from trainer_service.providers.grpo.step_metrics import StepMeter
from trainer_service.providers.grpo.thumbnails import as_image, thumbnail
from trainwire.contract import MAX_COMPLETION_BYTES, MAX_SAMPLE_TEXT_BYTES, MAX_SAMPLES
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


def spread(keys: Sequence[Hashable], limit: int = MAX_SAMPLES) -> list[int]:
    """Up to ``limit`` indices into ``keys``, spread over its runs of equal keys: the first of
    each run, then the second of each, and so on (see the module docstring)."""
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    picked: list[int] = []
    depth = 0
    while len(picked) < limit and any(depth < len(run) for run in runs):
        for run in runs:
            if depth < len(run):
                picked.append(run[depth])
                if len(picked) == limit:
                    break
        depth += 1
    return picked


def make_sample(
    batch: ScoredBatch, i: int, picture: tuple[bytes, str] | None = None
) -> episode_pb2.GrpoSample:
    """Completion ``i`` of ``batch`` as a sample (texts cut to the contract's limit), showing
    ``picture`` (a thumbnail and its MIME type) when given."""
    sample = episode_pb2.GrpoSample(
        prompt=truncate_utf8(batch.prompt(i), MAX_SAMPLE_TEXT_BYTES),
        completion=truncate_utf8(batch.completion(i), MAX_SAMPLE_TEXT_BYTES),
        reward=batch.reward(i),
        rewards=batch.function_rewards(i),
        solution=truncate_utf8(batch.solution(i), MAX_SAMPLE_TEXT_BYTES),
    )
    if picture is not None:
        sample.image, sample.image_type = picture
    return sample


def picture_of(batch: ScoredBatch, i: int) -> tuple[bytes, str] | None:
    """A thumbnail of completion ``i``'s row's first image and its MIME type; None when the row
    has none, or none that PIL can read."""
    image = as_image(batch.image(i))
    if image is None:
        return None
    try:
        return thumbnail(image)
    except (OSError, ValueError) as exc:  # the sample goes without its picture
        _LOGGER.warning("no thumbnail for a sample: %s: %s", type(exc).__name__, exc)
        return None


def is_step_log(logs: Mapping[str, Any] | None, step: int, last_step: int) -> bool:
    """Whether a log record is a new optimizer step's (not the end-of-training summary)."""
    return bool(logs) and not (_SUMMARY_KEYS & logs.keys()) and step > last_step  # type: ignore[union-attr]


class EpisodeMaker:
    """Turns one step's log record into the next episode (see the module docstring for rewards).

    Args:
        counter: Numbers episodes and tracks ``best_reward`` / ``done``.
        tap: Holds the latest scored batch.
        samples: Sample completions (``sample_completions``) per episode.
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
        #: Times the steps (the trainer's, on rank 0); None: no step metrics.
        self.meter: StepMeter | None = None
        # The detail of the batch it was made from, reused while steps carry that batch.
        self._detail: tuple[int, episode_pb2.GrpoDetail] | None = None

    def make(self, logs: Mapping[str, Any]) -> episode_pb2.Episode:
        """The next episode from one step's log record."""
        metrics = finite_metrics(logs)
        if self.hyperparameters is not None:
            metrics.update(self.hyperparameters())
        if self.meter is not None:
            metrics.update(self.meter.take())
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
        return self.counter.make(reward, metrics, grpo=self._batch_detail())

    def _batch_detail(self) -> episode_pb2.GrpoDetail:
        """The detail of the latest scored batch (empty before the first)."""
        batch = self.tap.latest() if self.tap is not None else None
        if batch is None:
            return episode_pb2.GrpoDetail()
        if self._detail is not None and self._detail[0] == batch.number:
            return self._detail[1]
        detail = episode_pb2.GrpoDetail()
        shown = min(self.samples, len(batch))
        detail.sample_completions.extend(truncate_utf8(batch.completion(i)) for i in range(shown))
        keys = [(batch.prompt(i), batch.solution(i)) for i in range(len(batch))]
        # A prompt's completions answered one row: its image is encoded once.
        pictures: dict[Hashable, tuple[bytes, str] | None] = {}
        for i in spread(keys):
            if keys[i] not in pictures:
                pictures[keys[i]] = picture_of(batch, i)
            detail.samples.append(make_sample(batch, i, pictures[keys[i]]))
        self._detail = (batch.number, detail)
        return detail


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

    @property
    def _meter(self) -> StepMeter | None:
        return self.maker.meter if self.maker is not None else None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        if (meter := self._meter) is not None:
            meter.step_began()
        return control

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        if (meter := self._meter) is not None:
            meter.step_ended()
        return control

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
        elif (meter := self._meter) is not None:
            meter.step_began()
        return control
