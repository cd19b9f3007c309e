"""The gateway's HTTP side: first paint of the run view, SSE replay vs gRPC replay, RSS per stream.

The gateway runs as its own process (``python -m gateway --http-port 0``, SQLite file store)
over the scripted fake trainer (in this process; it sends an imitation motion of 60 frames x 11
joints every 10 episodes, as the real provider does). Three such 5000-episode unpaced runs are
made first, and a fourth whose only motion is on its last episode (scalars). Figures:

(a) time to first paint of the run view of the first run in headless Chromium, beside issue
    26's goal (<= 300 ms): from navigation start to the chart's first drawing of the 5000
    episodes (the page's ``performance.now()`` then); the first load (nothing cached) and the
    median of the next 9. The page of this tree and that of ``BENCH_BEFORE`` (a git revision,
    default ``PAGE_BEFORE``: its ``gateway/http/app.py`` and ``static/``, served by a second
    gateway process of this tree over a copy of the store), each in a browser of its own, in
    turns. For each: the bundle (the page and its ``/static/`` files on the first load: files,
    bytes on the wire, bytes of the files), the requests made before the first drawing, V8's
    thread time parsing and compiling the scripts and evaluating the modules (a load traced
    over the DevTools protocol, cold in a fresh browser and warm after the timed loads), and
    the JS heap at the first drawing;
(b) replay of a run's 5000 episodes to one client, side by side on the same run: ``WatchRun``
    over gRPC, ``GET /v1/runs/{id}/events`` cold (the first replay: the HTTP side's event cache
    holds none of the run) and warm (the median of the next 5, each right after one of the 5
    ``WatchRun`` replays whose median is shown), in episodes/s, and SSE / ``WatchRun`` for both;
    first, one ``WatchRun`` replay fills the store's page cache for both. On the second run, on
    the scalar run, and on the third run with ``?view=scalars`` beside a ``WatchRun`` with
    ``view=EPISODE_VIEW_SCALARS`` (where the gateway serves that view);
(c) the gateway's RSS before and with 100 SSE connections open on a live run.

Run: ``.venv/bin/python bench/http_sse.py`` (about a minute and a half; (a) needs Chromium and
chromium-driver, and is skipped with a note without them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import psutil  # noqa: E402

from bench._revision import export_revision  # noqa: E402
from tests.fakes.fake_trainer import FakeTrainer, Script  # noqa: E402
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

EPISODES = 5000
LOADS = 9  # timed loads of the run view after the first, per page
PAINT_GOAL_MS = 300.0  # issue 26: the run view of a 5000-episode run
#: The page (a git revision's app.py and static/) whose first paint (a) compares with the
#: working tree's: the last revision before the page asked for its data early and preloaded
#: every module.
PAGE_BEFORE = os.environ.get("BENCH_BEFORE", "176da07")
REPLAYS = 5
STREAMS = 100
TIMEOUT = aiohttp.ClientTimeout(total=120)


async def _start_gateway(
    trainer: str, db: str, prelude: str = ""
) -> tuple[asyncio.subprocess.Process, str, str]:
    """A gateway process (``python -m gateway``, after ``prelude``): it, its gRPC address and its
    HTTP URL."""
    code = (
        f"{prelude}\nimport runpy\nrunpy.run_module('gateway', run_name='__main__', alter_sys=True)"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
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


@dataclass
class PageLoads:
    """The run view of one page, loaded in its own browser."""

    name: str
    url: str
    #: ms from navigation to the chart's first drawing: the first load (nothing cached), then
    #: each next load
    paints: list[float] = field(default_factory=list)
    #: the first load's assets: (path, bytes on the wire, bytes of the file)
    assets: list[tuple[str, int, int]] = field(default_factory=list)
    #: requests the first load made before its first drawing, by path
    requests: list[str] = field(default_factory=list)
    #: V8's work on the page's scripts, cold (a fresh browser) and warm (after the timed
    #: loads): ms of parse and compile, and of module evaluation (thread time)
    compile_ms: tuple[float, float] = (0.0, 0.0)
    evaluate_ms: tuple[float, float] = (0.0, 0.0)
    heap_bytes: int = 0


def _chromium(profile: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (
        "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-quic "
        "--no-first-run --disable-background-networking --disable-component-update "
        f"--disable-sync --window-size=1400,1000 --user-data-dir={profile}"
    ).split():
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


#: What a load reads once the chart has drawn the run: the first drawing's time, the assets
#: (the page and everything under /static/) and the requests made before that drawing.
_LOADED = """
const d = document.getElementById('curve').dataset;
if (d.episodes !== arguments[0]) return null;
const drawn = Number(d.firstPaintMs);
const page = performance.getEntriesByType('navigation')[0];
const entries = performance.getEntriesByType('resource');
const path = (e) => e.name.slice(location.origin.length);
const statics = entries.filter((e) => path(e).startsWith('/static/')).map((e) => [e, path(e)]);
return {
  paint: drawn,
  assets: [[page, '/'], ...statics].map(([e, p]) => [p, e.transferSize, e.decodedBodySize]),
  requests: entries.filter((e) => e.startTime < drawn).map(path),
  heap: performance.memory ? performance.memory.usedJSHeapSize : 0,
};
"""


def _load(browser: Any, url: str, run_id: str) -> dict[str, Any]:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get("about:blank")
    browser.get(f"{url}/#/runs/{run_id}")
    found: dict[str, Any] = WebDriverWait(browser, 120, poll_frequency=0.02).until(
        lambda b: b.execute_script(_LOADED, str(EPISODES))
    )
    return found


def _v8_work(browser: Any, url: str, run_id: str) -> tuple[float, float]:
    """One load traced (Chrome's trace over the DevTools protocol): ms of thread time V8 spent
    parsing and compiling the page's scripts (on any thread), and evaluating its modules."""

    async def traced() -> list[dict[str, Any]]:
        address = browser.capabilities["goog:chromeOptions"]["debuggerAddress"]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{address}/json/version") as reply:
                endpoint = (await reply.json())["webSocketDebuggerUrl"]
            async with session.ws_connect(endpoint, max_msg_size=0) as ws:

                async def call(ident: int, method: str, **params: Any) -> None:
                    await ws.send_json({"id": ident, "method": method, "params": params})

                config = {"includedCategories": ["v8", "disabled-by-default-v8.compile"]}
                await call(1, "Tracing.start", traceConfig=config, transferMode="ReportEvents")
                while (await ws.receive_json()).get("id") != 1:
                    pass
                await asyncio.to_thread(_load, browser, url, run_id)
                await call(2, "Tracing.end")
                events: list[dict[str, Any]] = []
                while True:
                    message = await ws.receive_json()
                    if message.get("method") == "Tracing.dataCollected":
                        events += message["params"]["value"]
                    elif message.get("method") == "Tracing.tracingComplete":
                        return events

    events = asyncio.run(traced())
    # The page's renderer: the process that compiled its scripts.
    pids = {
        e["pid"]
        for e in events
        if str(e.get("args", {}).get("data", {}).get("url", "")).startswith(url)
    }

    def cpu_ms(*names: str) -> float:
        work = (e for e in events if e.get("pid") in pids and e.get("name") in names)
        return sum(e.get("tdur", e.get("dur", 0)) for e in work) / 1000

    compile_ms = cpu_ms("v8.parseOnBackgroundParsing", "v8.compile", "v8.compileModule")
    return compile_ms, cpu_ms("v8.evaluateModule")


def _first_paint(pages: list[PageLoads], run_id: str) -> str | None:
    """Fills each page's loads: each page in a browser of its own (a fresh profile), the pages
    in turns; then one load traced per page cold (another fresh browser) and warm; or why not."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "skipped: chromium and chromium-driver are not installed (make install, as root)"
    profiles = [tempfile.mkdtemp(prefix="bench-chromium-") for _ in range(2 * len(pages))]
    browsers = []
    try:
        browsers = [_chromium(profile) for profile in profiles[: len(pages)]]
        for turn in range(LOADS + 1):
            for page, browser in zip(pages, browsers, strict=True):
                found = _load(browser, page.url, run_id)
                page.paints.append(float(found["paint"]))
                page.heap_bytes = int(found["heap"])
                if turn == 0:
                    page.assets = [(p, int(wire), int(size)) for p, wire, size in found["assets"]]
                    page.requests = list(found["requests"])
        for page, browser, profile in zip(pages, browsers, profiles[len(pages) :], strict=True):
            warm = _v8_work(browser, page.url, run_id)
            cold_browser = _chromium(profile)
            try:
                cold = _v8_work(cold_browser, page.url, run_id)
            finally:
                cold_browser.quit()
            page.compile_ms = (cold[0], warm[0])
            page.evaluate_ms = (cold[1], warm[1])
    finally:
        for browser in browsers:
            browser.quit()
        for profile in profiles:
            shutil.rmtree(profile, ignore_errors=True)
    return None


def _paint_table(pages: list[PageLoads]) -> str:
    lines = [
        f"      {'page':22} {'first load':>10} {'then':>7}  {'loads after the first':26} "
        f"{'requests before the paint'}"
    ]
    for page in pages:
        then = statistics.median(page.paints[1:])
        each = ", ".join(f"{t:.0f}" for t in page.paints[1:])
        asked = [p.split("?")[0].rsplit("/", 1)[-1] or p for p in page.requests]
        lines.append(
            f"      {page.name:22} {page.paints[0]:>7.0f} ms {then:>4.0f} ms  {each:26} "
            f"{len(asked)}: {' '.join(asked)}"
        )
    lines.append(
        f"      {'page':22} {'bundle: files':>13} {'on the wire':>12} {'file bytes':>11} "
        f"{'parse+compile cold/warm':>24} {'module evaluation cold/warm':>28} {'JS heap':>8}"
    )
    for page in pages:
        wire = sum(w for _, w, _ in page.assets)
        size = sum(s for _, _, s in page.assets)
        lines.append(
            f"      {page.name:22} {len(page.assets):>13} {wire / 1024:>8.1f} KiB "
            f"{size / 1024:>7.1f} KiB {page.compile_ms[0]:>11.1f} / {page.compile_ms[1]:>4.1f} ms "
            f"{page.evaluate_ms[0]:>15.1f} / {page.evaluate_ms[1]:>4.1f} ms "
            f"{page.heap_bytes / (1 << 20):>4.1f} MiB"
        )
    return "\n".join(lines)


def _export_page(rev: str, tmp: str) -> str | None:
    """The page of git revision ``rev`` (``gateway/http/app.py`` and ``static/``) in a directory
    of its own: the path of its ``app.py``; None when the revision is not in this checkout."""
    root = export_revision(
        rev, ["gateway/http/app.py", "gateway/http/static"], os.path.join(tmp, f"page-{rev}")
    )
    return None if root is None else os.path.join(root, "gateway", "http", "app.py")


def _page_prelude(app_py: str) -> str:
    """Code that makes a gateway process serve the HTTP side of ``app_py`` (and so the page
    beside it) over this tree's gateway."""
    # The package first (its modules import it), then its app module replaced, module and names.
    return (
        "import importlib.util, sys\n"
        "import gateway.http\n"
        f"spec = importlib.util.spec_from_file_location('gateway.http.app', {app_py!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "sys.modules['gateway.http.app'] = gateway.http.app = module\n"
        "gateway.http.HttpFace, gateway.http.build_app = module.HttpFace, module.build_app\n"
    )


def _copy_store(source: str, target: str) -> None:
    """A consistent copy of a SQLite store that a gateway has open (the backup API)."""
    with (
        contextlib.closing(sqlite3.connect(source)) as src,
        contextlib.closing(sqlite3.connect(target)) as dst,
    ):
        src.backup(dst)


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


async def _paint(trainer: str, tmp: str, url: str, run_id: str) -> None:
    """(a): the working tree's page (this gateway) beside ``PAGE_BEFORE``'s, served by a second
    gateway process over a copy of the store."""
    pages = [PageLoads("after (this tree)", url)]
    before: asyncio.subprocess.Process | None = None
    app_py = _export_page(PAGE_BEFORE, tmp)
    if app_py is None:
        print(f"  (no revision {PAGE_BEFORE} in this checkout: no 'before' page)")
    else:
        db = os.path.join(tmp, "before.sqlite3")
        _copy_store(os.path.join(tmp, "gw.sqlite3"), db)
        before, _, before_url = await _start_gateway(trainer, db, _page_prelude(app_py))
        pages.insert(0, PageLoads(f"before ({PAGE_BEFORE})", before_url))
    try:
        skipped = await asyncio.to_thread(_first_paint, pages, run_id)
    finally:
        if before is not None:
            before.terminate()
            await asyncio.wait_for(before.wait(), 30)
    if skipped:
        print(f"  (a) time to first paint of the run view: {skipped}")
        return
    after = statistics.median(pages[-1].paints[1:])
    print(
        f"  (a) run view of the {EPISODES}-episode run in headless Chromium, first paint: from "
        "navigation to the chart's first drawing; each page in a browser of its own, the pages "
        f"in turns; the first load (nothing cached) and the median of the next {LOADS}; the "
        "bundle: the page and its /static/ files on the first load; V8's thread time on them "
        "(a traced load in a fresh browser, and one after the timed loads)\n" + _paint_table(pages)
    )
    print(
        f"      {'ok  ' if after <= PAINT_GOAL_MS else 'MISS'} first paint <= "
        f"{PAINT_GOAL_MS:.0f} ms (issue 26): {after:.0f} ms (median), {pages[-1].paints[0]:.0f} ms "
        "first load"
    )


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
            await _paint(trainer, tmp, url, runs[0]["id"])
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
