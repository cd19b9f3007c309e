"""The trainer's ``--checkpoint-store``: its default, the environment, and the start-up check
that refuses a store it cannot write with one line naming it."""

from __future__ import annotations

import pathlib

import pytest

from trainer_service.__main__ import parse_args
from trainer_service.server import open_checkpoint_store
from trainwire_ops.checkpoints import CheckpointStoreProblem


def test_default_and_environment() -> None:
    assert parse_args([], environ={}).checkpoint_store == "var/checkpoints"
    config = parse_args([], environ={"TRAINWIRE_TRAINER_CHECKPOINT_STORE": "s3://b/p"})
    assert config.checkpoint_store == "s3://b/p"
    assert parse_args(["--checkpoint-store", "/x"], environ={}).checkpoint_store == "/x"


def test_an_unusable_store_is_one_line(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = parse_args(["--checkpoint-store", str(blocker / "store")], environ={})
    with pytest.raises(CheckpointStoreProblem) as caught:
        open_checkpoint_store(config)
    assert "\n" not in str(caught.value)
    assert str(blocker / "store") in str(caught.value)


def test_a_usable_store_is_opened(tmp_path: pathlib.Path) -> None:
    config = parse_args(["--checkpoint-store", str(tmp_path / "store")], environ={})
    assert open_checkpoint_store(config).location == str(tmp_path / "store")
