"""The gateway's HTTP side: first paint of the run view, SSE replay vs gRPC replay, RSS per stream.

The gateway runs as its own process (``python -m gateway --http-port 0``, SQLite file store)
over the scripted fake trainer (in this process; it sends an imitation motion of 60 frames x 11
joints every 10 episodes, as the real provider does). Two 5000-episode unpaced runs are made
first. Figures:

(a) time to first paint of the run view of the first run in headless Chromium: from navigation
    start to the chart having drawn 5000 points (the page's ``performance.now()`` at that
    drawing); the first load (nothing cached: every motion written to JSON) and the median of
    the next 3 (the HTTP side's event cache holds the motions);
(b) replay of the second run's 5000 episodes to one client: ``GET /v1/runs/{id}/events``
    (episodes/s, bytes), first (event cache cold) and median of the next 3, vs ``WatchRun``
    over gRPC (median of 3, after one that fills the store's page cache), and the ratios;
(c) the gateway's RSS before and with 100 SSE connections open on a live run.

Run: ``.venv/bin/python bench/http_sse.py`` (about half a minute; (a) needs Chromium and
chromium-driver, and is skipped with a note without them).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import psutil  # noqa: E402

from tests.fakes.fake_trainer import FakeTrainer  # noqa: E402
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

EPISODES = 5000
REPEATS = 3
STREAMS = 100
TIMEOUT = aiohttp.ClientTimeout(total=120)


async def _start_gateway(trainer: str, db: str) -> tuple[asyncio.subprocess.Process, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--port",
        "0",
        "--http-port",
        "0",
        "--trainer",
        trainer,
        "--db",
        db,
        "--log-level",
        "WARNING",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    lines = [(await asyncio.wait_for(proc.stdout.readline(), 60)).decode() for _ in range(2)]
    grpc_line = re.fullmatch(r"gateway listening on (\S+)\n", lines[0])
    http_line = re.fullmatch(r"gateway http on (\S+)\n", lines[1])
    assert grpc_line and http_line, lines
    return proc, grpc_line.group(1), http_line.group(1)


async def _create(
    session: aiohttp.ClientSession, url: str, episodes: int, rate: float
) -> dict[str, Any]:
    body = {
        "task": {"imitation": {"rigName": "stickman", "clipName": "wave"}},
        "config": {"maxEpisodes": episodes, "seed": "1"},
        "episodesPerSecond": rate,
    }
    async with session.post(f"{url}/v1/runs", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return dict((await reply.json())["run"])


async def _wait_state(
    session: aiohttp.ClientSession, url: str, run_id: str, state: str, episode: int = 0
) -> None:
    async with asyncio.timeout(300):
        while True:
            async with session.get(f"{url}/v1/runs/{run_id}") as reply:
                run = (await reply.json())["run"]
            if run["state"] == state and int(run.get("episode", 0)) >= episode:
                return
            await asyncio.sleep(0.1)


async def _sse_replay(session: aiohttp.ClientSession, url: str, run_id: str) -> tuple[float, int]:
    """Seconds and bytes to read the whole stream (events counted, not decoded)."""
    start = time.perf_counter()
    size = episodes = 0
    tail = b""
    async with session.get(f"{url}/v1/runs/{run_id}/events") as reply:
        assert reply.status == 200
        async for chunk in reply.content.iter_any():
            size += len(chunk)
            window = tail + chunk
            episodes += window.count(b"\nevent: episode\n")
            tail = window[-20:]
    elapsed = time.perf_counter() - start
    assert episodes == EPISODES, episodes
    return elapsed, size


async def _grpc_replay(address: str, run_id: str) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        start = time.perf_counter()
        episodes = 0
        call = stub.WatchRun(gateway_service_pb2.WatchRunRequest(run_id=run_id), timeout=120)
        async for message in call:
            kind = message.WhichOneof("event")
            episodes += len(message.batch.episodes) if kind == "batch" else kind == "episode"
        elapsed = time.perf_counter() - start
    assert episodes == EPISODES, episodes
    return elapsed


def _first_paint(url: str, run_id: str) -> list[float] | str:
    """Milliseconds from navigation start to 5000 points drawn, per load; or why not."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        return "skipped: chromium and chromium-driver are not installed (make install, as root)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="bench-chromium-")
    for flag in (
        "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-quic "
        "--no-first-run --disable-background-networking --disable-component-update "
        f"--disable-sync --window-size=1400,1000 --user-data-dir={profile}"
    ).split():
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    times = []
    try:
        for _ in range(REPEATS + 1):
            browser.get("about:blank")
            browser.get(f"{url}/#/runs/{run_id}")
            drawn = WebDriverWait(browser, 120, poll_frequency=0.05).until(
                lambda b: b.execute_script(
                    "const d = document.getElementById('curve').dataset;"
                    f"return d.episodes === '{EPISODES}' ? d.drawnAt : null;"
                )
            )
            times.append(float(drawn))
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return times


