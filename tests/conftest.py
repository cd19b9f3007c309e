"""Suite-wide settings (one torch thread: two cores are shared; everything offline) and the
fixtures every suite shares."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fakes.fake_trainer import FakeTrainer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

try:  # torch is optional: the client package and the gateway must work without it
    import torch
except ImportError:  # pragma: no cover - exercised only in a torch-less environment
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(1)


@pytest.fixture
def fake() -> Iterator[FakeTrainer]:
    """A scripted fake trainer with 4 slots on port 0; held scripts are released at the end."""
    trainer = FakeTrainer(slots=4)
    trainer.start()
    yield trainer
    for script in trainer.scripts:
        script.release.set()
    trainer.default.release.set()
    trainer.hang_capabilities.clear()
    trainer.kill()
