"""Watchers that stop reading, against a gateway process: what they cost its memory, and that
they still get everything once they read. Shared by the memory test and its benchmark."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

#: The client process: opens N watch streams and reads none of them until told, then reads
#: R of them to the end and reports what each got.
CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    import grpc
    from trainwire.v1 import gateway_service_pb2 as pb, gateway_service_pb2_grpc as g

    async def main(address, run_id, count, readers):
        channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, count // 50))]
        calls = [
            g.GatewayServiceStub(channels[i % len(channels)]).WatchRun(
                pb.WatchRunRequest(run_id=run_id)
            )
            for i in range(count)
        ]
        for call in calls:
            await call.initial_metadata()
        print("open", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        async def read(call):
            numbers = []
            async for message in call:
                kind = message.WhichOneof("event")
                if kind == "episode":
                    numbers.append(message.episode.episode)
                elif kind == "batch":
                    numbers.extend(e.episode for e in message.batch.episodes)
            return numbers

        results = await asyncio.gather(*(read(call) for call in calls[:readers]))
        for call in calls[readers:]:
            call.cancel()
        print(json.dumps(list(results)), flush=True)
        for channel in channels:
            await channel.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    """
)


@dataclass
class StalledResult:
    """What stalled watchers cost and got."""

    rss_before: int
    rss_stalled: int
    received: list[list[int]]

    @property
    def added_mb(self) -> float:
        return (self.rss_stalled - self.rss_before) / 2**20


async def _settled_rss(process: psutil.Process, timeout: float = 90.0) -> int:
    """The process's RSS once it stopped growing (by more than 1 MiB over 2 s)."""
    deadline = time.monotonic() + timeout
    last = process.memory_info().rss
    while True:
        await asyncio.sleep(2.0)
        now = process.memory_info().rss
        if now - last < 2**20 or time.monotonic() > deadline:
            return now
        last = now


async def stalled_watchers(
    gateway_pid: int, address: str, run_id: str, count: int, readers: int
) -> StalledResult:
    """Opens ``count`` watches of a finished run that read nothing, measures the gateway's RSS
    growth, then reads ``readers`` of them to the end."""
    gateway = psutil.Process(gateway_pid)
    before = await _settled_rss(gateway)
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        address,
        run_id,
        str(count),
        str(readers),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert client.stdin is not None and client.stdout is not None
    try:
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        assert line == b"open\n", line
        stalled = await _settled_rss(gateway)
        client.stdin.write(b"read\n")
        await client.stdin.drain()
        line = await asyncio.wait_for(client.stdout.readline(), 1800)
        received = json.loads(line)
    finally:
        if client.returncode is None:
            client.kill()
        await client.wait()
    return StalledResult(before, stalled, received)
