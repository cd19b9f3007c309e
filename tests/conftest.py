"""Suite-wide settings (one torch thread, here and in every process the tests start: two cores
are shared; everything offline; the cyclic collector paused while the tests are collected, as
the services pause it while they start, ``trainwire_ops.heap``) and the fixtures every suite
shares."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fakes.fake_trainer import FakeTrainer, running_fake
from tests.postgres_fixtures import postgres_server, postgres_url  # noqa: F401 (fixtures)
from trainwire_ops import heap

# Collecting imports every test module (torch, transformers, the services); frozen after it.
heap.pause()

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread in every process the tests start too (trainers, ranks, tools): torch's OpenMP
# threads would otherwise spin-wait between ops on the two shared cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

try:  # torch is optional: the client package and the gateway must work without it
    import torch
except ImportError:  # pragma: no cover - exercised only in a torch-less environment
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules collection imported stay for the session: out of every collection after."""
    heap.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the files that hold a ``slow`` test first, each file's tests in their order.

    ``make test`` deals whole files to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``): the long process tests start at once, and the many short files
    fill the workers' ends, rather than the longest test starting last with the other
    workers idle.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def make_fake() -> Iterator[Callable[..., FakeTrainer]]:
    """Starts ``FakeTrainer(**kwargs)`` s on port 0 (``running_fake``); all are stopped at the
    end, held scripts released."""
    with contextlib.ExitStack() as stack:

        def make(**kwargs: Any) -> FakeTrainer:
            return stack.enter_context(running_fake(**kwargs))

        yield make


@pytest.fixture
def fake(make_fake: Callable[..., FakeTrainer]) -> FakeTrainer:
    """A scripted fake trainer with 4 slots on port 0; held scripts are released at the end."""
    return make_fake(slots=4)
