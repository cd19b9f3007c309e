"""The gateway's HTTP side: first paint of the run view, SSE replay vs gRPC replay, RSS per stream.

The gateway runs as its own process (``python -m gateway --http-port 0``, SQLite file store)
over the scripted fake trainer (in this process; it sends an imitation motion of 60 frames x 11
joints every 10 episodes, as the real provider does). Three such 5000-episode unpaced runs are
made first, and a fourth whose only motion is on its last episode (scalars). Figures:

(a) time to first paint of the run view of the first run in headless Chromium: from navigation
    start to the chart having drawn 5000 points (the page's ``performance.now()`` at that
    drawing); the first load (nothing cached: every motion written to JSON) and the median of
    the next 3 (the HTTP side's event cache holds the motions);
(b) replay of a run's 5000 episodes to one client, side by side on the same run: ``WatchRun``
    over gRPC, ``GET /v1/runs/{id}/events`` cold (the first replay: the HTTP side's event cache
    holds none of the run) and warm (the median of the next 5, each right after one of the 5
    ``WatchRun`` replays whose median is shown), in episodes/s, and SSE / ``WatchRun`` for both;
    first, one ``WatchRun`` replay fills the store's page cache for both. On the second run, on
    the scalar run, and on the third run with ``?view=scalars`` beside a ``WatchRun`` with
    ``view=EPISODE_VIEW_SCALARS`` (where the gateway serves that view);
(c) the gateway's RSS before and with 100 SSE connections open on a live run.

Run: ``.venv/bin/python bench/http_sse.py`` (about a minute; (a) needs Chromium and
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

from tests.fakes.fake_trainer import FakeTrainer, Script  # noqa: E402
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

EPISODES = 5000
REPEATS = 3
REPLAYS = 5
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


async def _sse_replay(
    session: aiohttp.ClientSession, url: str, run_id: str, query: str = ""
) -> tuple[float, int] | str:
    """Seconds and bytes to read the whole stream (events counted, not decoded); or the error
    the gateway answered."""
    start = time.perf_counter()
    size = episodes = 0
    tail = b""
    async with session.get(f"{url}/v1/runs/{run_id}/events{query}") as reply:
        if reply.status != 200:
            return f"HTTP {reply.status}: {(await reply.json())['error']['message']}"
        async for chunk in reply.content.iter_any():
            size += len(chunk)
            window = tail + chunk
            episodes += window.count(b"\nevent: episode\n")
            # One byte short of the marker: a marker across two chunks is counted once, and
            # one counted whole in this window cannot be counted again in the next.
            tail = window[-(len(b"\nevent: episode\n") - 1) :]
    elapsed = time.perf_counter() - start
    assert episodes == EPISODES, episodes
    return elapsed, size


async def _grpc_replay(address: str, run_id: str, scalars: bool = False) -> tuple[float, int]:
    """Seconds to read the whole watch, and how many episodes came with a detail."""
    view = {"view": 2} if scalars else {}  # EPISODE_VIEW_SCALARS
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        start = time.perf_counter()
        episodes = []
        request = gateway_service_pb2.WatchRunRequest(run_id=run_id, **view)
        async for message in stub.WatchRun(request, timeout=120):
            kind = message.WhichOneof("event")
            if kind == "batch":
                episodes.extend(message.batch.episodes)
            elif kind == "episode":
                episodes.append(message.episode)
        elapsed = time.perf_counter() - start
    assert len(episodes) == EPISODES, len(episodes)
    return elapsed, sum(e.WhichOneof("detail") is not None for e in episodes)


async def _side_by_side(
    session: aiohttp.ClientSession, url: str, address: str, run_id: str, scalars: bool = False
) -> tuple[float, float, float, int] | str:
    """Seconds of WatchRun (median), SSE cold, SSE warm (median), and the SSE bytes of one
    replay; or why they were not measured."""
    if scalars and "view" not in gateway_service_pb2.WatchRunRequest.DESCRIPTOR.fields_by_name:
        return "not measured: WatchRunRequest has no view"
    _, details = await _grpc_replay(address, run_id, scalars)  # the store's page cache, for both
    if scalars and details:
        return f"not measured: WatchRun with EPISODE_VIEW_SCALARS sent {details} details"
    query = "?view=scalars" if scalars else ""
    cold = await _sse_replay(session, url, run_id, query)
    if isinstance(cold, str):
        return f"not measured: SSE answered {cold}"
    warm, watch = [], []
    for _ in range(REPLAYS):  # interleaved: both see the same machine
        watch.append((await _grpc_replay(address, run_id, scalars))[0])
        replay = await _sse_replay(session, url, run_id, query)
        assert not isinstance(replay, str), replay
        warm.append(replay[0])
    return statistics.median(watch), cold[0], statistics.median(warm), cold[1]


def _table(rows: list[tuple[str, tuple[float, float, float, int] | str]]) -> str:
    def rate(seconds: float) -> str:
        return f"{EPISODES / seconds:,.0f}/s"

    lines = [
        f"      {'run':34} {'WatchRun':>11} {'SSE cold':>11} {'SSE warm':>11} "
        f"{'cold/WR':>8} {'warm/WR':>8} {'SSE MB':>7}"
    ]
    for name, result in rows:
        if isinstance(result, str):
            lines.append(f"      {name:34} {result}")
            continue
        watch, cold, warm, size = result
        lines.append(
            f"      {name:34} {rate(watch):>11} {rate(cold):>11} {rate(warm):>11} "
            f"{watch / cold:>8.3f} {watch / warm:>8.3f} {size / 1e6:>7.2f}"
        )
    return "\n".join(lines)


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
            runs = [await _create(session, url, EPISODES, -1.0) for _ in range(3)]
            for run in runs:
                await _wait_state(session, url, run["id"], "STATE_DONE")
            # The next Train call: a motion on the last episode only.
            fake.push(Script(detail_every=EPISODES + 1))
            scalar_run = await _create(session, url, EPISODES, -1.0)
            await _wait_state(session, url, scalar_run["id"], "STATE_DONE")
            print(
                f"http_sse: finished {EPISODES}-episode imitation runs (a motion of 60 frames x "
                "11 joints every 10 episodes, or on the last only), the gateway in its own "
                "process, SQLite file store"
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
            rows = [
                ("motion every 10th", await _side_by_side(session, url, address, runs[1]["id"])),
                (
                    "scalars (motion on the last only)",
                    await _side_by_side(session, url, address, scalar_run["id"]),
                ),
                (
                    "motion every 10th, view=scalars",
                    await _side_by_side(session, url, address, runs[2]["id"], scalars=True),
                ),
            ]
            print(
                f"  (b) replay of {EPISODES} episodes to one client, episodes/s (WatchRun and SSE "
                f"warm: median of {REPLAYS}, interleaved; SSE cold: the first replay)\n"
                + _table(rows)
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
