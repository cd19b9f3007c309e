"""The ``trainwire`` help: every command described with examples that parse, one name for the
run argument, one spelling of the learning rate, and defaults stated as the values a run gets
(held equal to the services' own constants)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex

import pytest

from trainwire.cli import _defaults as stated
from trainwire.cli import build_parser
from trainwire.cli._help import CommandParser, commands

TREE = list(commands(build_parser()))


def _name(path: tuple[str, ...]) -> str:
    return " ".join(("trainwire", *path))


def test_every_command_has_a_description_and_one_to_three_examples() -> None:
    assert len(TREE) > 20
    for path, parser in TREE:
        assert isinstance(parser, CommandParser), _name(path)
        assert parser.description and len(parser.description) > 20, _name(path)
        assert 1 <= len(parser.examples) <= 3, _name(path)
        text = parser.format_help()
        assert "\nExamples:\n" in text, _name(path)
        for comment, command in parser.examples:
            assert comment and f"  # {comment}\n  {command}\n" in text, _name(path)


def test_every_example_parses_and_shows_its_own_command() -> None:
    for path, parser in TREE:
        assert isinstance(parser, CommandParser)
        for _, line in parser.examples:
            # An example may chain commands (a && b, eval "$(...)"): each part that runs
            # trainwire must parse; at least one of them is the command documented.
            parts = [p.strip() for p in re.split(r"&&|\$\(|\)", line) if "trainwire " in p]
            assert parts, (_name(path), line)
            shown = False
            for part in parts:
                words = shlex.split(part.split(">")[0].strip().strip('"'))
                assert words[0] == "trainwire", (_name(path), line)
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):
                    args = build_parser().parse_args(words[1:])
                shown |= [w for w in words[1:] if not w.startswith("-")][: len(path)] == list(
                    path
                ) or not path
                assert args.command, line
            assert shown, (_name(path), line)


def test_the_run_argument_is_run_everywhere() -> None:
    seen = 0
    for path, parser in TREE:
        for action in parser._actions:
            if action.dest in ("run_id", "run_ids"):
                seen += 1
                assert action.metavar == "RUN", _name(path)
    assert seen >= 15


def test_the_learning_rate_is_spelled_alike_on_every_command() -> None:
    spellings = {
        _name(path): tuple(action.option_strings)
        for path, parser in TREE
        for action in parser._actions
        if action.dest == "learning_rate"
    }
    assert set(spellings) == {
        "trainwire runs create imitation",
        "trainwire runs create grpo",
        "trainwire runs fork",
        "trainwire set",
    }
    assert set(spellings.values()) == {("--learning-rate", "--lr")}


def test_no_help_points_to_a_proto_or_states_a_sentinel_default() -> None:
    for path, parser in TREE:
        text = parser.format_help()
        flat = " ".join(text.split())
        assert ".proto" not in flat and "GrpoTask" not in flat, _name(path)
        assert "i.e." not in flat, _name(path)
        assert "(default: 0," not in flat, _name(path)
        assert "%(" not in flat, _name(path)
        assert "README" not in flat, _name(path)


def test_global_flags_work_before_and_after_the_command() -> None:
    parser = build_parser()
    before = parser.parse_args(["--gateway", "gw:1", "--json", "runs", "get", "r1"])
    after = parser.parse_args(["runs", "get", "r1", "--gateway", "gw:1", "--json"])
    assert (before.gateway, before.json) == (after.gateway, after.json) == ("gw:1", True)
    assert parser.parse_args(["--timeout", "3", "watch", "r1"]).timeout == 3.0


def test_the_stated_defaults_are_the_services() -> None:
    import trainer_service.providers.grpo as grpo_provider
    from gateway.core.checkpoints import DEFAULT_KEEP
    from gateway.core.filters import KNOWN_FIELDS
    from gateway.core.settings import DEFAULTS
    from trainer_service.providers import imitation

    # By module path: the package's ``hyperparameters`` is also a function's name.
    hyperparameters = importlib.import_module("trainer_service.providers.grpo.hyperparameters")
    settings = importlib.import_module("trainer_service.providers.grpo.settings")
    from trainwire.contract import DEFAULT_GRPO_GENERATIONS

    assert DEFAULTS.episode_rate == stated.DEFAULT_EPISODE_RATE
    assert stated.DEFAULT_KEEP_CHECKPOINTS == DEFAULT_KEEP
    assert stated.SEARCH_FIELDS == KNOWN_FIELDS
    assert stated.DEFAULT_IMITATION_GROUP_SIZE == imitation.DEFAULT_GROUP_SIZE
    assert stated.DEFAULT_IMITATION_LEARNING_RATE == imitation.DEFAULT_LEARNING_RATE
    assert stated.DEFAULT_IMITATION_CHECKPOINT_EVERY == imitation.DEFAULT_CHECKPOINT_EVERY
    assert stated.DEFAULT_GRPO_CHECKPOINT_EVERY == grpo_provider.DEFAULT_CHECKPOINT_EVERY
    assert DEFAULT_GRPO_GENERATIONS == settings.DEFAULT_NUM_GENERATIONS
    assert stated.DEFAULT_GRPO_PROMPTS_PER_STEP == settings.DEFAULT_PROMPTS_PER_STEP
    assert stated.DEFAULT_GRPO_MAX_COMPLETION_LENGTH == settings.DEFAULT_MAX_COMPLETION_LENGTH
    assert stated.DEFAULT_GRPO_WORKERS == settings.DEFAULT_NUM_WORKERS
    assert stated.DEFAULT_GRPO_LORA_RANK == settings.DEFAULT_LORA_RANK
    assert stated.DEFAULT_GRPO_LEARNING_RATE == hyperparameters.DEFAULT_LEARNING_RATE
    assert stated.DEFAULT_GRPO_LORA_LEARNING_RATE == hyperparameters.DEFAULT_LORA_LEARNING_RATE
    assert stated.DEFAULT_GRPO_TEMPERATURE == hyperparameters.DEFAULT_TEMPERATURE
    assert stated.DEFAULT_GRPO_LORA_BETA == hyperparameters.DEFAULT_LORA_BETA


@pytest.mark.parametrize(
    ("path", "flag", "words"),
    [
        (("runs", "create", "grpo"), "--num-generations", "(default: 8)"),
        (("runs", "create", "grpo"), "--checkpoint-every", "(default: 50)"),
        (("runs", "create", "imitation"), "--checkpoint-every", "(default: 500)"),
        (("runs", "create", "imitation"), "--keep-checkpoints", "(default: 3)"),
        (("runs", "create", "imitation"), "--speed", "(default: 1)"),
        (("runs", "create", "grpo"), "--learning-rate", "(default: 0.003; with LoRA 0.01)"),
    ],
)
def test_a_flag_left_out_states_the_value_a_run_gets(
    path: tuple[str, ...], flag: str, words: str
) -> None:
    (parser,) = [p for found, p in TREE if found == path]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert action.help is not None and action.help.endswith(words)


def test_subcommand_usage_leaves_the_global_flags_out() -> None:
    (parser,) = [p for path, p in TREE if path == ("runs", "get")]
    usage = parser.format_usage()
    assert "--gateway" not in usage and "RUN" in usage
    assert isinstance(parser, argparse.ArgumentParser)


def test_runs_list_names_every_state_it_accepts() -> None:
    from trainwire.v1 import gateway_service_pb2

    (parser,) = [p for path, p in TREE if path == ("runs", "list")]
    (state,) = [a for a in parser._actions if "--state" in a.option_strings]
    named = [k.removeprefix("STATE_").lower() for k in gateway_service_pb2.Run.State.keys()[1:]]
    assert state.help is not None
    assert state.help.startswith(f"only runs in this state: {', '.join(named[:-1])} or {named[-1]}")
    for name in named:
        assert parser.parse_args(["--state", name]).state > 0
