"""Request validation: ``check_task``, ``check_train_request``, ``check_create_run`` and friends.

Each check returns every bad field at once as ``FieldViolation`` s (empty when the request is
valid); ``bad_request`` packs them into a ``google.rpc.BadRequest`` and ``describe_violations``
into a status message. ``trainwire.contract`` re-exports the public names; import them from
there.

This module depends on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from google.rpc import error_details_pb2

from trainwire._contract_base import (
    BUILTIN_CLIPS,
    BUILTIN_RIG_BONES,
    DEFAULT_GRPO_GENERATIONS,
    DEFAULT_REWARD_FUNCTIONS,
    DEFAULT_RIG,
    MAX_ABS_ANGLE,
    MAX_BONE_LENGTH,
    MAX_BONES,
    MAX_DISPLAY_NAME_LENGTH,
    MAX_EPISODE_RATE,
    MAX_EPISODES,
    MAX_FRAMES,
    MAX_GROUP_SIZE,
    MAX_GRPO_PROCESSES,
    MAX_ID_LENGTH,
    MAX_JOINTS,
    MAX_KEEP_CHECKPOINTS,
    MAX_NAME_LENGTH,
    MAX_RUN_ID_LENGTH,
    MIN_BONE_LENGTH,
    MIN_EPISODE_RATE,
    REWARD_FUNCTIONS,
    FieldViolation,
    task_kind,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2, trainer_service_pb2

_RUN_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _bad_ratio(value: float) -> bool:
    """True unless value is 0 (default) or finite in (0, 1]."""
    return value != 0 and not (math.isfinite(value) and 0 < value <= 1)


def _check_data_path(path: str, field: str, out: list[FieldViolation]) -> None:
    """A path the trainer resolves: relative to its first data root, or absolute (POSIX) inside
    any of its roots; which root holds it is the trainer's to decide."""
    if not path:
        out.append(
            FieldViolation(
                field,
                "required: a path relative to the trainer's data root, or an absolute path "
                "inside one of its data roots",
            )
        )
        return
    if path.startswith("\\") or (len(path) > 1 and path[1] == ":"):
        out.append(
            FieldViolation(
                field, f"{path!r} is a Windows path; give a POSIX path under a data root"
            )
        )
        return
    if ".." in path.replace("\\", "/").split("/"):
        out.append(FieldViolation(field, f"{path!r} contains '..'; it must stay under the root"))
    if "\x00" in path:
        out.append(FieldViolation(field, "contains a NUL character"))


def _check_rig(rig: episode_pb2.Rig, field: str, out: list[FieldViolation]) -> int | None:
    """Validates a custom rig; returns its bone count when the rig is valid."""
    bones = rig.bones
    start = len(out)
    _check_name(rig.name, f"{field}.name", out)
    if not 1 <= len(bones) <= MAX_BONES:
        out.append(FieldViolation(f"{field}.bones", f"{len(bones)} bones; need 1..{MAX_BONES}"))
        return None
    for i, bone in enumerate(bones):
        where = f"{field}.bones[{i}]"
        if i == 0:
            if bone.parent != -1:
                out.append(
                    FieldViolation(f"{where}.parent", "bone 0 is the root: its parent must be -1")
                )
        elif bone.parent == -1:
            out.append(
                FieldViolation(f"{where}.parent", "a second root; only bone 0 may have parent -1")
            )
        elif not 0 <= bone.parent < i:
            out.append(
                FieldViolation(
                    f"{where}.parent",
                    f"parent {bone.parent} must be an earlier bone (0..{i - 1}); "
                    "this also rules out cycles",
                )
            )
        _check_name(bone.name, f"{where}.name", out)
        if not (math.isfinite(bone.length) and MIN_BONE_LENGTH <= bone.length <= MAX_BONE_LENGTH):
            out.append(
                FieldViolation(
                    f"{where}.length",
                    f"length {bone.length} must be in {MIN_BONE_LENGTH:g}..{MAX_BONE_LENGTH:g}",
                )
            )
    return len(bones) if len(out) == start else None


