"""The episode streams the fake trainer sends, built without a server.

``valid_episodes`` is the default stream (a deterministic ``reward_of`` curve with imitation
detail), ``scripted_episodes`` the one a ``Script(motion=True)`` sends (``scripted_reward`` and,
for imitation runs, the task's own motion); ``broken`` gives what to send instead of an episode
to break one of the rules in ``tests.fakes.scripts.VIOLATIONS``. Tests also use these streams on
their own, as input.
"""

from __future__ import annotations

import functools
import io
import math
import time
from collections.abc import Iterator

from google.protobuf import timestamp_pb2

from trainwire import contract, motion
from trainwire.v1 import episode_pb2


def reward_of(n: int) -> float:
    """The deterministic reward of episode n."""
    return round(0.5 + 0.45 * math.sin(n / 7.0), 6)


def make_episode(
    n: int, best: float, last: bool, detail: bool, frames: int = 60, joints: int = 11
) -> episode_pb2.Episode:
    """A valid imitation episode n (best = running max so far, including n)."""
    ep = episode_pb2.Episode(
        episode=n,
        reward=reward_of(n),
        best_reward=best,
        done=last,
        metrics={"loss": 1.0 / n, "reward_std": 0.1},
    )
    ep.produce_time.FromNanoseconds(time.time_ns())
    if detail:
        ep.imitation.frame_count = frames
        ep.imitation.joint_count = joints
        ep.imitation.angles.extend(
            math.sin(0.1 * f + 0.3 * j + 0.01 * n) for f in range(frames) for j in range(joints)
        )
    return ep


def valid_episodes(
    count: int, detail_every: int = 10, frames: int = 60, joints: int = 11
) -> Iterator[episode_pb2.Episode]:
    """A valid imitation stream of ``count`` episodes (``produce_time`` set when built)."""
    best = -math.inf
    for n in range(1, count + 1):
        best = max(best, reward_of(n))
        last = n == count
        yield make_episode(n, best, last, last or n % detail_every == 0, frames, joints)


def scripted_reward(n: int) -> float:
    """The fake's reward curve: rising towards 1 with a deterministic wobble."""
    return round(1.0 - 0.9 * math.exp(-n / 15.0) + 0.03 * math.sin(n * 1.7), 6)


def scripted_episodes(
    task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig
) -> list[episode_pb2.Episode]:
    """A valid episode stream for the task: rewards from ``scripted_reward``; imitation runs carry
    the policy's motion every 10th episode and on the last (the target clip plus an error that
    shrinks as training goes), grpo runs a sample completion and ``scripted_samples``."""
    kind = contract.task_kind(task)
    clip = motion.clip_from_task(task.imitation) if kind == "imitation" else None
    total = config.max_episodes
    episodes: list[episode_pb2.Episode] = []
    best = -math.inf
    for n in range(1, total + 1):
        reward = scripted_reward(n)
        best = max(best, reward)
        episode = episode_pb2.Episode(
            episode=n,
            reward=reward,
            best_reward=best,
            done=n == total,
            metrics={"loss": 1.0 / n},
            produce_time=_now(),
        )
        if clip is not None and (n % 10 == 0 or n == total):
            error = 0.8 * (1.0 - n / total) + 0.15
            angles = [a + error * math.sin(i * 0.37 + n) for i, a in enumerate(clip.angles)]
            episode.imitation.CopyFrom(
                episode_pb2.ImitationDetail(
                    frame_count=clip.frame_count, joint_count=clip.joint_count, angles=angles
                )
            )
        elif kind == "grpo":
            episode.grpo.sample_completions.append(f"<answer>{n}</answer>")
            episode.grpo.samples.extend(scripted_samples(n))
        episodes.append(episode)
    return episodes


#: The colours of the fake's GRPO rows, and their pixels.
SAMPLE_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}


@functools.cache
def sample_thumbnail(colour: str) -> bytes:
    """A 24 x 16 JPEG of one colour: a row's image as a trainer sends its thumbnail."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (24, 16), SAMPLE_COLOURS[colour]).save(out, "JPEG", quality=80)
    return out.getvalue()


def scripted_samples(n: int) -> list[episode_pb2.GrpoSample]:
    """Episode n's samples: two rows (their colours turn with n), one answered right and one
    wrong, with markup in the wrong answer (model output, which a page must show as text)."""
    names = list(SAMPLE_COLOURS)
    samples = []
    for k, right in ((0, True), (1, False)):
        colour = names[(n + k) % len(names)]
        answer = f"<answer>{colour}</answer>" if right else f"<b>{names[(n + k + 1) % 3]}</b>"
        rewards = {"exact_match": 1.0 if right else 0.0, "format": 1.0 if right else 0.0}
        samples.append(
            episode_pb2.GrpoSample(
                prompt=f"What colour is the shape? (row {n}-{k})",
                image=sample_thumbnail(colour),
                image_type="image/jpeg",
                completion=answer,
                reward=sum(rewards.values()),
                rewards=rewards,
                solution=colour,
            )
        )
    return samples


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


def broken(ep: episode_pb2.Episode, rule: str) -> list[episode_pb2.Episode]:
    """The episode(s) to send instead of ``ep`` to break ``rule``."""
    if rule == "sequence":
        ep.episode += 1
    elif rule == "finite":
        ep.reward = math.nan
    elif rule == "metric_finite":
        ep.metrics["loss"] = math.inf
    elif rule == "best_reward":
        ep.best_reward = ep.best_reward + 1.0
    elif rule == "done":
        ep.done = True
        follower = episode_pb2.Episode()
        follower.CopyFrom(ep)
        follower.episode += 1
        follower.done = False
        return [ep, follower]
    elif rule == "detail_kind":
        ep.ClearField("imitation")
        ep.grpo.sample_completions.append("not an imitation run")
    elif rule == "detail_size":
        ep.imitation.frame_count = 2
        ep.imitation.joint_count = 11
        del ep.imitation.angles[:]
        ep.imitation.angles.extend([0.0] * 5)
    else:
        raise ValueError(f"unknown rule {rule}")
    return [ep]
