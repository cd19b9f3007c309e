"""What watchers that stop reading cost the gateway, side by side in one run.

A gateway process replays a finished run whose every episode carries the contract's largest
motion detail (240 frames x 32 joints, 31 KB) to 200 watchers that read nothing; the table shows
how much the gateway's RSS grew, with today's adaptive batches (at most 128 KiB, shrinking for a
slow reader) and with the first release's fixed 1 MiB batches; then three of the watchers read
to the end and must get every episode exactly once.

    .venv/bin/python bench/stalled_watchers.py [--episodes 5000] [--watchers 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from tests.fakes.fake_trainer import FakeTrainer, Script  # noqa: E402
from tests.fakes.gateway_harness import collect, create_request, gateway_process  # noqa: E402
from tests.fakes.watch_load import stalled_watchers  # noqa: E402
from trainwire.v1 import gateway_service_pb2_grpc  # noqa: E402

#: The gateway with the first release's batching: fixed 1 MiB batches, whatever the reader.
LEGACY = (
    "-c",
    "import sys, gateway.core.framing as h, gateway.core.replay as r\n"
    "h.MAX_BATCH_BYTES = r.MAX_BATCH_BYTES = r.FIRST_BATCH_BYTES = 1 << 20\n"
    "r.SLOW_WRITE_S = float('inf')\n"
    "from gateway.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n",
)


async def measure(label: str, command: tuple[str, ...], episodes: int, watchers: int) -> str:
    fake = FakeTrainer(slots=2, default=Script(frames=240, joints=32, detail_every=1))
    fake.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "gateway.log"
            db = str(Path(tmp) / "gw.sqlite3")
            async with (
                gateway_process(fake.address, log, "--db", db, command=command) as (
                    proc,
                    address,
                ),
                grpc.aio.insecure_channel(address) as channel,
            ):
                stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
                run = (await stub.CreateRun(create_request(max_episodes=episodes), timeout=300)).run
                await collect(stub, run.id, timeout=600)
                began = time.monotonic()
                result = await stalled_watchers(proc.pid, address, run.id, watchers, readers=3)
                elapsed = time.monotonic() - began
        exact = all(n == list(range(1, episodes + 1)) for n in result.received)
        return (
            f"{label:<34}{result.rss_before / 2**20:>10.1f}{result.rss_stalled / 2**20:>12.1f}"
            f"{result.added_mb:>12.1f}{result.added_mb * 1024 / watchers:>14.0f}"
            f"{'yes' if exact else 'NO':>12}{elapsed:>9.0f}"
        )
    finally:
        fake.kill()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=5000)
    parser.add_argument("--watchers", type=int, default=200)
    args = parser.parse_args()
    print(
        f"{args.watchers} watchers that read nothing, finished run of {args.episodes} episodes "
        "x 31 KB motion detail"
    )
    print(
        f"{'gateway':<34}{'RSS MB':>10}{'stalled MB':>12}{'added MB':>12}"
        f"{'KB/watcher':>14}{'3 read all':>12}{'s':>9}"
    )
    print(await measure("adaptive batches (<= 128 KiB)", ("-m", "gateway"), **vars(args)))
    print(await measure("fixed 1 MiB batches (1st release)", LEGACY, **vars(args)))


if __name__ == "__main__":
    asyncio.run(main())