def _check_clip(
    clip: episode_pb2.Clip, joints: int | None, field: str, out: list[FieldViolation]
) -> None:
    _check_name(clip.name, f"{field}.name", out)
    if not (math.isfinite(clip.fps) and clip.fps > 0):
        out.append(FieldViolation(f"{field}.fps", f"fps {clip.fps} must be finite and > 0"))
    if not 1 <= clip.frame_count <= MAX_FRAMES:
        out.append(
            FieldViolation(
                f"{field}.frame_count", f"{clip.frame_count} frames; need 1..{MAX_FRAMES}"
            )
        )
    if not 1 <= clip.joint_count <= MAX_JOINTS:
        out.append(
            FieldViolation(
                f"{field}.joint_count", f"{clip.joint_count} joints; need 1..{MAX_JOINTS}"
            )
        )
    elif joints is not None and clip.joint_count != joints:
        out.append(
            FieldViolation(
                f"{field}.joint_count",
                f"{clip.joint_count} joints but the rig has {joints} bones; they must match",
            )
        )
    expected = clip.frame_count * clip.joint_count
    if len(clip.angles) != expected:
        out.append(
            FieldViolation(
                f"{field}.angles",
                f"{len(clip.angles)} angles; need frame_count x joint_count = {expected}",
            )
        )
    else:
        bad = next((a for a in clip.angles if not abs(a) <= MAX_ABS_ANGLE), None)
        if bad is not None:
            out.append(
                FieldViolation(
                    f"{field}.angles",
                    f"angle {bad} is out of range: every angle must be finite and within "
                    "+-4 pi radians",
                )
            )


def _check_name(name: str, field: str, out: list[FieldViolation]) -> None:
    """A name (rig, clip, bone, avatar): at most ``MAX_NAME_LENGTH`` printable characters."""
    if len(name) > MAX_NAME_LENGTH:
        out.append(FieldViolation(field, f"{len(name)} characters; at most {MAX_NAME_LENGTH}"))
    elif not name.isprintable():
        out.append(FieldViolation(field, "contains control characters"))


def check_run_id(run_id: str, field: str = "run_id") -> list[FieldViolation]:
    """A run id: 1..64 characters of ``A-Z a-z 0-9 . _ -`` (it appears in logs, errors and
    metadata, so nothing else is accepted anywhere)."""
    if not run_id:
        return [FieldViolation(field, "required")]
    if len(run_id) > MAX_RUN_ID_LENGTH:
        return [FieldViolation(field, f"{len(run_id)} characters; at most {MAX_RUN_ID_LENGTH}")]
    if not _RUN_ID_CHARS.issuperset(run_id):
        return [FieldViolation(field, "may contain only letters, digits, '.', '_' and '-'")]
    return []


def display_run_id(run_id: str) -> str:
    """A run id fit for a message or a log line: itself when valid, else a short quoted prefix
    (a bad id may be huge, or hold a newline that would forge a log line)."""
    if not check_run_id(run_id):
        return run_id
    return repr(run_id[:32]) + ("..." if len(run_id) > 32 else "")


def _check_imitation(task: episode_pb2.ImitationTask, p: str, out: list[FieldViolation]) -> None:
    _check_name(task.avatar_id, f"{p}.avatar_id", out)
    joints: int | None
    rig_source = task.WhichOneof("rig_source")
    if rig_source == "rig":
        joints = _check_rig(task.rig, f"{p}.rig", out)
    elif len(task.rig_name) > MAX_NAME_LENGTH:
        joints = None
        _check_name(task.rig_name, f"{p}.rig_name", out)
    else:
        name = task.rig_name or DEFAULT_RIG
        joints = BUILTIN_RIG_BONES.get(name)
        if joints is None:
            out.append(
                FieldViolation(
                    f"{p}.rig_name",
                    f"unknown rig {name!r}; built-in rigs: {', '.join(BUILTIN_RIG_BONES)}",
                )
            )
    clip_source = task.WhichOneof("clip_source")
    if clip_source == "clip":
        _check_clip(task.clip, joints, f"{p}.clip", out)
    elif len(task.clip_name) > MAX_NAME_LENGTH:
        _check_name(task.clip_name, f"{p}.clip_name", out)
    elif clip_source is None or not task.clip_name:
        out.append(
            FieldViolation(
                f"{p}.clip_name",
                f"required: a built-in clip ({', '.join(BUILTIN_CLIPS)}) or a custom clip",
            )
        )
    elif task.clip_name not in BUILTIN_CLIPS:
        out.append(
            FieldViolation(
                f"{p}.clip_name",
                f"unknown clip {task.clip_name!r}; built-in clips: {', '.join(BUILTIN_CLIPS)}",
            )
        )
    elif joints is not None and joints != BUILTIN_RIG_BONES[DEFAULT_RIG]:
        out.append(
            FieldViolation(
                f"{p}.clip_name",
                f"built-in clips are for the {DEFAULT_RIG} rig "
                f"({BUILTIN_RIG_BONES[DEFAULT_RIG]} joints); this rig has {joints} bones",
            )
        )
    if task.group_size != 0 and not 2 <= task.group_size <= MAX_GROUP_SIZE:
        out.append(
            FieldViolation(
                f"{p}.group_size", f"{task.group_size}; need 2..{MAX_GROUP_SIZE} (0 = default)"
            )
        )
    if _bad_ratio(task.learning_rate):
        out.append(
            FieldViolation(f"{p}.learning_rate", f"{task.learning_rate}; need (0, 1] (0 = default)")
        )


