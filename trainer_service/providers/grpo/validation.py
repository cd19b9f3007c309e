"""Request-time checks of a GRPO task against the trainer's data root (no torch, no file reads).

:func:`validate` runs before a slot is taken; every violation answers ``INVALID_ARGUMENT`` with a
``google.rpc.BadRequest``. It rejects what can be decided from the request and the file tree's
shape: absolute paths, ``..`` components and symlinks that resolve outside ``--data-root`` for
``model_path`` and ``dataset_path``, files inside the model directory that are symlinks to
outside the root (a model directory inside the root could otherwise load weights from anywhere),
and unknown or repeated reward function names. A path that
simply does not exist is not a request error: the job fails with a ``ProviderError`` and a plain
message when it tries to load it (the file may be synced in later).
"""

from __future__ import annotations

import os
import pathlib

from trainer_service.providers.grpo.rewards import REWARD_NAMES
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2

_PREFIX = "task.grpo"


def resolve_under_root(data_root: pathlib.Path, relative: str) -> pathlib.Path | None:
    """Resolves a request path under ``data_root``; ``None`` when it escapes the root.

    Absolute paths, ``..`` components and symlinks (anywhere on the path) resolving outside
    the root all escape. The target need not exist.
    """
    if not relative or "\x00" in relative:
        return None
    posix = relative.replace("\\", "/")
    pure = pathlib.PurePosixPath(posix)
    if pure.is_absolute() or pathlib.PureWindowsPath(relative).is_absolute():
        return None
    if ".." in pure.parts:
        return None
    root = data_root.resolve()
    target = (root / pure).resolve()
    if target != root and root not in target.parents:
        return None
    return target


def _check_path(value: str, field: str, data_root: pathlib.Path, out: list[FieldViolation]) -> None:
    if not value:
        out.append(FieldViolation(field, "required: a path relative to the trainer's data root"))
        return
    if resolve_under_root(data_root, value) is None:
        out.append(
            FieldViolation(
                field,
                f"{value!r} leads outside the trainer's data root (absolute path, '..' or a "
                "symlink pointing elsewhere); give a path under the data root",
            )
        )


def _check_model_files(
    value: str, field: str, data_root: pathlib.Path, out: list[FieldViolation]
) -> None:
    """Every entry in the model directory must resolve under the root too."""
    directory = resolve_under_root(data_root, value)
    if directory is None or not directory.is_dir():
        return  # refused above, or missing: the job says so when it loads it
    root = data_root.resolve()
    for folder, folders, files in os.walk(directory):
        for name in [*folders, *files]:
            entry = pathlib.Path(folder) / name
            if not entry.is_symlink():
                continue
            target = entry.resolve()
            if target != root and root not in target.parents:
                relative = entry.relative_to(directory)
                out.append(
                    FieldViolation(
                        field,
                        f"{value}/{relative} is a symlink to outside the trainer's data root; "
                        "a model's files must stay under the data root",
                    )
                )
                return


def validate(task: episode_pb2.TrainTask, data_root: pathlib.Path) -> list[FieldViolation]:
    """Checks a GRPO task's paths and reward names; returns every violation (empty: valid).

    Args:
        task: The request's task (``task.grpo`` set).
        data_root: The trainer's ``--data-root``.
    """
    out: list[FieldViolation] = []
    if task.WhichOneof("kind") != "grpo":
        out.append(FieldViolation(_PREFIX, "required: the grpo provider needs task.grpo"))
        return out
    grpo = task.grpo
    _check_path(grpo.model_path, f"{_PREFIX}.model_path", data_root, out)
    _check_model_files(grpo.model_path, f"{_PREFIX}.model_path", data_root, out)
    _check_path(grpo.dataset_path, f"{_PREFIX}.dataset_path", data_root, out)
    seen: set[str] = set()
    for index, name in enumerate(grpo.reward_functions):
        field = f"{_PREFIX}.reward_functions[{index}]"
        if name not in REWARD_NAMES:
            out.append(
                FieldViolation(
                    field, f"unknown reward function {name!r}; built-in: {', '.join(REWARD_NAMES)}"
                )
            )
        elif name in seen:
            out.append(FieldViolation(field, f"{name!r} is listed twice"))
        seen.add(name)
    return out
