"""The GRPO provider's built-in reward functions, by name, and the completion tap.

Reward functions follow TRL's calling convention: keyword arguments ``prompts``, ``completions``
(conversational: a list of assistant messages per completion), ``completion_ids`` and every extra
dataset column (``solution``, ...) as a list with one entry per completion; they return one float
per completion (``None`` = not scorable).

- ``exact_match``: 1.0 when the completion's answer equals the row's ``solution``, else 0.0;
  ``None`` for rows without a solution. The answer is the text of the first
  ``<answer>...</answer>`` when there is one, else the whole completion; both sides are compared
  case-insensitively with surrounding whitespace and punctuation stripped and inner whitespace
  collapsed. Equality, not containment: a completion that lists every candidate ("red green
  blue") must not score, or GRPO learns to list instead of to look.
- ``format``: 1.0 when the completion holds ``<answer>...</answer>``, else 0.0.
- ``length``: 0.0 up to 80 % of ``max_completion_length`` tokens, then falling linearly to -1.0
  at the limit (a completion that hits the limit was cut off).

The completion tap (:class:`CompletionTap`) wraps every reward function of a trainer and keeps
the latest scored batch: prompts, completions, the rows' images and solutions, and each
function's rewards, for the episodes' samples.

This module imports no torch: it is plain Python over strings and token-id lists.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from trainer_service.providers.defaults import GRPO
from trainer_service.providers.grpo.reward_checks import checked

#: Built-in reward function names (mirrors ``trainwire.contract.REWARD_FUNCTIONS``).
REWARD_NAMES: tuple[str, ...] = ("exact_match", "format", "length")
#: Used when a task names no reward function.
DEFAULT_REWARDS: tuple[str, ...] = GRPO.reward_functions

_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_ANSWER_BODY = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EDGE = " \t\r\n.,;:!?\"'`"
_LENGTH_FREE_FRACTION = 0.8

RewardFunction = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the concatenated content of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            content = message.get("content") if isinstance(message, dict) else message
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, Sequence):
                parts.extend(
                    str(part.get("text", "")) for part in content if isinstance(part, dict)
                )
        return "".join(parts)
    return str(completion)


def normalize_answer(text: str) -> str:
    """``text`` lower-cased, inner whitespace collapsed, edge whitespace/punctuation stripped."""
    return " ".join(text.lower().split()).strip(_EDGE)


def extract_answer(text: str) -> str:
    """The completion's answer: the first ``<answer>...</answer>`` body, else the whole text."""
    tagged = _ANSWER_BODY.search(text)
    return normalize_answer(tagged.group(1) if tagged else text)


