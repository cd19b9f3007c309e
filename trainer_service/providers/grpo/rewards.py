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

This module imports no torch: it is plain Python over strings and token-id lists.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

#: Built-in reward function names (mirrors ``trainwire.contract.REWARD_FUNCTIONS``).
REWARD_NAMES: tuple[str, ...] = ("exact_match", "format", "length")
#: Used when a task names no reward function.
DEFAULT_REWARDS: tuple[str, ...] = ("exact_match", "format")

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


class CompletionTap:
    """Keeps the completions of the latest scored generation batch (thread-safe).

    The provider wraps the first reward function so that every scored batch passes through the
    tap; the streaming callback reads :meth:`latest` when it builds an episode.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: list[str] = []
        self._batches = 0

    def record(self, completions: Sequence[Any]) -> None:
        """Stores the texts of a scored batch."""
        texts = [completion_text(c) for c in completions]
        with self._lock:
            self._texts = texts
            self._batches += 1

    def latest(self) -> tuple[int, list[str]]:
        """(number of batches recorded so far, texts of the latest one)."""
        with self._lock:
            return self._batches, list(self._texts)


def _tapped(func: RewardFunction, tap: CompletionTap) -> RewardFunction:
    def wrapper(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        tap.record(completions)
        return func(completions=completions, **kwargs)

    # TRL names the logged metric (rewards/<name>/mean) after __name__.
    wrapper.__name__ = func.__name__
    return wrapper


def unknown_rewards(names: Sequence[str]) -> list[str]:
    """The names in ``names`` that are not built-in reward functions."""
    return [name for name in names if name not in REWARD_NAMES]


def build_reward_functions(
    names: Sequence[str], max_completion_length: int, tap: CompletionTap | None = None
) -> list[RewardFunction]:
    """The reward callables for ``names`` (empty: the defaults), the first one tapped.

    Raises:
        ValueError: An unknown name (validation rejects those before a job starts).
    """
    chosen = list(names) or list(DEFAULT_REWARDS)
    unknown = unknown_rewards(chosen)
    if unknown:
        raise ValueError(f"unknown reward functions: {', '.join(unknown)}")
    table: dict[str, RewardFunction] = {
        "exact_match": exact_match,
        "format": format_reward,
        "length": make_length_reward(max_completion_length),
    }
    functions = [table[name] for name in chosen]
    if tap is not None:
        functions[0] = _tapped(functions[0], tap)
    return functions
