"""Request-time validation of GRPO tasks against the trainer's data roots."""

from __future__ import annotations

import pathlib

import pytest

from tests.grpo_fixtures import tiny_grpo_task
from trainer_service.providers.grpo import validate
from trainer_service.providers.grpo.validation import resolve_in_roots
from trainwire.v1 import episode_pb2


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    data_root = tmp_path / "root"
    (data_root / "models" / "m").mkdir(parents=True)
    (data_root / "data").mkdir()
    (data_root / "data" / "train.jsonl").write_text("{}\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.jsonl").write_text("{}\n")
    (data_root / "data" / "escape.jsonl").symlink_to(outside / "evil.jsonl")
    (data_root / "escape_dir").symlink_to(outside)
    (data_root / "inside.jsonl").symlink_to(data_root / "data" / "train.jsonl")
    return data_root


def _fields(violations: list) -> list[str]:
    return [v.field for v in violations]


def test_valid_task_passes(root: pathlib.Path) -> None:
    assert validate(tiny_grpo_task("models/m", "data/train.jsonl"), [root]) == []
    assert validate(tiny_grpo_task("models/m", "inside.jsonl"), [root]) == []
    # A path that does not exist yet is not a request error (the job reports it when loading).
    assert validate(tiny_grpo_task("models/later", "data/later.jsonl"), [root]) == []


@pytest.mark.parametrize(
    ("model", "dataset", "field"),
    [
        ("/etc", "data/train.jsonl", "task.grpo.model_path"),
        ("models/../../x", "data/train.jsonl", "task.grpo.model_path"),
        ("escape_dir", "data/train.jsonl", "task.grpo.model_path"),
        ("models/m", "data/escape.jsonl", "task.grpo.dataset_path"),
        ("models/m", "escape_dir/evil.jsonl", "task.grpo.dataset_path"),
        ("models/m", "C:\\data.jsonl", "task.grpo.dataset_path"),
        ("models/m", "", "task.grpo.dataset_path"),
    ],
)
def test_paths_escaping_the_root(root: pathlib.Path, model: str, dataset: str, field: str) -> None:
    violations = validate(tiny_grpo_task(model, dataset), [root])
    assert _fields(violations) == [field]
    assert "data root" in violations[0].description


def test_unknown_and_repeated_reward_names(root: pathlib.Path) -> None:
    task = tiny_grpo_task(
        "models/m", "data/train.jsonl", reward_functions=("format", "bleu", "format")
    )
    violations = validate(task, [root])
    assert _fields(violations) == ["task.grpo.reward_functions[1]", "task.grpo.reward_functions[2]"]
    assert "bleu" in violations[0].description and "exact_match" in violations[0].description


def test_wrong_kind(root: pathlib.Path) -> None:
    task = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(rig_name="stickman"))
    assert _fields(validate(task, [root])) == ["task.grpo"]


def test_model_files_that_are_symlinks_out_of_the_root(root: pathlib.Path) -> None:
    outside = root.parent / "outside"
    (outside / "weights.safetensors").write_bytes(b"not yours")
    model = root / "models" / "m"
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").symlink_to(model / "config.json")  # inside: fine
    assert validate(tiny_grpo_task("models/m", "data/train.jsonl"), [root]) == []
    (model / "model.safetensors").symlink_to(outside / "weights.safetensors")
    (violation,) = validate(tiny_grpo_task("models/m", "data/train.jsonl"), [root])
    assert violation.field == "task.grpo.model_path"
    assert "models/m/model.safetensors is a symlink to outside" in violation.description


@pytest.fixture
def shared(tmp_path: pathlib.Path) -> pathlib.Path:
    """A second data root, as a shared filesystem holding datasets and a model."""
    shared = tmp_path / "shared"
    (shared / "sets").mkdir(parents=True)
    (shared / "sets" / "big.jsonl").write_text("{}\n")
    (shared / "models" / "big").mkdir(parents=True)
    return shared


def test_an_absolute_path_inside_any_root_passes_and_outside_every_root_does_not(
    root: pathlib.Path, shared: pathlib.Path
) -> None:
    roots = [root, shared]
    in_shared = tiny_grpo_task(str(shared / "models" / "big"), str(shared / "sets" / "big.jsonl"))
    assert validate(in_shared, roots) == []
    in_first = tiny_grpo_task(str(root / "models" / "m"), str(root / "data" / "train.jsonl"))
    assert validate(in_first, roots) == []
    assert validate(in_first, [root]) == []  # one root: an absolute path inside it is fine too
    # Without the shared root, both paths lead outside the trainer's roots: refused as before.
    both = ["task.grpo.model_path", "task.grpo.dataset_path"]
    assert _fields(validate(in_shared, [root])) == both
    escaping = tiny_grpo_task("models/m", str(root.parent / "outside" / "evil.jsonl"))
    (violation,) = validate(escaping, roots)
    assert violation.field == "task.grpo.dataset_path" and "data root" in violation.description
    dotted = tiny_grpo_task("models/m", str(shared / "sets" / ".." / "sets" / "big.jsonl"))
    assert _fields(validate(dotted, roots)) == ["task.grpo.dataset_path"]


def test_relative_paths_resolve_against_the_first_root(
    root: pathlib.Path, shared: pathlib.Path
) -> None:
    assert resolve_in_roots([root, shared], "data/train.jsonl") == root / "data" / "train.jsonl"
    assert resolve_in_roots([shared, root], "sets/big.jsonl") == shared / "sets" / "big.jsonl"
    # Only in the second root: relative paths never look there (absent from the first root
    # is not a request error; loading it reports it).
    assert resolve_in_roots([root, shared], "sets/big.jsonl") == root / "sets" / "big.jsonl"


def test_symlinks_may_lead_from_one_root_into_another(
    root: pathlib.Path, shared: pathlib.Path
) -> None:
    (root / "data" / "big.jsonl").symlink_to(shared / "sets" / "big.jsonl")
    model = root / "models" / "m"
    (model / "model.safetensors").symlink_to(shared / "models" / "big")
    task = tiny_grpo_task("models/m", "data/big.jsonl")
    assert validate(task, [root, shared]) == []
    assert _fields(validate(task, [root])) == ["task.grpo.model_path", "task.grpo.dataset_path"]
