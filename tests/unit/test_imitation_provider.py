"""The imitation provider: kinematics, reward, validation, stream shape, learning, determinism,
and the step's parts (the written-out policy gradient, the packed Adam)."""

from __future__ import annotations

import io
import math
import pathlib
import threading

import pytest
import torch

from trainer_service.core.provider import TrainJob
from trainer_service.providers import imitation
from trainer_service.providers.imitation_adam import PackedAdam
from trainwire import contract, motion
from trainwire.v1 import episode_pb2

DATA_ROOT = pathlib.Path("var/data")


def make_job(
    task: episode_pb2.ImitationTask,
    max_episodes: int,
    seed: int = 0,
    stop_event: threading.Event | None = None,
    phases: list[str] | None = None,
) -> TrainJob:
    return TrainJob(
        run_id=f"run-seed-{seed}",
        task=episode_pb2.TrainTask(imitation=task),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=seed),
        device="cpu",
        data_root=DATA_ROOT,
        image_cache_dir=None,
        stop_event=stop_event or threading.Event(),
        set_phase=(phases.append if phases is not None else lambda phase: None),
    )


def wave_task(**kwargs: object) -> episode_pb2.ImitationTask:
    return episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave", **kwargs)  # type: ignore[arg-type]


def arm_rig() -> episode_pb2.Rig:
    """A custom three-bone arm standing on the origin."""
    return episode_pb2.Rig(
        name="arm",
        bones=[
            episode_pb2.Bone(name="upper", parent=-1, length=1.0),
            episode_pb2.Bone(name="fore", parent=0, length=0.8),
            episode_pb2.Bone(name="hand", parent=1, length=0.3),
        ],
    )


def arm_clip(frames: int = 12, first: float = math.pi / 2) -> episode_pb2.Clip:
    angles = []
    for f in range(frames):
        phase = 2 * math.pi * f / frames
        angles += [first + 0.3 * math.sin(phase), 0.5 * math.cos(phase), 0.2]
    return episode_pb2.Clip(name="reach", fps=12, frame_count=frames, joint_count=3, angles=angles)


# -- kinematics and reward ---------------------------------------------------------------------


def test_vectorised_kinematics_match_the_reference() -> None:
    rig = motion.STICKMAN
    clip = motion.builtin_clip("walk")
    skeleton = imitation.Skeleton(rig, torch.device("cpu"))
    angles = torch.tensor(clip.angles, dtype=torch.float32).reshape(clip.frame_count, -1)
    points = skeleton.keypoints(angles)
    for f in (0, 7, clip.frame_count - 1):
        reference = motion.forward_kinematics(rig, clip.frame(f))
        for b, (_, _, x1, y1) in enumerate(reference):
            assert points[f, b, 0].item() == pytest.approx(x1, abs=1e-5)
            assert points[f, b, 1].item() == pytest.approx(y1, abs=1e-5)


def test_subtree_mean_averages_over_descendants() -> None:
    rig = motion.rig_from_proto(arm_rig())
    skeleton = imitation.Skeleton(rig, torch.device("cpu"))
    per_bone = torch.tensor([3.0, 6.0, 9.0])
    assert skeleton.subtree_mean(per_bone).tolist() == pytest.approx([6.0, 7.5, 9.0])


