"""Built-in GRPO reward functions and the completion tap."""

from __future__ import annotations

import pytest

from trainer_service.providers.grpo.rewards import (
    DEFAULT_REWARDS,
    REWARD_NAMES,
    CompletionTap,
    build_reward_functions,
    completion_text,
    exact_match,
    format_reward,
    make_length_reward,
)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_names_match_the_contract() -> None:
    from trainwire.contract import REWARD_FUNCTIONS

    assert REWARD_NAMES == REWARD_FUNCTIONS
    assert set(DEFAULT_REWARDS) == {"exact_match", "format"}


def test_completion_text_handles_strings_messages_and_parts() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text(_chat("a") + _chat("b")) == "ab"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}]
    assert completion_text(parts) == "x"


def test_exact_match() -> None:
    completions = [_chat("It is <answer>Red</answer>"), _chat("blue"), _chat("red"), _chat("x")]
    rewards = exact_match(completions, solution=["red", "red", " red ", None], prompts=[])
    assert rewards == [1.0, 0.0, 1.0, None]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("red", 1.0),
        (" Red. ", 1.0),
        ("RED!", 1.0),
        ("<answer> red </answer> because it is", 1.0),
        ("light  Red", 0.0),
        ("red green blue yellow", 0.0),  # listing every candidate must not score
        ("the red", 0.0),
        ("reddish", 0.0),
        ("<answer>blue</answer> red", 0.0),  # the tagged answer is the answer
        ("", 0.0),
    ],
)
def test_exact_match_is_equality_not_containment(completion: str, reward: float) -> None:
    assert exact_match([_chat(completion)], solution=["red"]) == [reward]


def test_exact_match_normalises_multi_word_solutions() -> None:
    got = exact_match([_chat("Light   blue."), _chat("light")], solution=["light blue"] * 2)
    assert got == [1.0, 0.0]
    assert exact_match([_chat("x")], solution=["  "]) == [None]


def test_format() -> None:
    completions = [
        _chat("<answer>a</answer>"),
        _chat("<answer>\nb\n</answer> tail"),
        _chat("<answer>"),
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0]


def test_length_penalises_only_near_the_limit() -> None:
    length = make_length_reward(10)
    rewards = length([_chat("")] * 4, completion_ids=[[1] * 2, [1] * 8, [1] * 9, [1] * 10])
    assert rewards == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert length([_chat("abc")], completion_ids=None) == [0.0]
    with pytest.raises(ValueError):
        make_length_reward(0)


def test_build_names_defaults_and_tap() -> None:
    tap = CompletionTap()
    funcs = build_reward_functions([], 8, tap)
    assert [f.__name__ for f in funcs] == list(DEFAULT_REWARDS)
    funcs = build_reward_functions(["length", "format"], 8, tap)
    assert [f.__name__ for f in funcs] == ["length", "format"]
    assert tap.latest() is None
    completions = [_chat("hello")]
    out = funcs[0](prompts=[[]], completions=completions, completion_ids=[[1, 2]], solution=["s"])
    assert out == [0.0]
    assert tap.latest() is None  # until every function scored the batch
    funcs[1](prompts=[[]], completions=completions)
    batch = tap.latest()
    assert batch is not None and batch.number == 1 and batch.completion(0) == "hello"
    assert batch.function_rewards(0) == {"length": 0.0, "format": 0.0}
    with pytest.raises(ValueError, match="nope"):
        build_reward_functions(["nope"], 8)
