"""Request validation of trainwire.contract: every bad field is reported at once, by path."""

from __future__ import annotations

import math

import pytest

from trainwire import motion
from trainwire.contract import (
    BUILTIN_CLIPS,
    BUILTIN_RIG_BONES,
    bad_request,
    check_create_run,
    check_run_id,
    check_task,
    check_train_request,
    describe_violations,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2, trainer_service_pb2


def imitation(**kwargs) -> episode_pb2.TrainTask:
    if "clip" not in kwargs:
        kwargs.setdefault("clip_name", "wave")
    return episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(**kwargs))


def config(n: int = 10) -> episode_pb2.TrainConfig:
    return episode_pb2.TrainConfig(max_episodes=n, seed=3)


def fields(violations) -> list[str]:
    return [v.field for v in violations]


def test_builtins_agree_with_motion_module():
    assert {n: r.bone_count for n, r in motion.BUILTIN_RIGS.items()} == BUILTIN_RIG_BONES
    assert set(BUILTIN_CLIPS) == set(motion.BUILTIN_CLIP_NAMES)


def test_valid_imitation_and_grpo_tasks():
    assert check_task(imitation(), config()) == []
    tuned = imitation(rig_name="stickman", group_size=32, learning_rate=0.1)
    assert check_task(tuned, config(1)) == []
    grpo = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="models/tiny",
            dataset_path="data/rows.jsonl",
            reward_functions=["exact_match", "format", "length"],
            num_generations=4,
            batch_size=8,
            beta=0.0,
            dataloader_num_workers=0,
        )
    )
    assert check_task(grpo, config(10_000_000)) == []


def test_missing_task_and_bad_max_episodes_reported_together():
    got = check_task(episode_pb2.TrainTask(), episode_pb2.TrainConfig(max_episodes=10_000_001))
    assert fields(got) == ["task", "config.max_episodes"]
    assert "1..10000000" in got[1].description


def test_checkpoint_settings_are_checked_against_the_run():
    every = episode_pb2.TrainConfig(max_episodes=10, checkpoint_every=10, keep_checkpoints=100)
    assert check_task(imitation(), every) == []
    got = check_task(
        imitation(),
        episode_pb2.TrainConfig(max_episodes=10, checkpoint_every=11, keep_checkpoints=101),
    )
    assert fields(got) == ["config.checkpoint_every", "config.keep_checkpoints"]
    assert "1..max_episodes (10)" in got[0].description and "1..100" in got[1].description
    negative = episode_pb2.TrainConfig(max_episodes=10, checkpoint_every=-1, keep_checkpoints=-1)
    assert fields(check_task(imitation(), negative)) == [
        "config.checkpoint_every",
        "config.keep_checkpoints",
    ]


def test_imitation_field_violations_all_at_once():
    got = check_task(
        imitation(clip_name="dance", rig_name="robot", group_size=1, learning_rate=math.nan),
        config(0),
    )
    assert fields(got) == [
        "task.imitation.rig_name",
        "task.imitation.clip_name",
        "task.imitation.group_size",
        "task.imitation.learning_rate",
        "config.max_episodes",
    ]
    assert "stickman" in got[0].description and "wave" in got[1].description


def test_clip_is_required():
    got = check_task(episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask()), config())
    assert fields(got) == ["task.imitation.clip_name"]


def custom_rig(*bones: tuple[int, float]) -> episode_pb2.Rig:
    return episode_pb2.Rig(
        name="r",
        bones=[
            episode_pb2.Bone(name=f"b{i}", parent=p, length=n) for i, (p, n) in enumerate(bones)
        ],
    )


def test_custom_rig_structure():
    ok = custom_rig((-1, 1.0), (0, 0.5), (1, 0.5))
    clip = episode_pb2.Clip(fps=30, frame_count=2, joint_count=3, angles=[0.0] * 6)
    assert check_task(imitation(rig=ok, clip=clip), config()) == []

    bad = custom_rig((0, 1.0), (2, 0.5), (-1, 0.5), (1, 0.0), (3, -math.inf))
    got = check_task(imitation(rig=bad, clip=clip), config())
    assert fields(got) == [
        "task.imitation.rig.bones[0].parent",  # root must be -1
        "task.imitation.rig.bones[1].parent",  # forward reference (a cycle in disguise)
        "task.imitation.rig.bones[2].parent",  # a second root
        "task.imitation.rig.bones[3].length",
        "task.imitation.rig.bones[4].length",
    ]
    assert "cycles" in got[1].description


