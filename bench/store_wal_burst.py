"""Store WAL burst benchmark: a burst of episodes at the contract's largest motion detail.

A transaction cannot be checkpointed while it is written, so the WAL can pass its limit by one
group commit. The store thread caps a group commit at a quarter of the limit in episode bytes;
this compares that with the uncapped batching before it (up to 2048 operations, whatever their
size), side by side in one run, on the real store thread and a file database.

Per mode and round: 8 runs, each 512 episodes of 240 frames x 32 joints (about 31 KiB each,
126 MiB in all), queued faster than they commit (the store thread is held while the burst is
queued, then let go, as when a stalled disk comes back). Shown: the WAL file's peak (sampled
every 2 ms), the largest group commit, and the ingest rate. Target: the capped peak stays
within what the store thread promises with one bounded commit: it waits for the checkpointer's
pass in flight only past one and a half times the limit, so 1.5 x the limit plus one commit (a
quarter of the limit, and one episode). Uncapped, one commit alone can be 2048 episodes. Modes
alternate, three rounds each; the median is shown.

Run: ``.venv/bin/python bench/store_wal_burst.py`` (about a minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from gateway.core.store import EpisodeRecord, SqliteStore, StoreThread  # noqa: E402
from gateway.core.store.sqlite_thread import WAL_LIMIT_BYTES  # noqa: E402
from tests.fakes.fake_trainer import valid_episodes  # noqa: E402
from tests.unit.test_gateway_store import make_run  # noqa: E402

RUNS, EPISODES, ROUNDS = 8, 512, 3
MiB = 2**20


async def burst(directory: Path, capped: bool) -> tuple[float, int, float]:
    """One burst; returns (WAL peak in bytes, largest commit in operations, episodes/s)."""
    path = str(directory / f"{'capped' if capped else 'uncapped'}.sqlite3")
    batches: list[int] = []
    thread = StoreThread(
        SqliteStore(path), asyncio.get_running_loop(), lambda n, _: batches.append(n)
    )
    if not capped:
        thread._batch_bytes = 1 << 62  # the batching before the cap: operations only
    thread.start()
    runs = [f"run-{i}" for i in range(RUNS)]
    for run_id in runs:
        await thread.call(SqliteStore.insert_run, make_run(run_id))
    episodes = list(valid_episodes(EPISODES, detail_every=1, frames=240, joints=32))
    held, release = threading.Event(), threading.Event()

    def hold(_: SqliteStore) -> None:
        held.set()
        release.wait()

    thread.submit(hold)
    await asyncio.to_thread(held.wait)
    for e in episodes:
        data = e.SerializeToString()
        for run_id in runs:
            thread.submit(
                SqliteStore.append_episodes,
                (EpisodeRecord(run_id, e.episode, e.reward, e.best_reward, data),),
            )
    wal = Path(f"{path}-wal")
    peak, sampling = 0, True

    def sample() -> None:
        nonlocal peak
        while sampling:
            with contextlib.suppress(OSError):
                peak = max(peak, wal.stat().st_size)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    batches.clear()
    start = time.perf_counter()
    release.set()
    await thread.call(SqliteStore.get_run, runs[-1])
    elapsed = time.perf_counter() - start
    sampling = False
    sampler.join()
    await thread.close()
    return peak, max(batches), RUNS * EPISODES / elapsed


async def main() -> None:
    size = len(
        next(iter(valid_episodes(1, detail_every=1, frames=240, joints=32))).SerializeToString()
    )
    print(
        f"{RUNS} runs x {EPISODES} episodes of {size / 1024:.1f} KiB "
        f"({RUNS * EPISODES * size / MiB:.0f} MiB), WAL limit {WAL_LIMIT_BYTES / MiB:.0f} MiB"
    )
    results: dict[bool, list[tuple[float, int, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(ROUNDS):
            for capped in (False, True) if round_ % 2 == 0 else (True, False):
                directory = Path(tmp) / f"{round_}-{capped}"
                directory.mkdir()
                results[capped].append(await burst(directory, capped))
    print(f"{'':10}{'WAL peak':>12}{'largest commit':>18}{'episodes/s':>14}")
    medians = {}
    for capped, name in ((False, "uncapped"), (True, "capped")):
        peak = statistics.median(r[0] for r in results[capped])
        ops = statistics.median(r[1] for r in results[capped])
        rate = statistics.median(r[2] for r in results[capped])
        medians[capped] = (peak, rate)
        print(f"{name:10}{peak / MiB:>9.1f} MiB{ops:>18.0f}{rate:>14,.0f}")
    bound = WAL_LIMIT_BYTES * 1.75 + size
    print(
        f"capped/uncapped: WAL peak {medians[True][0] / medians[False][0]:.2f}x, "
        f"rate {medians[True][1] / medians[False][1]:.2f}x; capped peak within "
        f"limit x 1.75 + one episode ({bound / MiB:.1f} MiB): {medians[True][0] <= bound}"
    )


if __name__ == "__main__":
    asyncio.run(main())
