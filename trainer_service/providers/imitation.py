"""The imitation provider: an avatar rig learns to imitate a motion clip by policy gradient.

The policy is a Gaussian over every joint angle of every frame of the clip: a learned mean motion
(``frames x joints``, initialised at the rig's rest pose) and a learned log standard deviation per
frame and joint. Each episode samples ``group_size`` whole motions, scores them with the fixed
reward ``exp(-d / (0.1 H))`` (``d``: mean keypoint distance to the clip over frames and joints,
``H``: height of the rig's bounding box in the clip's first frame), and takes one Adam step on a
REINFORCE loss with group-relative advantages, as GRPO does.

Credit assignment is what makes it learn fast. A whole-motion reward tells the policy little
about which of its ``frames x joints`` choices were good (a plain whole-motion REINFORCE reaches
about 0.4 in 500 episodes). Frames are independent decisions, and a joint angle moves only the
keypoints of its own subtree of bones, so the advantage of angle ``(f, j)`` is computed from the
reward of the keypoints it can move (frame ``f``, bones in the subtree of ``j``), normalised
across the group per ``(f, j)``: ``(r - mean) / (std + eps)``. This is the per-decision
("reward-to-go") form of the policy gradient: leaving out rewards an action cannot influence
removes variance, not signal.

A step is one batched tensor program over the whole group, with no Python loop over motions,
frames or joints. Forward kinematics is vectorised over ``[group, frames, bones]``: absolute bone
angles are the relative angles summed along each bone's ancestor chain (a matrix product with a
precomputed ancestor matrix), and bone end points are the bone vectors summed the same way. The
gradient of the loss is written out (:func:`policy_gradient`) instead of taken by autograd, and
Adam updates the mean and the log standard deviation as one buffer (``PackedAdam``): at the
default size the step is dominated by the number of tensor operations, not by arithmetic.

Checkpoints (``TrainJob.checkpoints``): every ``DEFAULT_CHECKPOINT_EVERY`` episodes unless the
config says otherwise, at the last episode, and as the job stops when a final one is wanted. A
checkpoint holds ``model.safetensors`` (the policy: ``mean`` and ``log_std``, loadable without
trainwire), ``training_state.pt`` (Adam's state and the sampling generator's RNG state) and
``checkpoint.json`` (the rig, the clip, their shape, the task and config, the episode counter,
the best reward and the learning rate in effect). A job resumed from one continues exactly: its
episodes after the checkpoint are those of the uninterrupted run with the same seed, bit for
bit on the same device (with the learning rate of its task, which is the run's current one). A
checkpoint of another shape (frames x joints) does not load (``CheckpointUnusable``). A job
with another seed than its checkpoint's (a fork's) draws its own noise from there on.

Live hyperparameters (``TrainJob.hyperparameters``): a new learning rate is taken before the
next optimizer step; every episode carries the rate its step used as ``learning_rate``.

Only this package imports torch.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from google.protobuf import json_format

from trainer_service.core.provider import (
    CheckpointUnusable,
    EpisodeCounter,
    ProviderError,
    TrainJob,
)
from trainer_service.providers.defaults import IMITATION, imitation_proto
from trainer_service.providers.imitation_adam import PackedAdam
from trainwire import motion
from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2

_LOGGER = logging.getLogger(__name__)

#: Motions sampled per episode when the task leaves ``group_size`` at 0.
DEFAULT_GROUP_SIZE = IMITATION.group_size
#: Adam learning rate when the task leaves ``learning_rate`` at 0.
DEFAULT_LEARNING_RATE = IMITATION.learning_rate
#: Initial standard deviation of every joint angle, in radians.
INITIAL_STD = 0.3
#: Bounds of the learned log standard deviation: keeps sampling finite and non-degenerate.
LOG_STD_MIN, LOG_STD_MAX = -7.0, 1.0
#: ``detail.imitation`` goes out every this many episodes (and on the last).
DETAIL_EVERY = 10
#: Reward scale: the reward is ``exp(-d / (REWARD_SCALE * H))``.
REWARD_SCALE = 0.1
#: A rig whose first clip frame is flatter than this (relative to its total bone length) has no
#: usable height for the reward.
_MIN_RELATIVE_HEIGHT = 1e-6
_ADVANTAGE_EPS = 1e-6
#: Checkpoint every this many episodes when the config leaves ``checkpoint_every`` at 0.
DEFAULT_CHECKPOINT_EVERY = IMITATION.checkpoint_every
#: The files of a checkpoint.
MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
INFO_FILE = "checkpoint.json"
#: ``checkpoint.json``'s ``format``; a checkpoint of another format does not load.
CHECKPOINT_FORMAT = "trainwire-imitation/1"


def validate(
    task: episode_pb2.TrainTask,
    data_roots: Sequence[pathlib.Path],
    reward_modules: Sequence[str] = (),
) -> list[FieldViolation]:
    """Checks what the contract cannot: the rig must have a height in the clip's first frame.

    The reward divides by that height, so a pose lying flat on the x axis cannot be scored.
    Called after the contract's structural checks passed.
    """
    del data_roots, reward_modules
    imitation = task.imitation
    rig = motion.rig_from_task(imitation)
    clip = motion.clip_from_task(imitation)
    height = motion.rig_height(rig, clip.frame(0))
    total_length = sum(bone.length for bone in rig.bones)
    if not height > _MIN_RELATIVE_HEIGHT * total_length:
        custom_clip = imitation.WhichOneof("clip_source") == "clip"
        field = "task.imitation.clip.angles" if custom_clip else "task.imitation.rig"
        return [
            FieldViolation(
                field,
                f"the rig lies flat in the clip's first frame (height {height:.3g}); the reward "
                "is scaled by that height, so the first frame must have a vertical extent",
            )
        ]
    return []


@dataclass(frozen=True)
class StepResult:
    """What one episode (one optimizer step) measured.

    Attributes:
        reward: The group's mean reward (in 0..1).
        reward_std: Standard deviation of the group's rewards.
        greedy_reward: Reward of the mean motion (the policy without exploration noise).
        pose_error: Mean keypoint distance of the mean motion, in rig length units.
        policy_std: Mean standard deviation of the policy, in radians.
        loss: The policy-gradient loss of the step.
        learning_rate: The Adam learning rate the step used.
    """

    reward: float
    reward_std: float
    greedy_reward: float
    pose_error: float
    policy_std: float
    loss: float
    learning_rate: float

    def metrics(self) -> dict[str, float]:
        """The episode metrics."""
        return {
            "reward_std": self.reward_std,
            "greedy_reward": self.greedy_reward,
            "pose_error": self.pose_error,
            "policy_std": self.policy_std,
            "loss": self.loss,
            "learning_rate": self.learning_rate,
        }


class Skeleton:
    """Vectorised forward kinematics of one rig on one device.

    Args:
        rig: The rig.
        device: Torch device of the tensors.
    """

    def __init__(self, rig: motion.RigSpec, device: torch.device) -> None:
        count = len(rig.bones)
        # ancestors[b, a] = 1 when a is b or an ancestor of b (parents precede children).
        ancestors = torch.zeros(count, count, dtype=torch.float32)
        for b, bone in enumerate(rig.bones):
            ancestors[b, b] = 1.0
            if bone.parent >= 0:
                ancestors[b] += ancestors[bone.parent]
        self.ancestors_t = ancestors.t().contiguous().to(device)
        # subtree[j, k] / size[j]: averages over the bones k in j's subtree (those j moves).
        subtree = ancestors.t()
        self.subtree_mean_t = (subtree / subtree.sum(1, keepdim=True)).t().contiguous().to(device)
        self.lengths = torch.tensor([b.length for b in rig.bones], dtype=torch.float32).to(device)

    def keypoints(self, angles: torch.Tensor) -> torch.Tensor:
        """Bone end points ``[..., bones, 2]`` of relative joint angles ``[..., bones]``."""
        absolute = angles @ self.ancestors_t
        x = (torch.cos(absolute) * self.lengths) @ self.ancestors_t
        y = (torch.sin(absolute) * self.lengths) @ self.ancestors_t
        return torch.stack((x, y), dim=-1)

    def keypoint_distances(self, angles: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Distances ``[..., bones]`` from the bone end points of relative joint angles
        ``[..., bones]`` to ``target``, given as x and y planes ``[2, ..., bones]`` (broadcast).

        Same kinematics as :meth:`keypoints`, with x and y kept in separate planes: the points
        never get interleaved only to be split again for the distance.
        """
        absolute = angles @ self.ancestors_t
        planes = absolute.new_empty((2, *absolute.shape))
        torch.cos(absolute, out=planes[0])
        torch.sin(absolute, out=planes[1])
        offsets = (planes.mul_(self.lengths) @ self.ancestors_t).sub_(target)
        return offsets.mul_(offsets).sum(0).sqrt_()

    def subtree_mean(self, per_bone: torch.Tensor) -> torch.Tensor:
        """Averages ``[..., bones]`` values over each bone's subtree."""
        return per_bone @ self.subtree_mean_t