def test_custom_rig_bone_count_limits():
    empty = check_task(imitation(rig=episode_pb2.Rig()), config())
    assert fields(empty) == ["task.imitation.rig.bones"]
    big = custom_rig((-1, 1.0), *[(0, 1.0)] * 32)
    assert "33 bones" in check_task(imitation(rig=big), config())[0].description


def test_builtin_clip_needs_stickman_sized_rig():
    got = check_task(imitation(rig=custom_rig((-1, 1.0), (0, 1.0))), config())
    assert fields(got) == ["task.imitation.clip_name"]
    assert "2 bones" in got[0].description


def test_custom_clip_checks():
    clip = episode_pb2.Clip(fps=-1, frame_count=241, joint_count=5, angles=[0.0] * 3)
    got = check_task(imitation(clip=clip), config())
    assert fields(got) == [
        "task.imitation.clip.fps",
        "task.imitation.clip.frame_count",
        "task.imitation.clip.joint_count",  # 5 joints but stickman has 11 bones
        "task.imitation.clip.angles",
    ]
    angles = [0.0] * 10 + [math.inf]
    nan_clip = episode_pb2.Clip(fps=30, frame_count=1, joint_count=11, angles=angles)
    got = check_task(imitation(clip=nan_clip), config())
    assert fields(got) == ["task.imitation.clip.angles"] and "finite" in got[0].description


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("", "required"),
        ("C:/models", "Windows path"),
        ("\\\\server\\share", "Windows path"),
        ("models/../../etc", "'..'"),
        ("/data/../etc/passwd", "'..'"),
        ("..", "'..'"),
        ("a\\..\\b", "'..'"),
    ],
)
def test_grpo_paths_stay_under_a_root(path, words):
    task = episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(model_path=path, dataset_path="d.jsonl"))
    got = check_task(task, config())
    assert fields(got) == ["task.grpo.model_path"] and words in got[0].description


def test_an_absolute_grpo_path_is_for_the_trainer_to_place_in_a_root():
    # The trainer admits an absolute path inside any of its --data-root directories (a shared
    # filesystem) and refuses one outside all of them; the request itself is well formed.
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="/lustre/models/m", dataset_path="/lustre/d.jsonl")
    )
    assert check_task(task, config()) == []


def test_grpo_numeric_and_name_violations():
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="m",
            dataset_path="d.jsonl",
            reward_functions=["exact_match", "vibes", "exact_match"],
            num_generations=1,
            batch_size=2000,
            max_completion_length=5000,
            learning_rate=2.0,
            beta=-0.1,
            temperature=math.inf,
            gradient_accumulation_steps=-1,
            dataloader_num_workers=0,
            dataloader_prefetch_factor=2,
        )
    )
    got = fields(check_task(task, config()))
    assert got == [
        "task.grpo.reward_functions[1]",
        "task.grpo.reward_functions[2]",
        "task.grpo.num_generations",
        "task.grpo.batch_size",
        "task.grpo.max_completion_length",
        "task.grpo.learning_rate",
        "task.grpo.beta",
        "task.grpo.temperature",
        "task.grpo.gradient_accumulation_steps",
        "task.grpo.dataloader_prefetch_factor",
    ]


def test_grpo_batch_must_be_multiple_of_generations():
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d", num_generations=3, batch_size=4)
    )
    got = check_task(task, config())
    assert fields(got) == ["task.grpo.batch_size"] and "multiple" in got[0].description


def test_train_request_needs_run_id():
    req = trainer_service_pb2.TrainRequest(task=imitation(), config=config())
    assert fields(check_train_request(req)) == ["run_id"]
    req.run_id = "x" * 129
    assert fields(check_train_request(req)) == ["run_id"]
    req.run_id = "run-1"
    assert check_train_request(req) == []


