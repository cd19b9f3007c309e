"""What a fork may change (``trainwire.contract.fork_differences``): hyperparameters, never the
task kind, the rig and clip or the GRPO model, dataset and batch layout; a default and its
explicit value are the same."""

from __future__ import annotations

from trainwire.contract import fork_differences
from trainwire.v1 import episode_pb2


def _imitation(**fields: object) -> episode_pb2.TrainTask:
    task = episode_pb2.ImitationTask(**{"clip_name": "wave", **fields})  # type: ignore[arg-type]
    return episode_pb2.TrainTask(imitation=task)


def _grpo(**fields: object) -> episode_pb2.TrainTask:
    base: dict[str, object] = {"model_path": "m", "dataset_path": "d.jsonl"}
    task = episode_pb2.GrpoTask(**{**base, **fields})  # type: ignore[arg-type]
    return episode_pb2.TrainTask(grpo=task)


def _fields(parent: episode_pb2.TrainTask, task: episode_pb2.TrainTask) -> list[str]:
    return [v.field for v in fork_differences(parent, task)]


def test_hyperparameters_may_change() -> None:
    parent = _imitation(rig_name="stickman", learning_rate=0.03, group_size=16)
    assert _fields(parent, _imitation(learning_rate=0.001, group_size=4, avatar_id="a")) == []
    assert _fields(_grpo(), _grpo(learning_rate=1e-5, temperature=0.7, beta=0.1)) == []
    assert _fields(_grpo(), _grpo(num_generations=4, dataloader_num_workers=0)) == []
    # Defaults and their explicit values are the same.
    explicit = _grpo(
        reward_functions=["exact_match", "format"],
        max_completion_length=16,
        gradient_accumulation_steps=1,
        num_processes=1,
    )
    assert _fields(_grpo(), explicit) == []


def test_the_model_and_data_may_not() -> None:
    assert _fields(_imitation(), _imitation(clip_name="walk")) == ["task.imitation.clip_name"]
    custom = _imitation(rig=episode_pb2.Rig(name="mine", bones=[episode_pb2.Bone(parent=-1)]))
    assert _fields(_imitation(), custom) == ["task.imitation.rig_name", "task.imitation.rig"]
    [violation] = fork_differences(_imitation(), custom)[1:]
    assert violation.description == "a custom rig 'mine'; the checkpoint's task has unset"
    assert _fields(_grpo(), _grpo(model_path="other")) == ["task.grpo.model_path"]
    changed = _grpo(dataset_path="e.jsonl", batch_size=32, num_processes=2)
    assert _fields(_grpo(), changed) == [
        "task.grpo.dataset_path",
        "task.grpo.batch_size",
        "task.grpo.num_processes",
    ]
    [kind] = fork_differences(_imitation(), _grpo())
    assert (kind.field, kind.description) == (
        "task",
        "a task of kind 'grpo'; the checkpoint is of kind 'imitation'",
    )