def _check_range(
    value: int, low: int, high: int, field: str, out: list[FieldViolation], zero_ok: bool = True
) -> None:
    if (value != 0 or not zero_ok) and not low <= value <= high:
        default = " (0 = default)" if zero_ok else ""
        out.append(FieldViolation(field, f"{value}; need {low}..{high}{default}"))


#: LoRA ranks a task may ask for (0: the default, ``trainwire._contract_base.DEFAULT_LORA_RANK``).
MAX_LORA_RANK = 256
#: At most this many target module names, each at most this long.
MAX_LORA_TARGETS = 256
MAX_LORA_TARGET_LENGTH = 256
_LORA_TARGET = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _check_lora(lora: episode_pb2.LoraConfig, p: str, out: list[FieldViolation]) -> None:
    """``task.grpo.lora``: rank, alpha and dropout in range; target module names that peft can
    match (dotted identifiers, no repeats). Whether they name layers of the model is the
    trainer's to say, once it loaded the model."""
    _check_range(lora.rank, 1, MAX_LORA_RANK, f"{p}.rank", out)
    if lora.alpha != 0 and not (math.isfinite(lora.alpha) and lora.alpha > 0):
        out.append(
            FieldViolation(f"{p}.alpha", f"{lora.alpha}; need a finite value > 0 (0 = 2 x rank)")
        )
    if not (math.isfinite(lora.dropout) and 0 <= lora.dropout < 1):
        out.append(FieldViolation(f"{p}.dropout", f"{lora.dropout}; need [0, 1)"))
    if len(lora.target_modules) > MAX_LORA_TARGETS:
        out.append(
            FieldViolation(
                f"{p}.target_modules",
                f"{len(lora.target_modules)} names; at most {MAX_LORA_TARGETS}",
            )
        )
        return
    seen: set[str] = set()
    for i, name in enumerate(lora.target_modules):
        field = f"{p}.target_modules[{i}]"
        if len(name) > MAX_LORA_TARGET_LENGTH or not _LORA_TARGET.fullmatch(name):
            out.append(
                FieldViolation(
                    field,
                    f"{name[:64]!r}; need a module name or dotted suffix such as 'q_proj' "
                    f"(letters, digits, '_' and '.', at most {MAX_LORA_TARGET_LENGTH} characters)",
                )
            )
        elif name in seen:
            out.append(FieldViolation(field, f"{name!r} is listed twice"))
        seen.add(name)


#: A reward of a trainer's --reward-module: MODULE:FUNCTION (a public function).
_CUSTOM_REWARD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z]\w*", re.ASCII)
MAX_REWARD_NAME_LENGTH = 256
#: Longest dataset column name.
MAX_COLUMN_LENGTH = 256


def is_custom_reward(name: str) -> bool:
    """Whether ``name`` has the shape of a reward module's reward, ``MODULE:FUNCTION``. Which
    ones a trainer offers it says itself (``GetCapabilitiesResponse.reward_functions``)."""
    return len(name) <= MAX_REWARD_NAME_LENGTH and _CUSTOM_REWARD.fullmatch(name) is not None


