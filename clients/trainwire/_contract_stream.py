"""``StreamChecker``: applies the stream rules to one episode stream, episode by episode.

The rules themselves (``sequence``, ``max_episodes``, ``finite``, ``best_reward``, ``done``,
``detail_kind``, ``detail_size``, ``detail_format``) are listed in ``trainwire.contract``,
which re-exports ``StreamChecker``; import it from there.

Both services check every episode, so ``check`` runs a screen first: a few comparisons that
prove a well-formed episode passes every rule. An episode the screen cannot clear goes through
the full rule-by-rule check, which alone words the violations; so the screen may only ever be
stricter than the rules, never looser.

This module depends on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from trainwire._contract_base import (
    MAX_COMPLETION_BYTES,
    MAX_COMPLETIONS,
    MAX_EPISODES,
    MAX_FRAMES,
    MAX_JOINTS,
    MAX_SAMPLE_IMAGE_BYTES,
    MAX_SAMPLE_TEXT_BYTES,
    MAX_SAMPLES,
    SAMPLE_IMAGE_TYPES,
    TASK_KINDS,
    ContractViolation,
    task_kind,
)
from trainwire.v1 import episode_pb2

_DETAIL_FOR_KIND = {"imitation": "imitation", "grpo": "grpo"}
#: A str of this many characters is at most MAX_COMPLETION_BYTES of UTF-8 (4 bytes a character).
_SURELY_SHORT_COMPLETION = MAX_COMPLETION_BYTES // 4
#: Likewise for a sample's texts.
_SURELY_SHORT_TEXT = MAX_SAMPLE_TEXT_BYTES // 4
_SAMPLE_TEXTS = ("prompt", "completion", "solution")


def image_type_of(data: bytes) -> str:
    """The MIME type (one of ``SAMPLE_IMAGE_TYPES``) that ``data`` starts like; ``""`` for none."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return ""


def _samples_surely_valid(samples: Sequence[episode_pb2.GrpoSample]) -> bool:
    """True when the samples certainly keep every rule; False when they may not (the exact
    check decides)."""
    if len(samples) > MAX_SAMPLES:
        return False
    total = 0.0
    for sample in samples:
        image = sample.image
        image_type = sample.image_type
        # An image of no known kind has type "" and must be refused, like a type without one.
        if (
            len(image) > MAX_SAMPLE_IMAGE_BYTES
            or image_type != image_type_of(image)
            or bool(image) != bool(image_type)
        ):
            return False
        if (
            len(sample.prompt) > _SURELY_SHORT_TEXT
            or len(sample.completion) > _SURELY_SHORT_TEXT
            or len(sample.solution) > _SURELY_SHORT_TEXT
        ):
            return False
        total += sample.reward
        rewards = sample.rewards
        for name in rewards:
            total += rewards[name]
    return math.isfinite(total)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache  # one entry per shape: at most MAX_FRAMES x MAX_JOINTS
def _motion_header(frames: int, joints: int) -> bytes:
    """The bytes a serialized ImitationDetail of this shape starts with, up to its angles.

    Fields 1 (frame_count) and 2 (joint_count) as varints, then field 3 (angles) as one packed
    run of frames * joints little-endian float32s.
    """
    return b"".join(
        (b"\x08", _varint(frames), b"\x10", _varint(joints), b"\x1a", _varint(4 * frames * joints))
    )


def _motion_surely_valid(motion: episode_pb2.ImitationDetail) -> bool:
    """True when the motion certainly keeps detail_size and finite; False when it may not.

    Reads the angles as the bytes protobuf serializes them in, rather than one Python float at a
    time. A serialization that is exactly the shape's header and then frames x joints float32s
    holds that many angles, no more, no less. A float32 that is not finite has every exponent
    bit set, so its high byte (sign and 7 exponent bits) is 0x7F or 0xFF; a finite one has that
    byte only at a magnitude of 2**127 or more.
    """
    frames, joints = motion.frame_count, motion.joint_count
    if not (1 <= frames <= MAX_FRAMES and 1 <= joints <= MAX_JOINTS):
        return False
    data = motion.SerializeToString()
    header = _motion_header(frames, joints)
    start = len(header)
    if len(data) != start + 4 * frames * joints or not data.startswith(header):
        return False  # a count off, unknown fields or another layout: the exact check decides
    high = data[start + 3 :: 4]
    # An int operand makes ``in`` one memchr (a bytes one costs a TypeError inside CPython).
    return 0x7F not in high and 0xFF not in high