def test_greedy_reward_is_one_for_the_clip_itself_and_follows_the_formula() -> None:
    clip = motion.builtin_clip("wave")
    learner = imitation.ImitationLearner(motion.STICKMAN, clip, seed=0)
    height = motion.rig_height(motion.STICKMAN, clip.frame(0))
    with torch.no_grad():
        learner.mean.copy_(torch.tensor(clip.angles).reshape(clip.frame_count, -1))
    assert learner.step().greedy_reward == pytest.approx(1.0, abs=1e-6)
    # Shift every root angle: the distance is computed by hand from the reference kinematics.
    with torch.no_grad():
        learner.mean.copy_(torch.tensor(clip.angles).reshape(clip.frame_count, -1))
        learner.mean[:, 0] += 0.2
    expected_d = 0.0
    shifted = learner.mean.detach().tolist()
    for f in range(clip.frame_count):
        target = motion.forward_kinematics(motion.STICKMAN, clip.frame(f))
        moved = motion.forward_kinematics(motion.STICKMAN, shifted[f])
        expected_d += sum(math.dist(t[2:], m[2:]) for t, m in zip(target, moved, strict=True))
    expected_d /= clip.frame_count * clip.joint_count
    result = learner.step()
    assert result.pose_error == pytest.approx(expected_d, rel=1e-4)
    assert result.greedy_reward == pytest.approx(math.exp(-expected_d / (0.1 * height)), rel=1e-4)


# -- validation --------------------------------------------------------------------------------


def test_validate_accepts_builtins_and_custom_rigs() -> None:
    task = episode_pb2.TrainTask(imitation=wave_task())
    assert imitation.validate(task, [DATA_ROOT]) == []
    custom = episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig=arm_rig(), clip=arm_clip())
    )
    assert contract.check_task(custom, episode_pb2.TrainConfig(max_episodes=1)) == []
    assert imitation.validate(custom, [DATA_ROOT]) == []


def test_validate_rejects_a_rig_that_is_flat_in_the_first_frame() -> None:
    flat = episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig=arm_rig(), clip=arm_clip())
    )
    flat.imitation.clip.angles[0:3] = [0.0, 0.0, 0.0]  # frame 0: every bone along +x
    (violation,) = imitation.validate(flat, [DATA_ROOT])
    assert violation.field == "task.imitation.clip.angles"
    assert "flat" in violation.description


def test_contract_rejects_structurally_bad_rigs() -> None:
    """Cycles, bad parents and lengths are the contract's checks; the trainer relies on them."""
    rig = arm_rig()
    rig.bones[1].parent = 2  # forward reference: would allow a cycle
    rig.bones[2].length = -1.0
    task = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(rig=rig, clip=arm_clip()))
    fields = {v.field for v in contract.check_task(task, episode_pb2.TrainConfig(max_episodes=1))}
    assert {"task.imitation.rig.bones[1].parent", "task.imitation.rig.bones[2].length"} <= fields


# -- the episode stream ------------------------------------------------------------------------


def test_stream_shape_metrics_and_details() -> None:
    phases: list[str] = []
    job = make_job(wave_task(), max_episodes=25, phases=phases)
    checker = contract.StreamChecker.for_task(job.task, job.config, job.run_id)
    episodes = list(imitation.run(job))
    for episode in episodes:
        checker.check(episode)
    checker.finish()
    assert phases == ["loading", "training"]
    assert [e.episode for e in episodes if e.HasField("imitation")] == [10, 20, 25]
    detail = episodes[-1].imitation
    assert (detail.frame_count, detail.joint_count, len(detail.angles)) == (60, 11, 660)
    assert set(episodes[0].metrics) == {
        "reward_std",
        "greedy_reward",
        "pose_error",
        "policy_std",
        "loss",
        "learning_rate",
    }
    assert episodes[0].metrics["policy_std"] == pytest.approx(imitation.INITIAL_STD, rel=1e-5)
    assert all(0.0 < e.reward <= 1.0 for e in episodes)


def test_custom_rig_and_clip_learn() -> None:
    task = episode_pb2.ImitationTask(rig=arm_rig(), clip=arm_clip(), group_size=8)
    episodes = list(imitation.run(make_job(task, max_episodes=150, seed=1)))
    first = sum(e.reward for e in episodes[:10]) / 10
    last = sum(e.reward for e in episodes[-10:]) / 10
    assert last > first + 0.3
    assert episodes[-1].imitation.joint_count == 3