def _check_rewards(task: episode_pb2.GrpoTask, p: str, out: list[FieldViolation]) -> None:
    """Reward names built in or shaped ``MODULE:FUNCTION``, none twice; one finite weight per
    reward function (the defaults count when the task names none), or none."""
    seen: set[str] = set()
    for i, name in enumerate(task.reward_functions):
        if name not in REWARD_FUNCTIONS and not is_custom_reward(name):
            out.append(
                FieldViolation(
                    f"{p}.reward_functions[{i}]",
                    f"unknown reward function {name[:64]!r}; built-in: "
                    f"{', '.join(REWARD_FUNCTIONS)}, or MODULE:FUNCTION of a trainer's "
                    "--reward-module",
                )
            )
        elif name in seen:
            out.append(FieldViolation(f"{p}.reward_functions[{i}]", f"{name!r} is listed twice"))
        seen.add(name)
    weights = task.reward_weights
    if not weights:
        return
    functions = len(task.reward_functions) or len(DEFAULT_REWARD_FUNCTIONS)
    if len(weights) != functions:
        named = (
            f"{functions} reward functions"
            if task.reward_functions
            else f"the {functions} default reward functions ({', '.join(DEFAULT_REWARD_FUNCTIONS)})"
        )
        out.append(
            FieldViolation(
                f"{p}.reward_weights",
                f"{len(weights)} weights for {named}; give one per function, or none (all 1)",
            )
        )
    bad = [i for i, weight in enumerate(weights) if not math.isfinite(weight)]
    if bad:
        out.append(
            FieldViolation(
                f"{p}.reward_weights", f"weight {bad[0]} is {weights[bad[0]]}; need finite values"
            )
        )


def _check_columns(columns: episode_pb2.DatasetColumns, p: str, out: list[FieldViolation]) -> None:
    """Column names without control characters, at most :data:`MAX_COLUMN_LENGTH` long, a
    different one for each role. Whether the dataset has them the trainer says when it opens
    it."""
    seen: dict[str, str] = {}
    for role in ("prompt", "images", "solution"):
        name = getattr(columns, role)
        if not name:
            continue
        field = f"{p}.{role}"
        if len(name) > MAX_COLUMN_LENGTH or not name.isprintable() or not name.strip():
            out.append(
                FieldViolation(
                    field,
                    f"{name[:64]!r}; need a column name of printable characters, at most "
                    f"{MAX_COLUMN_LENGTH} long (empty: the default)",
                )
            )
        elif name in seen:
            out.append(FieldViolation(field, f"{name!r} is also columns.{seen[name]}"))
        seen.setdefault(name, role)


def _check_grpo(task: episode_pb2.GrpoTask, p: str, out: list[FieldViolation]) -> None:
    _check_data_path(task.model_path, f"{p}.model_path", out)
    _check_data_path(task.dataset_path, f"{p}.dataset_path", out)
    if task.HasField("lora"):
        _check_lora(task.lora, f"{p}.lora", out)
    _check_rewards(task, p, out)
    if task.HasField("columns"):
        _check_columns(task.columns, f"{p}.columns", out)
    _check_range(task.num_generations, 2, 64, f"{p}.num_generations", out)
    _check_range(task.batch_size, 1, 1024, f"{p}.batch_size", out)
    generations = task.num_generations or DEFAULT_GRPO_GENERATIONS
    if 2 <= generations <= 64 and task.batch_size > 0 and task.batch_size % generations:
        out.append(
            FieldViolation(
                f"{p}.batch_size",
                f"{task.batch_size} is not a multiple of num_generations {generations}",
            )
        )
    _check_range(task.max_completion_length, 1, 4096, f"{p}.max_completion_length", out)
    if _bad_ratio(task.learning_rate):
        out.append(
            FieldViolation(f"{p}.learning_rate", f"{task.learning_rate}; need (0, 1] (0 = default)")
        )
    if task.HasField("beta") and not (math.isfinite(task.beta) and task.beta >= 0):
        out.append(FieldViolation(f"{p}.beta", f"{task.beta}; need a finite value >= 0"))
    if task.temperature != 0 and not (
        math.isfinite(task.temperature) and 0 < task.temperature <= 10
    ):
        out.append(
            FieldViolation(f"{p}.temperature", f"{task.temperature}; need (0, 10] (0 = default)")
        )
    _check_range(task.gradient_accumulation_steps, 1, 1024, f"{p}.gradient_accumulation_steps", out)
    _check_range(task.num_processes, 1, MAX_GRPO_PROCESSES, f"{p}.num_processes", out)
    if task.HasField("dataloader_num_workers"):
        _check_range(
            task.dataloader_num_workers, 0, 32, f"{p}.dataloader_num_workers", out, zero_ok=False
        )
    if task.HasField("dataloader_prefetch_factor"):
        _check_range(
            task.dataloader_prefetch_factor,
            1,
            64,
            f"{p}.dataloader_prefetch_factor",
            out,
            zero_ok=False,
        )
        if task.HasField("dataloader_num_workers") and task.dataloader_num_workers == 0:
            out.append(
                FieldViolation(
                    f"{p}.dataloader_prefetch_factor",
                    "must be unset when dataloader_num_workers is 0",
                )
            )


