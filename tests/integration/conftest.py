"""Fixtures shared by the gateway's integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.fake_trainer import FakeTrainer


@pytest.fixture
def fake() -> Iterator[FakeTrainer]:
    """A scripted fake trainer with 4 slots on port 0; held scripts are released at the end."""
    trainer = FakeTrainer(slots=4)
    trainer.start()
    yield trainer
    for script in trainer.scripts:
        script.release.set()
    trainer.kill()
