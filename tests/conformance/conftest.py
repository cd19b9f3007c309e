"""The fixture of the conformance suite: every test runs against each ``TrainerConnector`` that
stands for trainers, the gateway core tests' fake (``tests.fakes.memory_trainer``) and the real
trainer core behind the real servicer and connector (``tests.fakes.core_connector``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.core.trainers import TrainerConnector
from tests.fakes.core_connector import CoreConnector, CoreGrpoProvider, make_runner
from tests.fakes.memory_trainer import MemoryConnector, MemoryTrainer
from tests.fakes.waiting import TIMEOUT
from trainwire_ops.checkpoints import CheckpointStore

#: Seconds between two heartbeats of a waiting job's stream, on both.
HEARTBEAT_S = 0.05


@dataclass
class Trainers:
    """One implementation: its connector, and ``add(address, slots, grpo=False)`` to stand up
    a trainer with that many slots at an address, offering ``imitation`` (and ``grpo``)."""

    name: str
    connector: TrainerConnector
    add: Callable[..., None]


def _memory() -> tuple[MemoryConnector, Callable[..., None]]:
    connector = MemoryConnector([])

    def add(address: str, slots: int, grpo: bool = False) -> None:
        trainer = MemoryTrainer(
            address,
            providers=("imitation", "grpo") if grpo else ("imitation",),
            slots_total=slots,
            heartbeat_s=HEARTBEAT_S,
            hyperparameter_metrics=True,
        )
        trainer.store = connector.checkpoints
        trainer.rendezvous = connector.rendezvous
        connector.trainers[address] = trainer

    return connector, add


@pytest.fixture(params=["memory", "core"])
async def trainers(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Trainers]:
    """Each implementation in turn, with no trainer yet; every call still open is cancelled
    and every job stopped at the end."""
    if request.param == "memory":
        memory, add = _memory()
        yield Trainers("memory", memory, add)
        await memory.close()
        return
    core = CoreConnector()
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    grpo_provider = CoreGrpoProvider()  # one for all: the ranks of a job meet in it

    def add_runner(address: str, slots: int, grpo: bool = False) -> None:
        runner = make_runner(
            slots,
            store,
            tmp_path / "scratch",
            HEARTBEAT_S,
            grpo_provider=grpo_provider if grpo else None,
        )
        core.add(address, runner)

    try:
        yield Trainers("core", core, add_runner)
    finally:
        await core.close()
        await asyncio.to_thread(core.shutdown, TIMEOUT)