def check_task(
    task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig, prefix: str = ""
) -> list[FieldViolation]:
    """Validates a task and its config; returns every violation (empty when valid).

    Args:
        task: The training task.
        config: The run's config.
        prefix: Prepended to the field paths (``"run."`` gives ``run.task.grpo.beta``).
    """
    out: list[FieldViolation] = []
    kind = task_kind(task)
    if kind == "imitation":
        _check_imitation(task.imitation, f"{prefix}task.imitation", out)
    elif kind == "grpo":
        _check_grpo(task.grpo, f"{prefix}task.grpo", out)
    else:
        out.append(FieldViolation(f"{prefix}task", "required: set task.imitation or task.grpo"))
    if not 1 <= config.max_episodes <= MAX_EPISODES:
        out.append(
            FieldViolation(
                f"{prefix}config.max_episodes",
                f"{config.max_episodes}; need 1..{MAX_EPISODES}",
            )
        )
    if config.checkpoint_every < 0 or (config.checkpoint_every > config.max_episodes >= 1):
        out.append(
            FieldViolation(
                f"{prefix}config.checkpoint_every",
                f"{config.checkpoint_every}; need 0 (the provider's default) or "
                f"1..max_episodes ({config.max_episodes})",
            )
        )
    if not 0 <= config.keep_checkpoints <= MAX_KEEP_CHECKPOINTS:
        out.append(
            FieldViolation(
                f"{prefix}config.keep_checkpoints",
                f"{config.keep_checkpoints}; need 0 (the default, 3) or 1..{MAX_KEEP_CHECKPOINTS}",
            )
        )
    return out


def check_train_request(req: trainer_service_pb2.TrainRequest) -> list[FieldViolation]:
    """Validates a ``TrainRequest``: run_id, task and config; returns every violation."""
    out = check_run_id(req.run_id)
    out.extend(check_task(req.task, req.config))
    return out


def check_episode_rate(rate: float, field: str = "episodes_per_second") -> list[FieldViolation]:
    """A publication rate: 0 (the default), negative (unpaced) or 0.01..10000 episodes/s."""
    if rate == 0 or (rate < 0 and math.isfinite(rate)):
        return []
    if math.isfinite(rate) and MIN_EPISODE_RATE <= rate <= MAX_EPISODE_RATE:
        return []
    return [
        FieldViolation(
            field,
            f"{rate}; need {MIN_EPISODE_RATE:g}..{MAX_EPISODE_RATE:g} episodes per second "
            "(0 = the gateway's default, negative = unpaced)",
        )
    ]


#: The most labels a run may have.
MAX_LABELS = 64
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(
    r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)


def _label_key_problem(key: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix)):
        return "its prefix must be a DNS subdomain (lowercase, at most 253 characters)"
    if not _LABEL_NAME.fullmatch(name):
        return (
            "its name must be 1-63 of A-Z a-z 0-9 _ . -, starting and ending with a letter or digit"
        )
    return ""


def check_labels(labels: Mapping[str, str], field: str = "labels") -> list[FieldViolation]:
    """Validates labels as Kubernetes does (see ``Run.labels``); every violation names the
    key (``labels[key]``)."""
    out: list[FieldViolation] = []
    if len(labels) > MAX_LABELS:
        out.append(FieldViolation(field, f"{len(labels)} labels; at most {MAX_LABELS}"))
    for key in sorted(labels):
        shown = key if key.isprintable() and len(key) <= 80 else repr(key[:80])
        problem = _label_key_problem(key)
        if problem:
            out.append(FieldViolation(f"{field}[{shown}]", f"bad key {shown!r}: {problem}"))
            continue
        value = labels[key]
        if value and not _LABEL_NAME.fullmatch(value):
            out.append(
                FieldViolation(
                    f"{field}[{shown}]",
                    f"bad value {value[:80]!r}: at most 63 of A-Z a-z 0-9 _ . -, starting and "
                    "ending with a letter or digit (or empty)",
                )
            )
    return out


