"""What a request may say about rewards and columns before any trainer sees it: reward names
built in or shaped ``MODULE:FUNCTION``, one finite weight per reward function (the defaults
count), distinct column names; and the CLI's ``--reward NAME[=WEIGHT],...``."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import pytest

from trainwire.cli._parser import build_parser
from trainwire.contract import check_task, is_custom_reward
from trainwire.v1 import episode_pb2


def _fields(
    rewards: Sequence[str] = (),
    weights: Sequence[float] = (),
    columns: episode_pb2.DatasetColumns | None = None,
) -> list[str]:
    grpo = episode_pb2.GrpoTask(
        model_path="m",
        dataset_path="d.parquet",
        reward_functions=list(rewards),
        reward_weights=list(weights),
    )
    if columns is not None:
        grpo.columns.CopyFrom(columns)
    violations = check_task(
        episode_pb2.TrainTask(grpo=grpo), episode_pb2.TrainConfig(max_episodes=3)
    )
    return [v.field for v in violations]


@pytest.mark.parametrize(
    ("name", "custom"),
    [
        ("mymod:score", True),
        ("pkg.sub.mod:score_2", True),
        ("_private.mod:f", True),
        ("mod:_private", False),
        ("mod:", False),
        (":f", False),
        ("mod:f:g", False),
        ("my-mod:f", False),
        ("mod.:f", False),
        ("exact_match", False),
        ("m" * 250 + ":fffff_", False),
    ],
)
def test_custom_reward_names_are_module_colon_function(name: str, custom: bool) -> None:
    assert is_custom_reward(name) is custom
    bad = [] if custom or name == "exact_match" else ["task.grpo.reward_functions[0]"]
    assert _fields([name]) == bad


def test_weights_one_per_function_and_finite() -> None:
    assert _fields(["exact_match", "mymod:f"], [1.0, -0.5]) == []
    assert _fields([], [2.0, 1.0]) == []  # the two default rewards
    assert _fields([], [1.0]) == ["task.grpo.reward_weights"]
    assert _fields(["length"], [1.0, 1.0]) == ["task.grpo.reward_weights"]
    assert _fields(["length"], [float("nan")]) == ["task.grpo.reward_weights"]
    assert _fields(["length", "format"], [float("inf"), 1]) == ["task.grpo.reward_weights"]
    assert _fields(["mymod:f", "mymod:f"]) == ["task.grpo.reward_functions[1]"]


def test_the_weights_message_says_what_they_align_with() -> None:
    grpo = episode_pb2.GrpoTask(model_path="m", dataset_path="d", reward_weights=[1.0])
    (violation,) = check_task(
        episode_pb2.TrainTask(grpo=grpo), episode_pb2.TrainConfig(max_episodes=3)
    )
    assert violation.description == (
        "1 weights for the 2 default reward functions (exact_match, format); give one per "
        "function, or none (all 1)"
    )


def test_column_names() -> None:
    columns = episode_pb2.DatasetColumns
    assert _fields(columns=columns(prompt="question", images="picture", solution="answer")) == []
    assert _fields(columns=columns(images="image_paths")) == []
    assert _fields(columns=columns(prompt="x", solution="x")) == ["task.grpo.columns.solution"]
    assert _fields(columns=columns(images="bad\nname")) == ["task.grpo.columns.images"]
    assert _fields(columns=columns(prompt="   ")) == ["task.grpo.columns.prompt"]
    assert _fields(columns=columns(prompt="p" * 257)) == ["task.grpo.columns.prompt"]


def test_cli_reward_weights_and_columns() -> None:
    from trainwire.cli._commands import grpo_task_of

    def parse(flags: str) -> episode_pb2.GrpoTask:
        command = f"runs create grpo --model m --dataset d.parquet {flags}"
        return grpo_task_of(build_parser().parse_args(shlex.split(command))).grpo

    plain = parse("--reward exact_match,format")
    assert list(plain.reward_functions) == ["exact_match", "format"]
    assert list(plain.reward_weights) == []  # no weight given: none sent (all 1)
    weighted = parse("--reward 'exact_match, mymod:score=0.5,format=-2'")
    assert list(weighted.reward_functions) == ["exact_match", "mymod:score", "format"]
    assert list(weighted.reward_weights) == [1.0, 0.5, -2.0]
    renamed = parse("--prompt-column question --images-column picture")
    assert (renamed.columns.prompt, renamed.columns.images, renamed.columns.solution) == (
        "question",
        "picture",
        "",
    )
    assert not parse("").HasField("columns")


@pytest.mark.parametrize("flag", ["=1", "a=x", "a=nan", "a=inf"])
def test_cli_refuses_bad_weights(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from trainwire.cli import main

    assert main(["runs", "create", "grpo", "--model", "m", "--dataset", "d", "--reward", flag]) == 2
    assert "--reward" in capsys.readouterr().err
