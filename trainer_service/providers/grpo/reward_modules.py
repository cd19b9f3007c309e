"""The operator's own reward functions: the modules of the trainer's ``--reward-module`` flag.

A reward module is named by a dotted module name (importable on the trainer's ``sys.path``) or
by a ``.py`` file (its module name is the file's stem; it is imported under that name, which
must not be another module's). Each public function it defines (a callable whose name does not
start with ``_`` and whose ``__module__`` is the module's: imported helpers and classes are
not) is a reward named ``MODULE:FUNCTION``, called as TRL calls reward functions: keyword
arguments ``prompts``, ``completions``, ``completion_ids``, ``trainer_state`` and every other
dataset column, returning one float (or ``None``) per completion; an ``async def`` is awaited.

Only the trainer's command line names reward modules: no request can make a trainer import
code. The trainer imports them when it starts (:func:`load_reward_modules`; a module that does
not import stops it with one line saying why) and sends their specs (:func:`canonical_spec`)
with each GRPO job, whose ranks import them again before building their trainer. Each process
imports a module once (:func:`load_reward_module` remembers it).

This module imports no torch; the reward modules import what they like.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

RewardFunction = Callable[..., Any]

_LOCK = threading.Lock()
_LOADED: dict[str, RewardModule] = {}


class RewardModuleError(ValueError):
    """A reward module that cannot be used; the message is one line naming it."""


@dataclass(frozen=True)
class RewardModule:
    """One imported reward module.

    Attributes:
        spec: Its canonical spec (:func:`canonical_spec`).
        name: Its module name.
        functions: ``MODULE:FUNCTION`` -> the function, in definition order.
    """

    spec: str
    name: str
    functions: Mapping[str, RewardFunction]


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names a ``.py`` file (else a dotted module name)."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def canonical_spec(spec: str) -> str:
    """``spec`` as every process of the trainer reads it alike: a file as its absolute path
    (the ranks may not share the trainer's working directory), a module name as it is."""
    spec = spec.strip()
    if is_file_spec(spec):
        return str(pathlib.Path(spec).expanduser().resolve())
    return spec


def load_reward_module(spec: str) -> RewardModule:
    """Imports the reward module ``spec`` names (once per process) and lists its rewards.

    Raises:
        RewardModuleError: It does not import, its file is missing, its name is another
            module's, or it defines no public function.
    """
    canonical = canonical_spec(spec)
    with _LOCK:
        known = _LOADED.get(canonical)
        if known is None:
            module = _import_file(canonical) if is_file_spec(canonical) else _import(canonical)
            known = _LOADED[canonical] = RewardModule(
                canonical, module.__name__, _public_functions(module, spec)
            )
        return known


def load_reward_modules(specs: Sequence[str]) -> dict[str, RewardFunction]:
    """Every reward of the modules ``specs`` name: ``MODULE:FUNCTION`` -> the function.

    Raises:
        RewardModuleError: A module cannot be used (see :func:`load_reward_module`).
    """
    functions: dict[str, RewardFunction] = {}
    for spec in specs:
        functions.update(load_reward_module(spec).functions)
    return functions


def _import(name: str) -> ModuleType:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise RewardModuleError(
            f"--reward-module {name!r} is neither a module name (a.b.c) nor a .py file"
        )
    try:
        return importlib.import_module(name)
    except Exception as exc:  # the operator's code: anything may go wrong as it imports
        raise RewardModuleError(
            f"--reward-module {name}: cannot import it: {type(exc).__name__}: {exc}"
        ) from exc


def _import_file(path_text: str) -> ModuleType:
    path = pathlib.Path(path_text)
    if path.suffix != ".py" or not path.is_file():
        raise RewardModuleError(f"--reward-module {path}: no such .py file")
    name = path.stem
    if not name.isidentifier():
        raise RewardModuleError(
            f"--reward-module {path}: {name!r} is not a Python module name; rename the file"
        )
    existing = sys.modules.get(name)
    if existing is not None:
        origin = getattr(existing, "__file__", None)
        if origin is not None and pathlib.Path(origin).resolve() == path:
            return existing
        raise RewardModuleError(
            f"--reward-module {path}: the module name {name!r} is another module's "
            f"({origin or 'built in'}); rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardModuleError(f"--reward-module {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: its own code may look itself up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the operator's code: anything may go wrong as it imports
        del sys.modules[name]
        raise RewardModuleError(
            f"--reward-module {path}: cannot import it: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _public_functions(module: ModuleType, spec: str) -> dict[str, RewardFunction]:
    functions: dict[str, RewardFunction] = {}
    for attribute, value in vars(module).items():
        if attribute.startswith("_") or inspect.isclass(value) or not callable(value):
            continue
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported, not defined here
        functions[f"{module.__name__}:{attribute}"] = value
    if not functions:
        raise RewardModuleError(
            f"--reward-module {spec}: defines no public function (a reward is a function "
            "whose name does not start with '_')"
        )
    return functions