def test_stop_event_ends_the_run_within_one_episode() -> None:
    stop = threading.Event()
    stream = imitation.run(make_job(wave_task(), max_episodes=5000, stop_event=stop))
    assert next(stream).episode == 1
    assert next(stream).episode == 2
    stop.set()
    assert list(stream) == []


def test_task_group_size_and_learning_rate_are_used() -> None:
    learner = imitation.learner_for(
        wave_task(group_size=4, learning_rate=0.5), seed=0, device="cpu"
    )
    assert learner.group_size == 4
    assert learner.optimizer.param_groups[0]["lr"] == 0.5
    default = imitation.learner_for(wave_task(), seed=0, device="cpu")
    assert default.group_size == imitation.DEFAULT_GROUP_SIZE == 16
    assert default.optimizer.param_groups[0]["lr"] == imitation.DEFAULT_LEARNING_RATE


# -- learning and determinism ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_stickman_wave_learns_with_defaults(seed: int) -> None:
    episodes = list(imitation.run(make_job(wave_task(), max_episodes=500, seed=seed)))
    rewards = [e.reward for e in episodes]
    assert max(rewards) >= 0.8
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last - first >= 0.4
    assert episodes[-1].metrics["greedy_reward"] >= 0.8


def test_same_seed_gives_an_identical_stream() -> None:
    def stream(seed: int) -> list[tuple[object, ...]]:
        return [
            (e.reward, e.best_reward, tuple(sorted(e.metrics.items())), tuple(e.imitation.angles))
            for e in imitation.run(make_job(wave_task(), max_episodes=30, seed=seed))
        ]

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("clip", [c for c in motion.BUILTIN_CLIP_NAMES if c != "wave"])
def test_every_other_builtin_clip_learns_with_defaults(clip: str, seed: int) -> None:
    """The learning target of every built-in clip (wave: the test above)."""
    torch.set_num_threads(1)
    task = episode_pb2.ImitationTask(rig_name="stickman", clip_name=clip)
    episodes = list(imitation.run(make_job(task, max_episodes=500, seed=seed)))
    rewards = [e.reward for e in episodes]
    assert max(rewards) >= 0.8
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last - first >= 0.4
    assert episodes[-1].metrics["greedy_reward"] >= 0.8


# -- the step's parts ----------------------------------------------------------------------------


def test_policy_gradient_is_autograds_gradient_of_the_loss() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(5)
    group, frames, joints = 8, 4, 3
    mean = torch.randn(frames, joints, generator=generator, requires_grad=True)
    raw_log_std = torch.randn(frames, joints, generator=generator)
    raw_log_std[0, 0], raw_log_std[1, 2] = -9.0, 2.0  # held at a bound by the clamp
    raw_log_std.requires_grad_(True)
    noise = torch.randn(group, frames, joints, generator=generator)
    local = torch.rand(group, frames, joints, generator=generator)
    advantages = (local - local.mean(0)) / local.std(0)

    # The reference: autograd through the loss as written, in float64 (at std = exp(-7) the
    # float32 ``(a - mean) / std`` of the reference itself would be off in its 5th digit).
    log_std = raw_log_std.double().clamp(imitation.LOG_STD_MIN, imitation.LOG_STD_MAX)
    samples = (mean.double() + log_std.exp() * noise.double()).detach()
    log_prob = -0.5 * ((samples - mean.double()) / log_std.exp()).square() - log_std
    loss = -(advantages.double() * log_prob).mean()
    loss.backward()

    std = log_std.detach().float().exp()
    free = raw_log_std.detach() == log_std.detach().float()
    gradient, written_loss = imitation.policy_gradient(advantages, noise, std, free)
    assert raw_log_std.grad is not None and mean.grad is not None
    torch.testing.assert_close(gradient[0], mean.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gradient[1], raw_log_std.grad, rtol=1e-5, atol=1e-7)
    assert gradient[1, 0, 0] == gradient[1, 1, 2] == 0.0
    assert written_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)