def exact_match(
    completions: Sequence[Any], solution: Sequence[Any] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when the completion's answer equals the row's ``solution`` (see the module docstring).

    Returns:
        One reward per completion; ``None`` for rows without a (non-blank) solution.
    """
    solutions = list(solution) if solution is not None else [None] * len(completions)
    rewards: list[float | None] = []
    for completion, expected in zip(completions, solutions, strict=True):
        wanted = normalize_answer(str(expected)) if expected is not None else ""
        if not wanted:
            rewards.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        rewards.append(1.0 if answer == wanted else 0.0)
    return rewards


def format_reward(completions: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 when the completion holds ``<answer>...</answer>``, else 0.0."""
    return [1.0 if _ANSWER.search(completion_text(c)) else 0.0 for c in completions]


format_reward.__name__ = "format"


def make_length_reward(max_completion_length: int) -> RewardFunction:
    """The ``length`` reward for a given token limit (see the module docstring)."""
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    free = _LENGTH_FREE_FRACTION * max_completion_length
    span = max(max_completion_length - free, 1e-9)

    def length(
        completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None, **_: Any
    ) -> list[float | None]:
        if completion_ids is None:
            sizes = [len(completion_text(c).encode("utf-8")) for c in completions]
        else:
            sizes = [len(ids) for ids in completion_ids]
        return [-min(1.0, max(0.0, (size - free) / span)) for size in sizes]

    return length


@dataclass(frozen=True)
class ScoredBatch:
    """One scored generation batch as the reward functions saw it: entry ``i`` of every list is
    completion ``i``.

    Attributes:
        number: Batches recorded before this one, plus one.
        prompts: The prompts (chat messages or strings).
        completions: The completions (chat messages or strings).
        columns: The dataset columns TRL passed along (``solution``, ``image``, ``images``...).
        names: The reward functions' names, in the trainer's order.
        rewards: Each function's rewards, aligned with ``names`` (``None``: not scorable).
        weights: The functions' weights, aligned with ``names``.
    """

    number: int
    prompts: Sequence[Any]
    completions: Sequence[Any]
    columns: Mapping[str, Sequence[Any]]
    names: tuple[str, ...]
    rewards: tuple[tuple[float | None, ...], ...]
    weights: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.completions)

    def completion(self, i: int) -> str:
        """Completion ``i``'s text."""
        return completion_text(self.completions[i])

    def prompt(self, i: int) -> str:
        """The text of completion ``i``'s prompt: the text parts of its user messages, joined
        by new lines (a plain-string prompt as it is)."""
        prompt = self.prompts[i] if i < len(self.prompts) else ""
        if isinstance(prompt, str):
            return prompt
        texts = []
        if isinstance(prompt, Sequence):
            for message in prompt:
                if isinstance(message, dict) and message.get("role", "user") == "user":
                    text = completion_text([message])
                    if text:
                        texts.append(text)
        return "\n".join(texts)

    def solution(self, i: int) -> str:
        """Completion ``i``'s row's ``solution`` (``""``: none)."""
        values = self.columns.get("solution")
        value = values[i] if values is not None and i < len(values) else None
        return "" if value is None else str(value)

    def image(self, i: int) -> Any:
        """Completion ``i``'s row's first image (``image``, else the first of ``images``), or
        ``None``."""
        for key in ("image", "images"):
            values = self.columns.get(key)
            if values is None or i >= len(values):
                continue
            value = values[i]
            if key == "images" and isinstance(value, Sequence) and not isinstance(value, str):
                value = value[0] if value else None
            if value is not None:
                return value
        return None

    def function_rewards(self, i: int) -> dict[str, float]:
        """Completion ``i``'s reward by function; a function that returned None is absent."""
        out: dict[str, float] = {}
        for name, rewards in zip(self.names, self.rewards, strict=True):
            value = rewards[i]
            if value is not None:
                out[name] = value
        return out

    def reward(self, i: int) -> float:
        """Completion ``i``'s total reward as TRL adds it up: the weighted sum of its rewards,
        a function that returned None counting 0."""
        values = (rewards[i] for rewards in self.rewards)
        return math.fsum(
            weight * value
            for weight, value in zip(self.weights, values, strict=True)
            if value is not None
        )


