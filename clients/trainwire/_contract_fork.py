"""What a fork may change: ``fork_differences`` compares a fork's task with the task of the run it
forks from and names every field that differs beyond the ones a fork may change.

A fork starts from another run's checkpoint (``CreateRunRequest.fork_from``): its weights and
training state. It trains the same thing with the same model, so it has the same task kind and
the same model: imitation the same rig and clip, GRPO the same model, dataset, reward functions
and batch layout. It may change its hyperparameters (``FORK_FIELDS``), its seed and
``max_episodes``. A LoRA run's fork trains the same adapters (``lora``: the same rank, alpha,
dropout and targets, defaults filled in), and a full fine-tuning run's fork no adapters. The
gateway refuses a fork that changes more; a trainer refuses to restore a checkpoint of another
run whose task differs more (the same function, so both agree).

This module depends on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

from google.protobuf.message import Message

from trainwire._contract_base import (
    DEFAULT_GRPO_GRADIENT_ACCUMULATION_STEPS,
    DEFAULT_GRPO_MAX_COMPLETION_LENGTH,
    DEFAULT_GRPO_PROCESSES,
    DEFAULT_LORA_ALPHA_PER_RANK,
    DEFAULT_LORA_RANK,
    DEFAULT_REWARD_FUNCTIONS,
    DEFAULT_RIG,
    FieldViolation,
    task_kind,
)
from trainwire.v1 import episode_pb2

#: The task fields a fork may change, by kind: the hyperparameters (and, for GRPO, how many
#: DataLoader workers decode images and whether activations are recomputed, which change no
#: result; for imitation the avatar's free-form id).
FORK_FIELDS: dict[str, tuple[str, ...]] = {
    "imitation": ("learning_rate", "group_size", "avatar_id"),
    "grpo": (
        "learning_rate",
        "temperature",
        "beta",
        "num_generations",
        "dataloader_num_workers",
        "dataloader_prefetch_factor",
        "gradient_checkpointing",
    ),
}
#: GRPO fields whose 0 means a default: compared with the default filled in.
_GRPO_DEFAULTS = {
    "max_completion_length": DEFAULT_GRPO_MAX_COMPLETION_LENGTH,
    "gradient_accumulation_steps": DEFAULT_GRPO_GRADIENT_ACCUMULATION_STEPS,
    "num_processes": DEFAULT_GRPO_PROCESSES,
}


def _comparable(task: episode_pb2.TrainTask) -> Message | None:
    """The task's kind message without the fields a fork may change, defaults filled in."""
    kind = task_kind(task)
    if not kind:
        return None
    body: Message = getattr(task, kind)
    copy = type(body)()
    copy.CopyFrom(body)
    for name in FORK_FIELDS[kind]:
        copy.ClearField(name)
    if isinstance(copy, episode_pb2.ImitationTask):
        if copy.WhichOneof("rig_source") is None:
            copy.rig_name = DEFAULT_RIG
    elif isinstance(copy, episode_pb2.GrpoTask):
        if not copy.reward_functions:
            copy.reward_functions.extend(DEFAULT_REWARD_FUNCTIONS)
        for name, default in _GRPO_DEFAULTS.items():
            if not getattr(copy, name):
                setattr(copy, name, default)
        if copy.HasField("lora"):
            copy.lora.rank = copy.lora.rank or DEFAULT_LORA_RANK
            copy.lora.alpha = copy.lora.alpha or DEFAULT_LORA_ALPHA_PER_RANK * copy.lora.rank
    return copy


def _shown(value: object) -> str:
    """A field's value for people: scalars as they are, messages and lists summarised."""
    if isinstance(value, episode_pb2.LoraConfig):
        targets = ", ".join(value.target_modules) or "the language model's linear layers"
        return (
            f"LoRA rank {value.rank}, alpha {value.alpha:g}, dropout {value.dropout:g} on {targets}"
        )
    if isinstance(value, Message):
        name = getattr(value, "name", "")
        kind = type(value).__name__.lower()
        return f"a custom {kind} {name!r}" if name else f"a custom {kind}"
    if isinstance(value, str):
        return repr(value)
    if not isinstance(value, (int, float, bool)):
        return repr(list(value))  # type: ignore[call-overload]
    return repr(value)


def fork_differences(
    parent: episode_pb2.TrainTask, task: episode_pb2.TrainTask, prefix: str = "task"
) -> list[FieldViolation]:
    """The fields of ``task`` that differ from ``parent`` beyond what a fork may change (empty:
    ``task`` may continue a checkpoint of ``parent``).

    Args:
        parent: The task of the run whose checkpoint the fork starts from.
        task: The fork's task.
        prefix: The path of ``task`` in its request, for the field names.

    Returns:
        One violation per differing field, named as in the request
        (``task.imitation.clip_name``); the task kind itself when the kinds differ.
    """
    kind, parent_kind = task_kind(task), task_kind(parent)
    if kind != parent_kind:
        return [
            FieldViolation(
                prefix,
                f"a task of kind {kind or 'unset'!r}; the checkpoint is of kind {parent_kind!r}",
            )
        ]
    mine, theirs = _comparable(task), _comparable(parent)
    if mine is None or theirs is None or mine == theirs:
        return []
    out = []
    for field in mine.DESCRIPTOR.fields:
        name = field.name
        if field.containing_oneof is not None:
            group = field.containing_oneof.name
            if mine.WhichOneof(group) != theirs.WhichOneof(group):
                if mine.WhichOneof(group) != name and theirs.WhichOneof(group) != name:
                    continue
                here = _shown(getattr(mine, name)) if mine.HasField(name) else "unset"
                there = _shown(getattr(theirs, name)) if theirs.HasField(name) else "unset"
                out.append(
                    FieldViolation(
                        f"{prefix}.{kind}.{name}", f"{here}; the checkpoint's task has {there}"
                    )
                )
                continue
        # A singular message: whether it is set counts (an empty LoRA config is LoRA).
        if isinstance(getattr(mine, name), Message) and (
            mine.HasField(name) != theirs.HasField(name)
        ):
            here = _shown(getattr(mine, name)) if mine.HasField(name) else "unset"
            there = _shown(getattr(theirs, name)) if theirs.HasField(name) else "unset"
            out.append(
                FieldViolation(
                    f"{prefix}.{kind}.{name}", f"{here}; the checkpoint's task has {there}"
                )
            )
            continue
        if getattr(mine, name) != getattr(theirs, name):
            out.append(
                FieldViolation(
                    f"{prefix}.{kind}.{name}",
                    f"{_shown(getattr(mine, name))}; the checkpoint's task has "
                    f"{_shown(getattr(theirs, name))}",
                )
            )
    return out