def _adam_pair(shape: tuple[int, ...]) -> tuple[PackedAdam, torch.Tensor, torch.optim.Adam]:
    start = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1))
    packed = start.clone()
    separate = [start[0].clone().requires_grad_(True), start[1].clone().requires_grad_(True)]
    return PackedAdam(packed, lr=0.03), packed, torch.optim.Adam(separate, lr=0.03)


def _params(adam: torch.optim.Adam) -> torch.Tensor:
    return torch.stack([p.detach() for p in adam.param_groups[0]["params"]])


def _saved(state: dict[str, object]) -> dict[str, object]:
    """``state`` written and read back, as a checkpoint does (and no tensor shared)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, object] = torch.load(buffer, weights_only=True)
    return loaded


def _step_both(packed_adam: PackedAdam, adam: torch.optim.Adam, grad: torch.Tensor) -> None:
    packed_adam.step(grad)
    for param, part in zip(adam.param_groups[0]["params"], grad, strict=True):
        param.grad = part.clone()
    adam.step()


def test_packed_adam_computes_torchs_adam_bit_for_bit() -> None:
    torch.set_num_threads(1)
    packed_adam, packed, adam = _adam_pair((60, 11))
    generator = torch.Generator().manual_seed(2)
    for i in range(12):
        if i == 6:  # a new learning rate from the next step on, as set_learning_rate does
            packed_adam.param_groups[0]["lr"] = adam.param_groups[0]["lr"] = 0.004
        _step_both(packed_adam, adam, torch.randn(2, 60, 11, generator=generator))
        assert torch.equal(
            packed, torch.stack([p.detach() for p in adam.param_groups[0]["params"]])
        )


def test_packed_adam_writes_the_state_dict_torchs_adam_writes() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(4)
    packed_adam, _, adam = _adam_pair((5, 3))
    assert packed_adam.state_dict() == adam.state_dict()
    for step in range(3):
        if step == 2:
            packed_adam.param_groups[0]["lr"] = adam.param_groups[0]["lr"] = 0.004
        _step_both(packed_adam, adam, torch.randn(2, 5, 3, generator=generator))
    mine, theirs = packed_adam.state_dict(), adam.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert set(mine["state"]) == set(theirs["state"]) == {0, 1}
    for i in (0, 1):
        assert set(mine["state"][i]) == set(theirs["state"][i])
        for name, value in theirs["state"][i].items():
            assert mine["state"][i][name].dtype == value.dtype, name
            assert torch.equal(mine["state"][i][name], value), name


def test_packed_adam_state_is_torchs_adam_state_both_ways() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(2, 5, 3, generator=generator) for _ in range(6)]
    packed_adam, packed, adam = _adam_pair((5, 3))
    assert packed_adam.state_dict()["state"] == {}  # no state before a step, as torch's
    for grad in grads[:3]:
        _step_both(packed_adam, adam, grad)
    saved = packed_adam.state_dict()
    assert set(saved["state"]) == {0, 1} and saved["state"][0]["step"].item() == 3.0
    saved = _saved(saved)

    # A PackedAdam's state continues in torch.optim.Adam, and torch.optim.Adam's in a PackedAdam.
    into_torch = torch.optim.Adam([p.detach().clone().requires_grad_(True) for p in packed], 0.1)
    into_torch.load_state_dict(saved)
    into_packed, packed_copy, _ = _adam_pair((5, 3))
    packed_copy.copy_(_params(adam))
    into_packed.load_state_dict(_saved(adam.state_dict()))
    assert into_packed.steps == 3
    for grad in grads[3:]:
        _step_both(packed_adam, into_torch, grad)
        into_packed.step(grad)
    assert torch.equal(_params(into_torch), packed) and torch.equal(packed_copy, packed)

    amsgrad = torch.optim.Adam([torch.zeros(5, 3), torch.zeros(5, 3)], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        into_packed.load_state_dict(amsgrad.state_dict())