def test_create_run_checks_speed_rate_and_names():
    req = gateway_service_pb2.CreateRunRequest(
        task=imitation(),
        config=config(),
        speed=math.nan,
        episodes_per_second=math.inf,
        request_id="r" * 200,
        display_name="n" * 201,
    )
    assert fields(check_create_run(req)) == [
        "speed",
        "episodes_per_second",
        "request_id",
        "display_name",
    ]
    ok = gateway_service_pb2.CreateRunRequest(
        task=imitation(), config=config(), speed=0, episodes_per_second=-1
    )
    assert check_create_run(ok) == []
    # Speed is one rule everywhere: finite values are clamped (by the gateway), not refused.
    assert fields(check_create_run(gateway_service_pb2.CreateRunRequest(speed=-2))) == [
        "task",
        "config.max_episodes",
    ]


@pytest.mark.parametrize(
    ("rate", "ok"),
    [
        (0, True),
        (-1, True),
        (-1e300, True),
        (0.01, True),
        (10_000, True),
        (1e-300, False),
        (0.009, False),
        (10_001, False),
        (math.inf, False),
        (-math.inf, False),
        (math.nan, False),
    ],
)
def test_episode_rates_are_physical(rate: float, ok: bool) -> None:
    req = gateway_service_pb2.CreateRunRequest(
        task=imitation(), config=config(), episodes_per_second=rate
    )
    assert fields(check_create_run(req)) == ([] if ok else ["episodes_per_second"])


def test_names_are_short_and_printable_and_run_ids_are_plain() -> None:
    task = imitation()
    task.imitation.avatar_id = "a" * 65
    assert fields(check_task(task, config())) == ["task.imitation.avatar_id"]
    task = imitation()
    task.imitation.rig_name = "r" * 65
    assert fields(check_task(task, config())) == ["task.imitation.rig_name"]
    task = imitation()
    task.imitation.clip_name = "c" * 3000
    assert fields(check_task(task, config())) == ["task.imitation.clip_name"]
    for bad in ("", "x" * 65, "run\nforged log line", "a b", "run/1", "ü"):
        assert fields(check_run_id(bad)) == ["run_id"], bad
    assert check_run_id("Run-1.a_b" + "x" * 55) == []
    req = gateway_service_pb2.CreateRunRequest(
        task=imitation(), config=config(), display_name="clear\x1b[2J\x07"
    )
    (violation,) = check_create_run(req)
    assert violation.field == "display_name" and "control" in violation.description
    req.display_name = "a run with spaces, accents é and 200 characters at most" + "." * 144
    assert check_create_run(req) == []


def test_custom_rigs_and_clips_stay_in_physical_ranges() -> None:
    rig = episode_pb2.Rig(
        name="two",
        bones=[
            episode_pb2.Bone(name="root", parent=-1, length=1e-300),
            episode_pb2.Bone(name="b" * 65, parent=0, length=1e4),
        ],
    )
    clip = episode_pb2.Clip(name="c", fps=30, frame_count=1, joint_count=2, angles=[0.0, 3e38])
    task = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(rig=rig, clip=clip))
    assert fields(check_task(task, config())) == [
        "task.imitation.rig.bones[0].length",
        "task.imitation.rig.bones[1].name",
        "task.imitation.rig.bones[1].length",
        "task.imitation.clip.angles",
    ]
    fixed = task.imitation
    fixed.rig.bones[0].length = 1e-3
    fixed.rig.bones[1].length = 1e3
    fixed.rig.bones[1].name = "arm"
    del fixed.clip.angles[:]
    fixed.clip.angles.extend([4 * math.pi - 1e-3, -4 * math.pi + 1e-3])
    assert check_task(task, config()) == []


def test_bad_request_packs_every_violation():
    got = check_task(episode_pb2.TrainTask(), episode_pb2.TrainConfig())
    packed = bad_request(got)
    assert [(v.field, v.description) for v in packed.field_violations] == [
        (v.field, v.description) for v in got
    ]
    assert describe_violations(got).startswith("task: required")