def policy_gradient(
    advantages: torch.Tensor, noise: torch.Tensor, std: torch.Tensor, free: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the policy-gradient loss with respect to the policy, and the loss.

    The loss is ``-mean(A * log N(a; mean, std))`` over the group, frames and joints, where
    ``log N(a; mean, std) = -z^2 / 2 - log_std`` (its constant left out), ``a = mean + std * z``
    is a sampled angle and ``std = exp(log_std)``. With ``a`` fixed, ``d/dmean = A z / std``
    and ``d/dlog_std = A (z^2 - 1)``. The advantages are centred over the group for each angle,
    so the ``-A`` term sums to zero and so does the loss's ``A log_std`` term: what is left is
    two sums over the group, where an autograd graph of the same loss costs more than the whole
    rollout at this size.

    Args:
        advantages: ``A``, ``[group, frames, joints]``, centred over the group.
        noise: ``z``, the standard normal draws of the samples, ``[group, frames, joints]``.
        std: The standard deviation of the samples, ``[frames, joints]``.
        free: Where ``log_std`` is not held at a bound by its clamp (elsewhere it gets no
            gradient), ``[frames, joints]``.

    Returns:
        The gradient ``[2, frames, joints]`` (with respect to the mean, then to the log
        standard deviation) and the loss (a scalar tensor).
    """
    count = advantages.numel()
    weighted = advantages * noise
    gradient = std.new_empty((2, *std.shape))
    torch.sum(weighted, 0, out=gradient[0])
    torch.sum(weighted.mul_(noise), 0, out=gradient[1])
    loss = gradient[1].sum() * (0.5 / count)
    gradient[0].div_(std)
    gradient[1].mul_(free)
    gradient.mul_(-1.0 / count)
    return gradient, loss


class ImitationLearner:
    """The policy, its optimizer and one training step.

    Args:
        rig: The rig to animate.
        clip: The target motion (``joint_count`` equals the rig's bone count).
        group_size: Motions sampled per step (at least 2).
        learning_rate: Adam learning rate.
        seed: Seeds the sampling generator.
        device: Torch device (``cpu``, ``cuda:0``).
    """

    def __init__(
        self,
        rig: motion.RigSpec,
        clip: motion.ClipSpec,
        group_size: int = DEFAULT_GROUP_SIZE,
        learning_rate: float = DEFAULT_LEARNING_RATE,
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {group_size}")
        self.device = torch.device(device)
        self.frames, self.joints = clip.frame_count, clip.joint_count
        self.group_size = group_size
        self.skeleton = Skeleton(rig, self.device)
        target_angles = torch.tensor(clip.angles, dtype=torch.float32).reshape(
            self.frames, self.joints
        )
        # x and y planes [2, 1, frames, joints]: broadcast over the group in the distances.
        self.target = (
            self.skeleton.keypoints(target_angles.to(self.device))
            .movedim(-1, 0)
            .unsqueeze(1)
            .contiguous()
        )
        height = motion.rig_height(rig, clip.frame(0))
        self.distance_scale = REWARD_SCALE * height
        # The local reward of every angle is exp(distances @ credit): exp(-subtree mean / scale).
        self.credit = self.skeleton.subtree_mean_t / -self.distance_scale
        rest = torch.tensor(motion.rest_pose(rig), dtype=torch.float32).repeat(self.frames, 1)
        initial_log_std = torch.full((self.frames, self.joints), math.log(INITIAL_STD))
        # mean and log_std are the two planes of one buffer, which Adam updates in one pass.
        self.policy = torch.stack((rest, initial_log_std)).to(self.device)
        self.mean, self.log_std = self.policy.unbind(0)
        self.optimizer = PackedAdam(self.policy, lr=learning_rate)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def step(self) -> StepResult:
        """Samples a group of motions, scores them and takes one optimizer step."""
        group, frames, joints = self.group_size, self.frames, self.joints
        log_std = self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)
        std = log_std.exp()
        noise = torch.randn((group, frames, joints), generator=self.generator, device=self.device)
        # The mean motion rides along as row 0 so one kinematics pass scores everything.
        motions = self.policy.new_empty((group + 1, frames, joints))
        motions[0] = self.mean
        torch.addcmul(self.mean, std, noise, out=motions[1:])
        distances = self.skeleton.keypoint_distances(motions, self.target)
        pose_errors = distances.mean(dim=(1, 2))
        rewards = torch.exp(pose_errors / -self.distance_scale)
        # Per-decision credit: angle (f, j) is judged by the keypoints it moves.
        local = torch.exp(distances[1:] @ self.credit)
        centered = local - local.mean(0)
        spread = (centered * centered).sum(0).div_(group - 1).sqrt_().add_(_ADVANTAGE_EPS)
        advantages = centered.div_(spread)
        learning_rate = self.learning_rate
        free = self.log_std == log_std
        gradient, loss = policy_gradient(advantages, noise, std, free)
        self.optimizer.step(gradient)
        reward_std, reward = torch.std_mean(rewards[1:])
        stats = torch.stack(
            (reward, reward_std, rewards[0], pose_errors[0], std.mean(), loss)
        ).tolist()  # one device sync for every number of the step
        reward, reward_std, greedy_reward, pose_error, policy_std, step_loss = stats
        return StepResult(
            reward,
            reward_std,
            greedy_reward,
            pose_error,
            policy_std,
            step_loss,
            learning_rate,
        )

    @property
    def learning_rate(self) -> float:
        """Adam's learning rate (the next step's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, learning_rate: float) -> None:
        """Sets Adam's learning rate from the next step on (its moment estimates stay)."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def mean_motion(self) -> list[float]:
        """The policy's mean motion, frame-major, ``frames x joints`` angles."""
        return self.mean.flatten().tolist()

    def save(self, directory: pathlib.Path, info: dict[str, Any]) -> None:
        """Writes the whole training state into ``directory`` (see the module docstring);
        ``info`` goes into ``checkpoint.json`` beside the shape."""
        safetensors.torch.save_file(
            {
                # Clones: safetensors refuses tensors that share a buffer.
                "mean": self.mean.clone(),
                "log_std": self.log_std.clone(),
            },
            str(directory / MODEL_FILE),
            metadata={"format": CHECKPOINT_FORMAT},
        )
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
            },
            directory / STATE_FILE,
        )
        record = {
            **info,
            "format": CHECKPOINT_FORMAT,
            "frames": self.frames,
            "joints": self.joints,
            "group_size": self.group_size,
        }
        (directory / INFO_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))

    def restore(self, directory: pathlib.Path) -> dict[str, Any]:
        """Loads the training state :meth:`save` wrote; returns its ``checkpoint.json``.

        Raises:
            CheckpointUnusable: A file is missing or unreadable, or the checkpoint is of
                another format or shape.
        """
        try:
            record = json.loads((directory / INFO_FILE).read_text())
            if record.get("format") != CHECKPOINT_FORMAT:
                raise CheckpointUnusable(
                    f"format {record.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
                )
            shape = (self.frames, self.joints)
            tensors = safetensors.torch.load_file(str(directory / MODEL_FILE), device="cpu")
            for name in ("mean", "log_std"):
                if name not in tensors:
                    raise CheckpointUnusable(f"{MODEL_FILE} holds no {name!r}")
                if tuple(tensors[name].shape) != shape:
                    raise CheckpointUnusable(
                        f"{name} is {tuple(tensors[name].shape)} (frames x joints), this "
                        f"task needs {shape}"
                    )
            state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
            self.mean.copy_(tensors["mean"])
            self.log_std.copy_(tensors["log_std"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.generator.set_state(state["generator"])
        except CheckpointUnusable:
            raise
        except Exception as exc:  # missing files, bad bytes, a foreign state dict
            raise CheckpointUnusable(f"{type(exc).__name__}: {exc}") from exc
        return dict(record)


def _group_size(task: episode_pb2.ImitationTask) -> int:
    return task.group_size or DEFAULT_GROUP_SIZE


def _learning_rate(task: episode_pb2.ImitationTask) -> float:
    return task.learning_rate or DEFAULT_LEARNING_RATE


def hyperparameters(task: episode_pb2.TrainTask) -> Hyperparameters:
    """The live hyperparameters a job of ``task`` starts with: its learning rate."""
    return Hyperparameters(learning_rate=_learning_rate(task.imitation))


def defaults() -> trainer_service_pb2.ProviderDefaults:
    """What a job trains with where its task or config leaves a field at 0 (``GetCapabilities``
    advertises it; see :mod:`trainer_service.providers.defaults`)."""
    return imitation_proto()


def learner_for(task: episode_pb2.ImitationTask, seed: int, device: str) -> ImitationLearner:
    """Builds the learner of a (validated) imitation task."""
    return ImitationLearner(
        motion.rig_from_task(task),
        motion.clip_from_task(task),
        group_size=_group_size(task),
        learning_rate=_learning_rate(task),
        seed=seed,
        device=device,
    )


def _job_info(job: TrainJob, learner: ImitationLearner) -> dict[str, Any]:
    """What ``checkpoint.json`` says of the job (besides the episode and best reward)."""
    task = job.task.imitation
    return {
        "provider": "imitation",
        "rig": task.rig_name or task.rig.name or "stickman",
        "clip": task.clip_name or task.clip.name,
        "learning_rate": _learning_rate(task),
        "seed": job.config.seed,
        "device": str(learner.device),
        "task": json.loads(json_format.MessageToJson(job.task)),
        "config": json.loads(json_format.MessageToJson(job.config)),
    }


def run(job: TrainJob) -> Generator[episode_pb2.Episode, None, None]:
    """Trains the job's imitation task, yielding one episode per optimizer step."""
    job.set_phase("loading")
    task = job.task.imitation
    try:
        learner = learner_for(task, job.config.seed, job.device)
    except (KeyError, ValueError) as exc:  # validation should have caught these
        raise ProviderError(
            "The imitation task could not be set up.", detail=repr(exc), reason="BAD_TASK"
        ) from exc
    counter = EpisodeCounter(job.config.max_episodes, job.resume)
    info = _job_info(job, learner)
    checkpointed = 0  # the episode of the last checkpoint (or of the one restored)
    if job.resume is not None:
        restored = learner.restore(job.resume.directory)
        # Adam's state brought the checkpoint's learning rate; the task's is the run's now
        # (changed while it was parked, or a fork's).
        learner.set_learning_rate(_learning_rate(task))
        checkpointed = job.resume.episode
        if restored.get("seed", job.config.seed) != job.config.seed:
            # A fork with a seed of its own draws its own noise from the fork on.
            learner.generator.manual_seed(job.config.seed)
        if (restored.get("rig"), restored.get("clip")) != (info["rig"], info["clip"]):
            _LOGGER.info(
                "run %s: continuing a checkpoint of %r on %r with %r on %r (same shape)",
                job.run_id,
                restored.get("clip"),
                restored.get("rig"),
                info["clip"],
                info["rig"],
            )
    _LOGGER.info(
        "run %s: imitating %r on %r (%d frames x %d joints), group %d, lr %g, device %s%s",
        job.run_id,
        info["clip"],
        info["rig"],
        learner.frames,
        learner.joints,
        learner.group_size,
        _learning_rate(task),
        job.device,
        f", from the checkpoint at episode {checkpointed}" if checkpointed else "",
    )

    def checkpoint() -> None:
        nonlocal checkpointed
        episode = counter.episode
        best = counter.best_reward if counter.best_reward is not None else 0.0
        checkpointed = episode
        directory = None
        try:
            directory = job.checkpoints.scratch(episode)
            learner.save(
                directory,
                {
                    **info,
                    "episode": episode,
                    "best_reward": best,
                    "learning_rate": learner.learning_rate,
                },
            )
        except Exception as exc:  # disk full (torch and safetensors raise their own): reported
            job.checkpoints.fail(episode, f"cannot write it locally: {exc}", directory)
            return
        job.checkpoints.commit(episode, best, directory)

    job.set_phase("training")
    try:
        while not counter.finished:
            if job.stop_event.is_set():
                return
            change = job.hyperparameters.take()
            if change is not None and change.learning_rate is not None:
                learner.set_learning_rate(change.learning_rate)
            result = learner.step()
            n = counter.next_episode
            detail = None
            if n % DETAIL_EVERY == 0 or n == counter.max_episodes:
                detail = episode_pb2.ImitationDetail(
                    frame_count=learner.frames,
                    joint_count=learner.joints,
                    angles=learner.mean_motion(),
                )
            episode = counter.make(result.reward, result.metrics(), imitation=detail)
            # Before the yield: the job may block at its grant right after it.
            if job.checkpoints.due(episode.episode):
                checkpoint()
            yield episode
    finally:
        # Stop and park: the state after the last episode made, unless just written.
        if job.checkpoints.final_wanted() and counter.episode > checkpointed:
            checkpoint()
