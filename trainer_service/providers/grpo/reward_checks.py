"""Reward functions called as a job needs them: a failure names the function and the step.

:func:`checked` wraps a reward function (sync or ``async``) so that an exception it raises, or
an answer that is not one number (or ``None``) per completion, fails the job with a
:class:`RewardFailed` whose message a user can act on ("Reward function mymod:score failed at
step 12: ValueError: ..."); the traceback goes to the log only. The step is the optimizer step
being trained, read from the ``trainer_state`` TRL passes to every reward function.

This module imports no torch.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer_service.core.provider import ProviderError

RewardFunction = Callable[..., Any]


class RewardFailed(ProviderError):
    """A reward function raised or answered something unusable.

    Attributes:
        function: The reward's name.
        step: The optimizer step it scored for (1-based).
    """

    def __init__(self, function: str, step: int, problem: str, detail: str = "") -> None:
        super().__init__(
            f"Reward function {function} failed at step {step}: {problem}",
            detail=detail,
            reason="REWARD_FAILED",
        )
        self.function = function
        self.step = step


def step_of(kwargs: Mapping[str, Any]) -> int:
    """The optimizer step a reward call scores for: the trainer state's steps done, plus one."""
    done = getattr(kwargs.get("trainer_state"), "global_step", 0)
    return int(done) + 1 if isinstance(done, int) else 1


def problem_with(rewards: Any, count: int) -> str:
    """What is wrong with a reward function's answer for ``count`` completions ("": nothing)."""
    if isinstance(rewards, str | bytes | Mapping) or not isinstance(rewards, Sequence):
        shape = getattr(rewards, "shape", None)
        if shape is None or len(shape) != 1:  # a 1-d array passes as a sequence below
            return f"it returned {type(rewards).__name__}, not a list of numbers"
    if len(rewards) != count:
        return f"it returned {len(rewards)} rewards for {count} completions"
    for position, value in enumerate(rewards, 1):
        if value is None:
            continue
        if isinstance(value, str | bytes):
            return f"reward {position} is {value!r}, not a number or None"
        try:
            number = float(value)
        except (TypeError, ValueError):
            return f"reward {position} is a {type(value).__name__}, not a number or None"
        if not math.isfinite(number):
            return f"reward {position} is {number}, not a finite number or None"
    return ""


def checked(function: RewardFunction, name: str) -> RewardFunction:
    """``function`` named ``name`` (TRL logs ``rewards/<name>/mean``), raising
    :class:`RewardFailed` when it fails (see the module docstring)."""

    def check(completions: Sequence[Any], kwargs: Mapping[str, Any], rewards: Any) -> Any:
        problem = problem_with(rewards, len(completions))
        if problem:
            raise RewardFailed(name, step_of(kwargs), problem, detail=f"answer: {rewards!r:.500}")
        return rewards

    def failed(kwargs: Mapping[str, Any], exc: Exception) -> RewardFailed:
        return RewardFailed(
            name, step_of(kwargs), f"{type(exc).__name__}: {exc}", detail=f"{exc!r}"
        )

    wrapper: Any
    if inspect.iscoroutinefunction(function):

        async def wrapper(completions: Sequence[Any], **kwargs: Any) -> Any:
            try:
                rewards = await function(completions=completions, **kwargs)
            except ProviderError:
                raise
            except Exception as exc:
                raise failed(kwargs, exc) from exc
            return check(completions, kwargs, rewards)

    else:

        def wrapper(completions: Sequence[Any], **kwargs: Any) -> Any:
            try:
                rewards = function(completions=completions, **kwargs)
            except ProviderError:
                raise
            except Exception as exc:
                raise failed(kwargs, exc) from exc
            return check(completions, kwargs, rewards)

    wrapper.__name__ = name
    wrapper.__qualname__ = name
    return wrapper  # type: ignore[no-any-return]