def _doubles_surely_finite(data: bytes) -> bool:
    """True when no double in a serialized message can be NaN or infinite.

    A double that is not finite has every exponent bit set: its last two (little-endian) bytes
    are 0xF0 or more, then 0x7F or 0xFF. Without such a pair of bytes anywhere in the message,
    none of its doubles is one; with one, a double may be (or another field's bytes just look
    alike), and the caller reads the values.
    """
    for high in (0x7F, 0xFF):
        at = data.find(high, 1)
        while at != -1:
            if data[at - 1] >= 0xF0:
                return False
            at = data.find(high, at + 1)
    return True


def _numbers_finite(episode: episode_pb2.Episode, total: float) -> bool:
    """Whether ``total`` (reward + best_reward) and every metric are finite.

    A sum of floats is finite only when every term is, unless it overflows: a False may be a
    false alarm that the exact check clears.
    """
    metrics = episode.metrics
    for name in metrics:
        total += metrics[name]
    return math.isfinite(total)


class StreamChecker:
    """Checks one episode stream, episode by episode, against the stream rules.

    One checker per stream; call ``check`` on each episode in order and ``finish`` when the
    stream ends normally. A violation raises ``ContractViolation``; after one, the checker's
    state is undefined (the stream must be aborted).
    """

    __slots__ = ("best_reward", "done", "kind", "last_episode", "max_episodes", "run_id")

    def __init__(self, kind: str, max_episodes: int, run_id: str = "") -> None:
        if kind not in TASK_KINDS:
            raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")
        if not 1 <= max_episodes <= MAX_EPISODES:
            raise ValueError(f"max_episodes must be in 1..{MAX_EPISODES}, got {max_episodes}")
        self.kind = kind
        self.max_episodes = max_episodes
        self.run_id = run_id
        self.last_episode = 0
        self.done = False
        self.best_reward: float | None = None

    @classmethod
    def for_task(
        cls, task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig, run_id: str = ""
    ) -> StreamChecker:
        """Builds the checker for a (valid) task and config."""
        return cls(task_kind(task), config.max_episodes, run_id)

    def resume(self, last_episode: int, best_reward: float | None) -> None:
        """Continues a stream whose episodes 1..last_episode were checked elsewhere (a
        re-attached training stream): the next episode must be ``last_episode + 1`` and the
        running maximum starts at ``best_reward``.

        Raises:
            ValueError: last_episode outside 0..max_episodes, or 0 with a best reward.
        """
        if not 0 <= last_episode <= self.max_episodes:
            raise ValueError(f"last_episode must be in 0..{self.max_episodes}, got {last_episode}")
        if last_episode == 0 and best_reward is not None:
            raise ValueError("no best reward before the first episode")
        self.last_episode = last_episode
        self.best_reward = best_reward if last_episode else None
        self.done = False

    def _violation(
        self, rule: str, message: str, episode: int | None, field: str | None = None
    ) -> ContractViolation:
        return ContractViolation(rule, message, episode=episode, field=field, run_id=self.run_id)

    def check(self, episode: episode_pb2.Episode) -> None:
        """Checks the next episode of the stream and advances the checker.

        Raises:
            ContractViolation: the episode breaks a rule.
        """
        n = episode.episode
        if n != self.last_episode + 1 or n >= self.max_episodes or self.done or episode.done:
            # The stream's edges (done, max_episodes) and every misnumbering.
            self._check_exactly(episode)
            return
        reward = episode.reward
        best = episode.best_reward
        previous = self.best_reward
        # max(previous, reward), as _check_exactly computes it, without the call.
        running = reward if previous is None or reward > previous else previous
        detail = episode.WhichOneof("detail")
        if detail is None:
            # One serialization reads every double at C speed. Most episodes have neither
            # high byte of a NaN or an infinity anywhere; a suspect pair of bytes (rare) leaves
            # the metrics to read one by one.
            data = episode.SerializeToString()
            finite = (
                (0x7F not in data and 0xFF not in data)
                or _doubles_surely_finite(data)
                or _numbers_finite(episode, reward + best)
            )
        else:
            finite = _numbers_finite(episode, reward + best) and self._detail_surely_valid(
                episode, detail
            )
        if not finite or best != running:
            self._check_exactly(episode)
            return
        self.last_episode = n
        self.best_reward = running

    def _detail_surely_valid(self, episode: episode_pb2.Episode, detail: str) -> bool:
        if detail != _DETAIL_FOR_KIND[self.kind]:
            return False
        if detail == "imitation":
            return _motion_surely_valid(episode.imitation)
        grpo = episode.grpo
        completions = grpo.sample_completions
        samples = grpo.samples
        return (
            len(completions) <= MAX_COMPLETIONS
            and (not completions or max(map(len, completions)) <= _SURELY_SHORT_COMPLETION)
            and (not samples or _samples_surely_valid(samples))
        )

    def _check_exactly(self, episode: episode_pb2.Episode) -> None:
        """Applies every rule in turn and words the first one broken; advances the checker."""
        n = episode.episode
        if self.done:
            raise self._violation(
                "done", f"episode after the done episode {self.last_episode}", n, "done"
            )
        expected = self.last_episode + 1
        if n != expected:
            if n == self.last_episode:
                what = "repeats the previous episode"
            elif n < self.last_episode:
                what = f"goes backwards from {self.last_episode}"
            elif self.last_episode == 0:
                what = "does not start the stream at 1"
            else:
                what = f"skips {n - expected} episode(s) after {self.last_episode}"
            raise self._violation("sequence", f"expected episode {expected}; {what}", n, "episode")
        if n > self.max_episodes:
            raise self._violation(
                "max_episodes", f"above max_episodes {self.max_episodes}", n, "episode"
            )
        reward = episode.reward
        best = episode.best_reward
        if not math.isfinite(reward):
            raise self._violation("finite", f"reward is {reward}", n, "reward")
        if not math.isfinite(best):
            raise self._violation("finite", f"best_reward is {best}", n, "best_reward")
        metrics = episode.metrics
        if metrics and not math.isfinite(sum(metrics.values())):
            for name, value in metrics.items():
                if not math.isfinite(value):
                    raise self._violation("finite", f"metric is {value}", n, f"metrics[{name}]")
        running = reward if self.best_reward is None else max(self.best_reward, reward)
        if best != running:
            raise self._violation(
                "best_reward",
                f"best_reward {best!r} is not the running maximum of reward {running!r}",
                n,
                "best_reward",
            )
        detail = episode.WhichOneof("detail")
        if detail is not None:
            self._check_detail(episode, detail, n)
        if not episode.done and n == self.max_episodes:
            raise self._violation(
                "done", f"episode {n} is the last (max_episodes) but done is not set", n, "done"
            )
        self.last_episode = n
        self.best_reward = running
        self.done = episode.done

    def _check_detail(self, episode: episode_pb2.Episode, detail: str, n: int) -> None:
        if detail != _DETAIL_FOR_KIND[self.kind]:
            raise self._violation(
                "detail_kind", f"{detail} detail on a {self.kind} run", n, f"detail.{detail}"
            )
        if detail == "imitation":
            motion = episode.imitation
            frames, joints = motion.frame_count, motion.joint_count
            field = "detail.imitation"
            if not 1 <= frames <= MAX_FRAMES:
                raise self._violation(
                    "detail_size", f"frame_count {frames} not in 1..{MAX_FRAMES}", n, field
                )
            if not 1 <= joints <= MAX_JOINTS:
                raise self._violation(
                    "detail_size", f"joint_count {joints} not in 1..{MAX_JOINTS}", n, field
                )
            if len(motion.angles) != frames * joints:
                raise self._violation(
                    "detail_size",
                    f"{len(motion.angles)} angles for {frames} frames x {joints} joints",
                    n,
                    f"{field}.angles",
                )
            # float32 values cannot overflow a float64 sum, so a non-finite sum means a bad angle.
            if not math.isfinite(sum(motion.angles)):
                raise self._violation("finite", "an angle is not finite", n, f"{field}.angles")
        else:
            completions = episode.grpo.sample_completions
            if len(completions) > MAX_COMPLETIONS:
                raise self._violation(
                    "detail_size",
                    f"{len(completions)} completions; at most {MAX_COMPLETIONS}",
                    n,
                    "detail.grpo.sample_completions",
                )
            for i, text in enumerate(completions):
                size = len(text.encode("utf-8"))
                if size > MAX_COMPLETION_BYTES:
                    raise self._violation(
                        "detail_size",
                        f"completion of {size} bytes; at most {MAX_COMPLETION_BYTES}",
                        n,
                        f"detail.grpo.sample_completions[{i}]",
                    )
            self._check_samples(episode.grpo.samples, n)

    def _check_samples(self, samples: Sequence[episode_pb2.GrpoSample], n: int) -> None:
        if len(samples) > MAX_SAMPLES:
            raise self._violation(
                "detail_size",
                f"{len(samples)} samples; at most {MAX_SAMPLES}",
                n,
                "detail.grpo.samples",
            )
        for i, sample in enumerate(samples):
            field = f"detail.grpo.samples[{i}]"
            for name in _SAMPLE_TEXTS:
                size = len(getattr(sample, name).encode("utf-8"))
                if size > MAX_SAMPLE_TEXT_BYTES:
                    raise self._violation(
                        "detail_size",
                        f"{name} of {size} bytes; at most {MAX_SAMPLE_TEXT_BYTES}",
                        n,
                        f"{field}.{name}",
                    )
            image, image_type = sample.image, sample.image_type
            if len(image) > MAX_SAMPLE_IMAGE_BYTES:
                raise self._violation(
                    "detail_size",
                    f"image of {len(image)} bytes; at most {MAX_SAMPLE_IMAGE_BYTES}",
                    n,
                    f"{field}.image",
                )
            if not image:
                if image_type:
                    raise self._violation(
                        "detail_format",
                        f"image_type {image_type!r} without an image",
                        n,
                        f"{field}.image_type",
                    )
            elif image_type not in SAMPLE_IMAGE_TYPES:
                raise self._violation(
                    "detail_format",
                    f"image_type {image_type!r}; one of {', '.join(SAMPLE_IMAGE_TYPES)}",
                    n,
                    f"{field}.image_type",
                )
            elif image_type_of(image) != image_type:
                actual = image_type_of(image) or "not a PNG, JPEG or WebP image"
                raise self._violation(
                    "detail_format",
                    f"image_type {image_type!r}, but the image's bytes are {actual}",
                    n,
                    f"{field}.image",
                )
            if not math.isfinite(sample.reward):
                raise self._violation("finite", f"reward is {sample.reward}", n, f"{field}.reward")
            for name, value in sample.rewards.items():
                if not math.isfinite(value):
                    raise self._violation(
                        "finite", f"reward is {value}", n, f"{field}.rewards[{name}]"
                    )

    def finish(self) -> None:
        """Checks that the stream, now ended normally, delivered its done episode.

        Raises:
            ContractViolation: the stream ended without an episode marked done.
        """
        if not self.done:
            raise self._violation(
                "done", f"the stream ended after episode {self.last_episode} without done", None
            )