async def _hold_streams(url: str, run_id: str, count: int, ready: asyncio.Event) -> None:
    """Opens ``count`` streams; sets ``ready`` once each has had caught_up; holds them open."""
    connector = aiohttp.TCPConnector(limit=0)
    caught = 0
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:

        async def one() -> None:
            nonlocal caught
            async with session.get(f"{url}/v1/runs/{run_id}/events") as reply:
                assert reply.status == 200
                seen = b""
                async for chunk in reply.content.iter_any():
                    if seen is not None:
                        seen += chunk
                        if b"event: caught_up" in seen:
                            seen = None  # type: ignore[assignment]
                            caught += 1
                            if caught == count:
                                ready.set()

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


def _mib(value: float) -> str:
    return f"{value / (1 << 20):.1f} MiB"


async def main() -> None:
    fake = FakeTrainer(slots=4)
    trainer = fake.start()
    tmp = tempfile.mkdtemp(prefix="bench-http-")
    proc, address, url = await _start_gateway(trainer, os.path.join(tmp, "gw.sqlite3"))
    gateway = psutil.Process(proc.pid)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            runs = [await _create(session, url, EPISODES, -1.0) for _ in range(2)]
            for run in runs:
                await _wait_state(session, url, run["id"], "STATE_DONE")
            print(
                f"http_sse: finished {EPISODES}-episode imitation runs (a motion of 60 frames x "
                "11 joints every 10 episodes), the gateway in its own process, SQLite file store"
            )
            paint = await asyncio.to_thread(_first_paint, url, runs[0]["id"])
            if isinstance(paint, str):
                print(f"  (a) time to first paint of the run view: {paint}")
            else:
                print(
                    f"  (a) time to first paint of the run view (navigation -> {EPISODES} points "
                    f"drawn): first load {paint[0]:.0f} ms; then {statistics.median(paint[1:]):.0f}"
                    f" ms (median of {REPEATS}: " + ", ".join(f"{t:.0f}" for t in paint[1:]) + ")"
                )
            run_id = runs[1]["id"]
            await _grpc_replay(address, run_id)  # the store's page cache, for both
            sse = [await _sse_replay(session, url, run_id) for _ in range(REPEATS + 1)]
            grpc_s = statistics.median([await _grpc_replay(address, run_id) for _ in range(3)])
            cold_s = sse[0][0]
            warm_s = statistics.median(t for t, _ in sse[1:])
            print(
                f"  (b) replay of {EPISODES} episodes to one client ({sse[0][1] / 1e6:.1f} MB of "
                f"events): SSE first {cold_s * 1000:.0f} ms = {EPISODES / cold_s:,.0f} "
                f"episodes/s, then {warm_s * 1000:.0f} ms = {EPISODES / warm_s:,.0f} episodes/s;"
                f" gRPC WatchRun {grpc_s * 1000:.0f} ms = {EPISODES / grpc_s:,.0f} episodes/s;"
                f" SSE / gRPC throughput {grpc_s / cold_s:.3f} first, {grpc_s / warm_s:.3f} then"
            )
            live = await _create(session, url, EPISODES, 2.0)
            await _wait_state(session, url, live["id"], "STATE_RUNNING", episode=10)
            await asyncio.sleep(1.0)
            before = gateway.memory_info().rss
            ready = asyncio.Event()
            holder = asyncio.create_task(_hold_streams(url, live["id"], STREAMS, ready))
            await asyncio.wait_for(ready.wait(), 60)
            await asyncio.sleep(2.0)
            during = gateway.memory_info().rss
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            print(
                f"  (c) gateway RSS: {_mib(before)} before, {_mib(during)} with {STREAMS} SSE "
                f"connections open on a live run (+{(during - before) / STREAMS / 1024:.0f} KiB "
                "per connection)"
            )
            async with session.post(f"{url}/v1/runs/{live['id']}:stop", json={}) as reply:
                assert reply.status == 200, await reply.text()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
        fake.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
