"""The operator's own reward functions (``--reward-module``): what a module offers, how the
trainer refuses one that cannot be used, how a task names its rewards and weights, and how a
reward that fails names itself and the step (providers/grpo/reward_modules.py,
reward_checks.py, validation.py)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import textwrap
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from tests.grpo_fixtures import tiny_grpo_task
from trainer_service.__main__ import parse_args
from trainer_service.providers import grpo
from trainer_service.providers.grpo.reward_checks import RewardFailed, checked
from trainer_service.providers.grpo.reward_modules import (
    RewardModuleError,
    canonical_spec,
    load_reward_module,
    load_reward_modules,
)
from trainer_service.providers.grpo.rewards import REWARD_NAMES, build_reward_functions
from trainwire.v1 import episode_pb2

REPO = pathlib.Path(__file__).resolve().parents[2]

MODULE = '''
"""Rewards of a test."""
import math
from math import sqrt  # imported: not a reward

LIMIT = 3  # not callable: not a reward


def colour(prompts, completions, colour=None, **kwargs):
    return [1.0 if c == col else 0.0 for c, col in zip(completions, colour)]


async def later(completions, **kwargs):
    return [0.5] * len(completions)


def _helper():
    return 1


class Scorer:  # a class: not a reward
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)
'''


def _module(directory: pathlib.Path, text: str = MODULE) -> tuple[str, pathlib.Path]:
    """A reward module file with a name no other test uses (modules stay imported)."""
    name = f"tw_rewards_{uuid.uuid4().hex[:10]}"
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return name, path


def test_a_file_module_offers_its_public_functions(tmp_path: pathlib.Path) -> None:
    name, path = _module(tmp_path)
    module = load_reward_module(str(path))
    assert list(module.functions) == [f"{name}:colour", f"{name}:later"]
    assert module.name == name and module.spec == str(path.resolve())
    assert load_reward_module(str(path)) is module  # imported once per process
    assert sys.modules[name].__file__ == str(path)
    offered = grpo.reward_functions((str(path),))
    assert offered == (*REWARD_NAMES, f"{name}:colour", f"{name}:later")


def test_a_dotted_module_name(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = f"tw_pkg_{uuid.uuid4().hex[:10]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "scores.py").write_text("def one(completions, **kw):\n    return [1]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_reward_modules([f"{package}.scores"])
    assert list(functions) == [f"{package}.scores:one"]
    assert canonical_spec(f" {package}.scores ") == f"{package}.scores"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("import not_a_module_anywhere_xyz\n", "cannot import it: ModuleNotFoundError"),
        ("def broken(:\n", "cannot import it: SyntaxError"),
        ("raise RuntimeError('no GPU here')\n", "cannot import it: RuntimeError: no GPU here"),
        ("from math import sqrt\n_private = 1\n", "defines no public function"),
    ],
)
def test_a_module_that_cannot_be_used_says_why_in_one_line(
    tmp_path: pathlib.Path, text: str, problem: str
) -> None:
    name, path = _module(tmp_path, text)
    with pytest.raises(RewardModuleError) as info:
        load_reward_module(str(path))
    message = str(info.value)
    assert message.startswith(f"--reward-module {path}: ") and problem in message
    assert "\n" not in message
    if "cannot import" in problem:
        assert name not in sys.modules  # a failed import leaves nothing behind


def test_missing_files_bad_names_and_taken_names(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RewardModuleError, match=r"no such \.py file"):
        load_reward_module(str(tmp_path / "absent.py"))
    with pytest.raises(RewardModuleError, match="is not a Python module name"):
        (tmp_path / "my-rewards.py").write_text("def f(completions, **kw):\n    return []\n")
        load_reward_module(str(tmp_path / "my-rewards.py"))
    (tmp_path / "json.py").write_text("def f(completions, **kw):\n    return []\n")
    with pytest.raises(RewardModuleError, match="the module name 'json' is another module's"):
        load_reward_module(str(tmp_path / "json.py"))
    with pytest.raises(RewardModuleError, match="cannot import it: ModuleNotFoundError"):
        load_reward_module("no_such_package_xyz.rewards")
    with pytest.raises(RewardModuleError, match="neither a module name"):
        load_reward_module("not a module")


# The trainer's flag.


def test_the_flag_repeats_and_comes_from_the_environment(tmp_path: pathlib.Path) -> None:
    config = parse_args(["--reward-module", "a.py", "--reward-module", "pkg.mod"], environ={})
    assert config.reward_modules == ("a.py", "pkg.mod")
    from_env = parse_args([], environ={"TRAINWIRE_TRAINER_REWARD_MODULE": f"a.py{os.pathsep}b"})
    assert from_env.reward_modules == ("a.py", "b")
    assert parse_args([], environ={}).reward_modules == ()


def test_the_trainer_does_not_start_with_a_module_that_does_not_import(
    tmp_path: pathlib.Path,
) -> None:
    _, path = _module(tmp_path, "import not_a_module_anywhere_xyz\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainer_service", "--port", "0", "--reward-module", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"python -m trainer_service: error: --reward-module {path}: cannot")
    assert done.stdout == ""


# Which rewards a task may name on a trainer.


def test_validation_knows_the_trainers_modules(tmp_path: pathlib.Path) -> None:
    name, path = _module(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    task = tiny_grpo_task("models/m", "d.parquet", reward_functions=("format", f"{name}:colour"))
    assert grpo.validate(task, [tmp_path], (str(path),)) == []
    (violation,) = grpo.validate(task, [tmp_path])
    assert violation.field == "task.grpo.reward_functions[1]"
    assert f"unknown reward function '{name}:colour'" in violation.description
    twice = tiny_grpo_task("models/m", "d.parquet", reward_functions=(f"{name}:later",) * 2)
    (violation,) = grpo.validate(twice, [tmp_path], (str(path),))
    assert violation.field == "task.grpo.reward_functions[1]" and "twice" in violation.description


# A reward that fails names itself and the step.


def _state(step: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step)


def _call(function: Any, completions: list[str], step: int = 11) -> Any:
    return function(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=[[1]] * len(completions),
        trainer_state=_state(step),
    )


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (ValueError("no such colour"), "ValueError: no such colour"),
        ([1.0], "it returned 1 rewards for 2 completions"),
        ("1.0", "it returned str, not a list of numbers"),
        (0.5, "it returned float, not a list of numbers"),
        ([1.0, "high"], "reward 2 is 'high', not a number or None"),
        ([1.0, {"r": 1}], "reward 2 is a dict, not a number or None"),
        ([float("inf"), 1.0], "reward 1 is inf, not a finite number or None"),
    ],
)
def test_a_failing_reward_names_the_function_and_the_step(answer: Any, problem: str) -> None:
    def reward(completions: list[str], **kwargs: Any) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    function = checked(reward, "mymod:score")
    assert function.__name__ == "mymod:score"  # TRL logs rewards/<name>/mean
    with pytest.raises(RewardFailed) as info:
        _call(function, ["a", "b"])
    assert info.value.user_message == f"Reward function mymod:score failed at step 12: {problem}"
    assert (info.value.function, info.value.step) == ("mymod:score", 12)
    assert info.value.code == "FAILED_PRECONDITION" and info.value.reason == "REWARD_FAILED"


def test_good_answers_pass_through_sync_and_async() -> None:
    def reward(completions: list[str], **kwargs: Any) -> list[float | None]:
        return [1, None]

    assert _call(checked(reward, "m:r"), ["a", "b"]) == [1, None]

    async def later(completions: list[str], **kwargs: Any) -> list[float]:
        return [0.25] * len(completions)

    async def broken(completions: list[str], **kwargs: Any) -> list[float]:
        raise KeyError("colour")

    assert asyncio.run(_call(checked(later, "m:later"), ["a"])) == [0.25]
    with pytest.raises(RewardFailed, match=r"^Reward function m:broken failed at step 1: KeyError"):
        asyncio.run(_call(checked(broken, "m:broken"), ["a"], step=0))


def test_build_reward_functions_names_and_checks_every_reward(tmp_path: pathlib.Path) -> None:
    name, path = _module(tmp_path)
    custom = load_reward_modules([str(path)])
    functions = build_reward_functions(["format", f"{name}:colour"], 8, custom=custom)
    assert [f.__name__ for f in functions] == ["format", f"{name}:colour"]
    scored = functions[1](
        prompts=["p", "p"],
        completions=["red", "blue"],
        colour=["red", "red"],
        trainer_state=_state(0),
    )
    assert scored == [1.0, 0.0]
    with pytest.raises(RewardFailed, match=rf"^Reward function {name}:colour failed at step 4"):
        functions[1](prompts=["p"], completions=["red"], trainer_state=_state(3))  # no colour
    with pytest.raises(ValueError, match=f"unknown reward functions: {name}:colour"):
        build_reward_functions([f"{name}:colour"], 8)


def test_the_runner_offers_and_admits_by_the_trainers_modules(tmp_path: pathlib.Path) -> None:
    from trainer_service.core.errors import InvalidRequest
    from trainer_service.core.jobs import JobRunner, RunnerSettings
    from trainer_service.core.registry import ProviderRegistry
    from trainer_service.core.slots import SlotPool
    from trainwire.v1 import trainer_service_pb2

    name, path = _module(tmp_path)
    registry = ProviderRegistry({"grpo": "trainer_service.providers.grpo"})
    settings = RunnerSettings(data_roots=(tmp_path,), reward_modules=(str(path),))
    runner = JobRunner(registry, SlotPool(1), settings)
    offered = runner.capabilities().reward_functions
    assert offered == (*REWARD_NAMES, f"{name}:colour", f"{name}:later")
    bare = JobRunner(registry, SlotPool(1), RunnerSettings(data_roots=(tmp_path,)))
    assert bare.capabilities().reward_functions == REWARD_NAMES
    request = trainer_service_pb2.TrainRequest(
        run_id="r1",
        task=tiny_grpo_task("models/m", "d.parquet", reward_functions=("format", "other:f")),
        config=episode_pb2.TrainConfig(max_episodes=2),
    )
    with pytest.raises(InvalidRequest) as info:
        runner.start(request)
    assert [v.field for v in info.value.violations] == ["task.grpo.reward_functions[1]"]
    assert runner.slots.free == 1
