"""Request-time checks of a GRPO task against the trainer's data roots (no torch, no file reads).

:func:`validate` runs before a slot is taken; every violation answers ``INVALID_ARGUMENT`` with a
``google.rpc.BadRequest``. A trainer has one or more data roots (``--data-root``, repeatable):
a relative ``model_path`` or ``dataset_path`` resolves against the first, an absolute one must
lie inside one of them (datasets on shared filesystems are roots of their own). It rejects what
can be decided from the request and the file tree's shape: ``..`` components, absolute paths
outside every root and symlinks that resolve outside every root, files inside the model
directory that are symlinks to outside every root (a model directory inside a root could
otherwise load weights from anywhere), and reward function names that are repeated or that this
trainer does not offer (built-in ones, and ``MODULE:FUNCTION`` of its ``--reward-module``s). A path
that simply does not exist is not a request error: the job fails with a ``ProviderError`` and a
plain message when it tries to load it (the file may be synced in later).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from trainer_service.providers.grpo.reward_modules import RewardModuleError, load_reward_modules
from trainer_service.providers.grpo.rewards import REWARD_NAMES
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2

_PREFIX = "task.grpo"


def within_roots(target: pathlib.Path, roots: Sequence[pathlib.Path]) -> bool:
    """Whether ``target`` (resolved) is one of ``roots`` (resolved) or below one."""
    return any(target == root or root in target.parents for root in roots)


def resolve_in_roots(data_roots: Sequence[pathlib.Path], path: str) -> pathlib.Path | None:
    """Resolves a request path against the data roots; ``None`` when it leads outside them all.

    A relative path resolves against the first root; an absolute one must lie inside one of
    them. ``..`` components are refused wherever they lead, and symlinks (anywhere on the path)
    are followed before the check. The target need not exist.
    """
    if not path or "\x00" in path or not data_roots:
        return None
    if pathlib.PureWindowsPath(path).is_absolute():  # a drive or a share: no root holds it
        return None
    pure = pathlib.PurePosixPath(path.replace("\\", "/"))
    if ".." in pure.parts:
        return None
    roots = [root.resolve() for root in data_roots]
    target = (roots[0] / pure).resolve()  # an absolute ``pure`` replaces the first root
    return target if within_roots(target, roots) else None


def _check_path(
    value: str, field: str, data_roots: Sequence[pathlib.Path], out: list[FieldViolation]
) -> None:
    if not value:
        out.append(
            FieldViolation(
                field,
                "required: a path relative to the trainer's (first) data root, or an absolute "
                "path inside one of its data roots",
            )
        )
        return
    if resolve_in_roots(data_roots, value) is None:
        out.append(
            FieldViolation(
                field,
                f"{value!r} leads outside the trainer's data root ('..', an absolute path "
                "outside every data root, or a symlink pointing elsewhere); give a path "
                "relative to the (first) data root, or an absolute path inside a data root",
            )
        )


def _check_model_files(
    value: str, field: str, data_roots: Sequence[pathlib.Path], out: list[FieldViolation]
) -> None:
    """Every entry in the model directory must resolve inside a data root too."""
    directory = resolve_in_roots(data_roots, value)
    if directory is None or not directory.is_dir():
        return  # refused above, or missing: the job says so when it loads it
    roots = [root.resolve() for root in data_roots]
    for folder, folders, files in os.walk(directory):
        for name in [*folders, *files]:
            entry = pathlib.Path(folder) / name
            if not entry.is_symlink():
                continue
            if not within_roots(entry.resolve(), roots):
                relative = entry.relative_to(directory)
                out.append(
                    FieldViolation(
                        field,
                        f"{value}/{relative} is a symlink to outside the trainer's data root; "
                        "a model's files must stay under a data root",
                    )
                )
                return


def reward_functions(reward_modules: Sequence[str] = ()) -> tuple[str, ...]:
    """Every reward name a task may use on a trainer with these ``--reward-module`` specs: the
    built-in ones, then each module's ``MODULE:FUNCTION`` (a module that does not import adds
    none; the trainer refuses to start with one)."""
    try:
        custom = load_reward_modules(reward_modules)
    except RewardModuleError:
        custom = {}
    return (*REWARD_NAMES, *custom)


def validate(
    task: episode_pb2.TrainTask,
    data_roots: Sequence[pathlib.Path],
    reward_modules: Sequence[str] = (),
) -> list[FieldViolation]:
    """Checks a GRPO task's paths and reward names; returns every violation (empty: valid).

    Args:
        task: The request's task (``task.grpo`` set).
        data_roots: The trainer's data roots (``--data-root``), the first one first.
        reward_modules: The trainer's ``--reward-module`` specs.
    """
    out: list[FieldViolation] = []
    if task.WhichOneof("kind") != "grpo":
        out.append(FieldViolation(_PREFIX, "required: the grpo provider needs task.grpo"))
        return out
    grpo = task.grpo
    _check_path(grpo.model_path, f"{_PREFIX}.model_path", data_roots, out)
    _check_model_files(grpo.model_path, f"{_PREFIX}.model_path", data_roots, out)
    _check_path(grpo.dataset_path, f"{_PREFIX}.dataset_path", data_roots, out)
    seen: set[str] = set()
    offered = reward_functions(reward_modules) if grpo.reward_functions else REWARD_NAMES
    for index, name in enumerate(grpo.reward_functions):
        field = f"{_PREFIX}.reward_functions[{index}]"
        if name not in offered:
            out.append(
                FieldViolation(
                    field,
                    f"unknown reward function {name!r}; this trainer offers: {', '.join(offered)}",
                )
            )
        elif name in seen:
            out.append(FieldViolation(field, f"{name!r} is listed twice"))
        seen.add(name)
    return out