def check_display_name(name: str, field: str = "display_name") -> list[FieldViolation]:
    """Validates a display name (at most ``MAX_DISPLAY_NAME_LENGTH`` printable characters)."""
    if len(name) > MAX_DISPLAY_NAME_LENGTH:
        return [FieldViolation(field, f"{len(name)} characters; at most {MAX_DISPLAY_NAME_LENGTH}")]
    if not name.isprintable():
        return [FieldViolation(field, "contains control characters (newlines, escapes)")]
    return []


def check_create_run(req: gateway_service_pb2.CreateRunRequest) -> list[FieldViolation]:
    """Validates a ``CreateRunRequest``; returns every violation (empty when valid)."""
    out = check_task(req.task, req.config)
    if not math.isfinite(req.speed):
        out.append(
            FieldViolation(
                "speed", f"{req.speed}; need a finite value (clamped to 0.1..20; 0 = 1.0)"
            )
        )
    out.extend(check_episode_rate(req.episodes_per_second))
    if len(req.request_id) > MAX_ID_LENGTH:
        out.append(
            FieldViolation(
                "request_id", f"{len(req.request_id)} characters; at most {MAX_ID_LENGTH}"
            )
        )
    elif not req.request_id.isprintable():
        out.append(FieldViolation("request_id", "contains control characters"))
    out.extend(check_display_name(req.display_name))
    out.extend(check_labels(req.labels))
    if req.HasField("fork_from"):
        out.extend(check_run_id(req.fork_from.run_id, "fork_from.run_id"))
        if req.fork_from.episode < 0:
            out.append(
                FieldViolation(
                    "fork_from.episode", f"{req.fork_from.episode}; need >= 0 (0: the latest)"
                )
            )
    return out


#: The hyperparameters a live run of each task kind can change (``SetRunHyperparameters``).
LIVE_HYPERPARAMETERS: Mapping[str, tuple[str, ...]] = {
    "imitation": ("learning_rate",),
    "grpo": ("learning_rate", "temperature", "beta"),
}


#: Each live hyperparameter's range from 0: (whether 0 is allowed, the largest value).
_HYPERPARAMETER_RANGES: Mapping[str, tuple[bool, float]] = {
    "learning_rate": (False, 1.0),
    "temperature": (False, 10.0),
    "beta": (True, 10.0),
}


def check_hyperparameters(
    kind: str,
    learning_rate: float | None = None,
    temperature: float | None = None,
    beta: float | None = None,
    reference_model: bool = True,
) -> list[FieldViolation]:
    """Validates a change of a live run's hyperparameters (``None``: left as it is): at least
    one set, each finite and in its range (learning_rate (0, 1], temperature (0, 10], beta
    [0, 10]), and each one a run of ``kind`` has (any kind when ``kind`` is ""). Without a
    ``reference_model`` (a grpo job started with beta 0 builds none) beta must stay 0."""
    values = {"learning_rate": learning_rate, "temperature": temperature, "beta": beta}
    given = {name: value for name, value in values.items() if value is not None}
    if not given:
        return [FieldViolation("(request)", "set at least one of learning_rate, temperature, beta")]
    out: list[FieldViolation] = []
    allowed = LIVE_HYPERPARAMETERS.get(kind)
    for name, value in given.items():
        if allowed is not None and name not in allowed:
            out.append(
                FieldViolation(name, f"{kind} runs have no {name}; they have {', '.join(allowed)}")
            )
            continue
        low_inclusive, high = _HYPERPARAMETER_RANGES[name]
        low_ok = value >= 0 if low_inclusive else value > 0
        if not (math.isfinite(value) and low_ok and value <= high):
            shown = f"{'[' if low_inclusive else '('}0, {high:g}]"
            out.append(FieldViolation(name, f"{value}; need a finite value in {shown}"))
        elif name == "beta" and value > 0 and not reference_model:
            out.append(
                FieldViolation(
                    "beta",
                    f"{value}; this job started with beta 0 and has no reference model to "
                    "measure the KL divergence against, so beta stays 0 (fork the run with "
                    "beta > 0 instead)",
                )
            )
    return out


def bad_request(violations: Sequence[FieldViolation]) -> error_details_pb2.BadRequest:
    """Packs field violations into a ``google.rpc.BadRequest`` for status details."""
    return error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in violations
        ]
    )


def describe_violations(violations: Sequence[FieldViolation]) -> str:
    """One line listing every violation, for a status message."""
    return "; ".join(f"{v.field}: {v.description}" for v in violations)
