"""``StreamChecker``: applies the stream rules to one episode stream, episode by episode.

The rules themselves (``sequence``, ``max_episodes``, ``finite``, ``best_reward``, ``done``,
``detail_kind``, ``detail_size``) are listed in ``trainwire.contract``, which re-exports
``StreamChecker``; import it from there.

This module depends on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

import math

from trainwire._contract_base import (
    MAX_COMPLETION_BYTES,
    MAX_COMPLETIONS,
    MAX_EPISODES,
    MAX_FRAMES,
    MAX_JOINTS,
    TASK_KINDS,
    ContractViolation,
    task_kind,
)
from trainwire.v1 import episode_pb2

_DETAIL_FOR_KIND = {"imitation": "imitation", "grpo": "grpo"}


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

    def finish(self) -> None:
        """Checks that the stream, now ended normally, delivered its done episode.

        Raises:
            ContractViolation: the stream ended without an episode marked done.
        """
        if not self.done:
            raise self._violation(
                "done", f"the stream ended after episode {self.last_episode} without done", None
            )