class CompletionTap:
    """Records each scored generation batch, for the episodes to show what the model saw
    (thread-safe).

    :meth:`wrap` wraps every reward function of a trainer; each wrapper hands the tap its
    function's rewards along with the batch it scored (TRL calls every function on the same
    ``completions`` list). Once every function has scored a batch it becomes :meth:`latest`.
    The weights default to 1 each until :meth:`set_weights` gives the trainer's own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: tuple[str, ...] = ()
        self._weights: tuple[float, ...] = ()
        self._pending: _PendingBatch | None = None
        self._latest: ScoredBatch | None = None
        self._batches = 0

    def wrap(
        self, functions: Sequence[Callable[..., Any]], names: Sequence[str]
    ) -> list[RewardFunction]:
        """``functions`` (named ``names``; sync or async), each tapped, all weighing 1."""
        if len(functions) != len(names):
            raise ValueError(f"{len(functions)} reward functions but {len(names)} names")
        with self._lock:
            self._names = tuple(names)
            self._weights = (1.0,) * len(names)
            self._pending = None
        return [_tapped(function, self, i) for i, function in enumerate(functions)]

    def set_weights(self, weights: Sequence[float]) -> None:
        """The trainer's reward weights, aligned with the wrapped functions."""
        if len(weights) != len(self._names):
            raise ValueError(f"{len(weights)} weights for {len(self._names)} reward functions")
        with self._lock:
            self._weights = tuple(float(w) for w in weights)

    def record(
        self,
        index: int,
        completions: Sequence[Any],
        rewards: Any,
        prompts: Sequence[Any] | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> None:
        """Function ``index``'s rewards for a batch. Never raises: a malformed answer is
        recorded as unscorable, and the trainer reports it."""
        values = _reward_values(rewards, len(completions))
        kept = {
            key: value
            for key, value in (columns or {}).items()
            if key in _KEPT_COLUMNS and isinstance(value, Sequence)
        }
        with self._lock:
            count = len(self._names)
            if not 0 <= index < count:
                return
            pending = self._pending
            if pending is None or pending.completions is not completions:
                pending = self._pending = _PendingBatch(
                    completions, prompts or [], kept, [None] * count
                )
            pending.rewards[index] = values
            if any(r is None for r in pending.rewards):
                return
            self._batches += 1
            self._pending = None
            self._latest = ScoredBatch(
                number=self._batches,
                prompts=pending.prompts,
                completions=pending.completions,
                columns=pending.columns,
                names=self._names,
                rewards=tuple(r for r in pending.rewards if r is not None),
                weights=self._weights,
            )

    def latest(self) -> ScoredBatch | None:
        """The latest batch every function scored (None before the first)."""
        with self._lock:
            return self._latest


#: The dataset columns a batch keeps for its samples.
_KEPT_COLUMNS = frozenset({"solution", "image", "images"})


@dataclass
class _PendingBatch:
    """A batch some of the functions have scored."""

    completions: Sequence[Any]
    prompts: Sequence[Any]
    columns: dict[str, Sequence[Any]]
    rewards: list[tuple[float | None, ...] | None]


def _reward_values(rewards: Any, count: int) -> tuple[float | None, ...]:
    """``count`` rewards: the finite numbers of ``rewards``, anything else None."""
    if not isinstance(rewards, Sequence) or isinstance(rewards, str) or len(rewards) != count:
        return (None,) * count
    values: list[float | None] = []
    for value in rewards:
        number = None
        if value is not None and not isinstance(value, bool):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
        # + 0.0: a -0.0 (the length reward's "no penalty") reads as 0.
        values.append(number + 0.0 if number is not None and math.isfinite(number) else None)
    return tuple(values)


def _is_async(func: Any) -> bool:
    """Whether calling ``func`` returns a coroutine (as TRL's ``is_async_callable`` tells)."""
    while isinstance(func, functools.partial):
        func = func.func
    # A callable instance carries its ``async`` on its class's __call__.
    method = None if inspect.isroutine(func) else inspect.getattr_static(func, "__call__", None)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(method)


def _tapped(func: Callable[..., Any], tap: CompletionTap, index: int) -> RewardFunction:
    """``func``, handing its rewards to ``tap`` as function ``index`` (sync or async alike)."""

    def record(completions: Sequence[Any], kwargs: Mapping[str, Any], rewards: Any) -> None:
        tap.record(index, completions, rewards, kwargs.get("prompts"), kwargs)

    wrapper: Any
    if _is_async(func):

        async def wrapper(completions: Sequence[Any], **kwargs: Any) -> Any:
            rewards = await cast(Any, func)(completions=completions, **kwargs)
            record(completions, kwargs, rewards)
            return rewards

    else:

        def wrapper(completions: Sequence[Any], **kwargs: Any) -> Any:
            rewards = func(completions=completions, **kwargs)
            record(completions, kwargs, rewards)
            return rewards

    # TRL names the logged metric (rewards/<name>/mean) after __name__.
    wrapper.__name__ = getattr(func, "__name__", type(func).__name__)
    return cast(RewardFunction, wrapper)


def unknown_rewards(names: Sequence[str], offered: Collection[str] = REWARD_NAMES) -> list[str]:
    """The names in ``names`` that are not in ``offered`` (default: the built-in ones)."""
    return [name for name in names if name not in offered]


def build_reward_functions(
    names: Sequence[str],
    max_completion_length: int,
    tap: CompletionTap | None = None,
    custom: Mapping[str, RewardFunction] | None = None,
) -> list[RewardFunction]:
    """The reward callables for ``names`` (empty: the defaults), each named after its reward
    and checked (:func:`.reward_checks.checked`: a failure names it and the step), every one
    tapped by ``tap``.

    Args:
        names: Reward names: built-in, or ``MODULE:FUNCTION`` of ``custom``.
        max_completion_length: The ``length`` reward's limit.
        tap: Records every scored batch.
        custom: The trainer's reward-module functions by name (:mod:`.reward_modules`).

    Raises:
        ValueError: An unknown name (validation rejects those before a job starts).
    """
    chosen = list(names) or list(DEFAULT_REWARDS)
    table: dict[str, RewardFunction] = {
        "exact_match": exact_match,
        "format": format_reward,
        "length": make_length_reward(max_completion_length),
        **(custom or {}),
    }
    unknown = unknown_rewards(chosen, table)
    if unknown:
        raise ValueError(f"unknown reward functions: {', '.join(unknown)}")
    functions = [checked(table[name], name) for name in chosen]
    if tap is not None:
        functions = tap.wrap(functions, chosen)
    return functions
