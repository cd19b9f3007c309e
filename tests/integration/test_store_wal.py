"""The gateway's SQLite WAL under sustained ingest: it starts again from its beginning at its
limit instead of growing for as long as ingest lasts (before: 469 MiB of WAL beside an 18 MiB
database after 200,000 episodes).

The limit is scaled down (1 MiB instead of 32) so that a few seconds of ingest pass it many
times; the benchmark ``bench/store_wal.py`` measures the real one at full scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from pathlib import Path

import pytest

from gateway.core.store import sqlite_thread
from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import collect, running_gateway
from trainwire.v1 import gateway_service_pb2

State = gateway_service_pb2.Run.State
LIMIT = 2**20
RUNS = 4
EPISODES = 2500  # a motion detail (5 KB) every 10th episode: about 7 MB of history in all


class WalSampler:
    """Samples the size of a WAL file every 5 ms on a thread; ``peak`` is the largest seen."""

    def __init__(self, wal: Path) -> None:
        self.wal = wal
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            with contextlib.suppress(FileNotFoundError):
                self.peak = max(self.peak, self.wal.stat().st_size)
                self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wal_restarts(wal: Path) -> int:
    """How many times the WAL started again from its beginning (its header's checkpoint
    sequence number)."""
    with wal.open("rb") as f:
        return int(struct.unpack(">I", f.read(16)[12:16])[0])


async def test_the_wal_stays_bounded_under_sustained_unpaced_ingest(
    fake: FakeTrainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_thread, "WAL_LIMIT_BYTES", LIMIT)
    db = tmp_path / "gw.sqlite3"
    wal = Path(f"{db}-wal")
    async with running_gateway((fake.address,), db=str(db)) as client:
        sampler = WalSampler(wal)
        try:
            runs = [await client.create(max_episodes=EPISODES) for _ in range(RUNS)]
            finals = await asyncio.gather(
                *(collect(client.stub, r.id, after_episode=EPISODES, timeout=120) for r in runs)
            )
            restarts = wal_restarts(wal)  # before the stop folds the WAL in and deletes it
        finally:
            sampler.stop()
    assert [f.finished.state for f in finals if f.finished] == [State.STATE_DONE] * RUNS
    assert [f.finished.episode for f in finals if f.finished] == [EPISODES] * RUNS
    assert sampler.samples > 0
    assert restarts >= 3, f"the WAL started again {restarts} times (peak {sampler.peak} bytes)"
    # At the limit the store thread brings the WAL back to its start after its next commit,
    # waiting for the checkpointer only past one and a half times the limit; a commit under
    # load can carry up to 2048 episodes (about 1 MiB here) first.
    assert sampler.peak <= 4 * LIMIT, f"WAL peak {sampler.peak} bytes, limit {LIMIT}"
    assert db.stat().st_size > 4 * LIMIT  # the history is larger than the WAL ever was
