"""Gateway fan-out benchmark: replay, live latency, idle-watcher memory and ingest cost.

Three processes on one machine: this one runs the servers under test (the gateway, and a bare
``grpc.aio`` server as the baseline), a child runs the scripted fake trainer, another child runs
every watcher (gRPC clients parse every message). Figures:

(a/b) episodes/s of a 5000-episode history streamed to 1, 10 and 100 watchers by a bare aio
      server (one episode per message, and batches of 50) vs the gateway replaying a finished
      run; ratio gateway / bare-batched. Targets: >= 100k episodes/s at 100 watchers and
      >= 0.5x bare-batched. Then the same replay from a second gateway serving TLS and
      checking a bearer token on every call (``--tls-cert``, ``--auth-tokens``; trustme
      certificates); ratio TLS + token / plaintext. Target >= 0.7x.
(c)   live latency, trainer send -> watcher receive, 100 watchers, unpaced run, the trainer
      sending 200 and 50 episodes/s; the gateway's CPU per episode and the CPU use of the
      gateway and watcher processes (100 % = one core). Goal at 200 episodes/s: p99 <= 15 ms
      with no more gateway CPU per episode than before. Each configuration is a gateway process
      of its own (``python -m gateway``): *before* runs the code of ``BENCH_BEFORE`` (a git
      revision, exported to a temporary directory; default ``LIVE_BEFORE``), *after* the
      working tree, and *after, uvloop* the working tree on uvloop's loop when uvloop is
      importable. The configurations take turns, ``LIVE_ROUNDS`` rounds, and each figure is
      the median of its rounds: load from elsewhere on the machine slows them alike.
(d)   gateway RSS per idle watcher, 500 watchers on a quiet run. Target < 100 KB.
(e)   ingest episodes/s of an unpaced 5000-episode run, --db file vs :memory:. Target: the
      file store costs <= 15 %.

Run: ``.venv/bin/python bench/gateway_fanout.py`` (about three minutes); ``BENCH_ONLY=replay``
runs (a/b) and the TLS + token row only, ``BENCH_ONLY=live`` (c) only.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402
import psutil  # noqa: E402

from bench._revision import export_revision  # noqa: E402
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc  # noqa: E402

EPISODES = 5000
BARE_METHOD = "/bench.Bare/Stream"
WATCHER_COUNTS = (1, 10, 100)
ONLY = os.environ.get("BENCH_ONLY", "")  # e.g. "live" for a quick experiment
LIVE_WATCHERS = int(os.environ.get("BENCH_LIVE_WATCHERS", "100"))
# (seconds between trainer episodes, episodes): 200/s and 50/s
LIVE_RUNS = ((0.005, 1000), (0.02, 300))
LIVE_ROUNDS = int(os.environ.get("BENCH_LIVE_ROUNDS", "3"))
#: The gateway the live rows compare with: the last revision before the live path took its
#: wake-ups without asyncio.timeout and shared one event per wake-up.
LIVE_BEFORE = os.environ.get("BENCH_BEFORE", "22cb962")
LIVE_P99_GOAL_MS = 15.0
IDLE_WATCHERS = 500
SECURE_REPEATS = 5
CHANNELS = 10


def _task() -> episode_pb2.TrainTask:
    return episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
    )


# -- trainer process --------------------------------------------------------------------------


def _trainer_main(conn: Connection) -> None:
    from tests.fakes.fake_trainer import FakeTrainer, Script

    fake = FakeTrainer(slots=64)
    conn.send(fake.start())
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "release":  # let the held run produce its first episode
            fake.default.release.set()
        else:  # (seconds between episodes, hold before episode 1?) for the next calls
            interval, hold = msg
            fake.default = Script(interval=interval, hold_at=1 if hold else None)
        conn.send("ok")
    fake.kill()


# -- watcher process --------------------------------------------------------------------------


def _channels(port: int, ca: bytes | None = None) -> list[grpc.aio.Channel]:
    # Separate connections, as separate browsers/services would have.
    options = (("grpc.use_local_subchannel_pool", 1),)
    if ca is not None:
        credentials = grpc.ssl_channel_credentials(ca)
        return [
            grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
            for _ in range(CHANNELS)
        ]
    address = f"127.0.0.1:{port}"
    return [grpc.aio.insecure_channel(address, options=options) for _ in range(CHANNELS)]


def _count(message: gateway_service_pb2.WatchRunResponse) -> int:
    kind = message.WhichOneof("event")
    if kind == "episode":
        return 1
    if kind == "batch":
        return len(message.batch.episodes)
    return 0


async def _watch_all(
    port: int, run_id: str, watchers: int, ca: bytes | None = None, token: str | None = None
) -> tuple[float, int]:
    channels = _channels(port, ca)
    for ch in channels:
        await ch.channel_ready()
    stubs = [gateway_service_pb2_grpc.GatewayServiceStub(ch) for ch in channels]
    metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def one(i: int) -> int:
        n = 0
        call = stubs[i % CHANNELS].WatchRun(
            gateway_service_pb2.WatchRunRequest(run_id=run_id), metadata=metadata
        )
        async for msg in call:
            n += _count(msg)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(watchers)))
    elapsed = time.perf_counter() - start
    for ch in channels:
        await ch.close()
    return elapsed, sum(counts)


async def _bare_all(port: int, batch: int, watchers: int) -> tuple[float, int]:
    channels = _channels(port)
    for ch in channels:
        await ch.channel_ready()
    methods = [
        ch.unary_stream(
            BARE_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=gateway_service_pb2.WatchRunResponse.FromString,
        )
        for ch in channels
    ]

    async def one(i: int) -> int:
        n = 0
        async for msg in methods[i % CHANNELS](str(batch).encode()):
            n += _count(msg)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(watchers)))
    elapsed = time.perf_counter() - start
    for ch in channels:
        await ch.close()
    return elapsed, sum(counts)


async def _live(
    port: int, run_id: str, watchers: int, ready: Any
) -> tuple[list[tuple[int, float]], float]:
    channels = _channels(port)
    for ch in channels:
        await ch.channel_ready()
    stubs = [gateway_service_pb2_grpc.GatewayServiceStub(ch) for ch in channels]
    latencies: list[tuple[int, float]] = []
    caught = 0
    all_caught = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal caught
        call = stubs[i % CHANNELS].WatchRun(gateway_service_pb2.WatchRunRequest(run_id=run_id))
        async for msg in call:
            kind = msg.WhichOneof("event")
            now = time.time_ns()
            if kind == "caught_up":
                caught += 1
                if caught == watchers:
                    all_caught.set()
            elif kind == "episode":
                latencies.append(
                    (msg.episode.episode, (now - msg.episode.produce_time.ToNanoseconds()) / 1e6)
                )
            elif kind == "batch":
                for ep in msg.batch.episodes:
                    latencies.append((ep.episode, (now - ep.produce_time.ToNanoseconds()) / 1e6))

    tasks = [asyncio.create_task(one(i)) for i in range(watchers)]
    await all_caught.wait()
    ready()
    cpu = time.process_time()
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu
    for ch in channels:
        await ch.close()
    return latencies, cpu


async def _idle(port: int, run_id: str, watchers: int, conn: Connection) -> None:
    channels = _channels(port)
    for ch in channels:
        await ch.channel_ready()
    stubs = [gateway_service_pb2_grpc.GatewayServiceStub(ch) for ch in channels]
    caught = asyncio.Event()
    count = 0

    async def one(i: int) -> None:
        nonlocal count
        call = stubs[i % CHANNELS].WatchRun(gateway_service_pb2.WatchRunRequest(run_id=run_id))
        async for msg in call:
            if msg.WhichOneof("event") == "caught_up":
                count += 1
                if count == watchers:
                    caught.set()

    tasks = [asyncio.create_task(one(i)) for i in range(watchers)]
    await caught.wait()
    conn.send("ready")
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close()


def _watcher_main(conn: Connection) -> None:
    while True:
        job = conn.recv()
        if job is None:
            break
        kind = job[0]
        if kind == "replay":
            conn.send(asyncio.run(_watch_all(*job[1:])))
        elif kind == "replay_tls":  # (kind, port, run_id, ca, token, watchers)
            port, run_id, ca, token, watchers = job[1:]
            conn.send(asyncio.run(_watch_all(port, run_id, watchers, ca, token)))
        elif kind == "bare":
            conn.send(asyncio.run(_bare_all(*job[1:])))
        elif kind == "live":  # (kind, port, run_id, watchers)
            port, run_id, watchers = job[1:]
            conn.send(asyncio.run(_live(port, run_id, watchers, lambda: conn.send("ready"))))
        elif kind == "idle":  # (kind, port, run_id, watchers)
            port, run_id, watchers = job[1:]
            asyncio.run(_idle(port, run_id, watchers, conn))
            conn.send("released")


# -- live latency (c): gateway processes ------------------------------------------------------


@dataclass
class LiveGateway:
    """One configuration of the live rows: ``python -m gateway`` from a code root, after
    ``prelude`` (Python statements run first in the process; the loop policy, say)."""

    name: str
    root: str
    prelude: str = ""
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    def start(self, trainer: str, tmp: str) -> None:
        """Starts the gateway process (its files in ``tmp``) and waits for its ready line."""
        flags = ["--port", "0", "--http-port", "-1", "--trainer", trainer, "--keepalive", "15"]
        flags += ["--db", os.path.join(tmp, "live.sqlite3")]
        flags += ["--checkpoint-store", os.path.join(tmp, "checkpoints")]
        flags += ["--log-level", "WARNING"]
        code = (
            f"{self.prelude}\nimport runpy, sys\nsys.argv[0] = 'gateway'\n"
            "runpy.run_module('gateway', run_name='__main__', alter_sys=True)"
        )
        # The root's own packages first (a revision's gateway, trainwire_ops and client).
        paths = [self.root, os.path.join(self.root, "clients"), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *flags], cwd=self.root, env=env, stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        match = re.search(r"listening on \S+:(\d+)", line)
        assert match, f"{self.name}: {line!r}"
        self.port = int(match.group(1))

    def cpu(self) -> float:
        """CPU seconds the process has used (all its threads)."""
        assert self.proc is not None
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        """SIGTERM, then waits for it to exit."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


@dataclass
class LiveRow:
    """One live run of one configuration."""

    p50: float
    p99: float
    max: float
    cpu_per_episode_ms: float
    gateway_cpu: float
    watcher_cpu: float


def _export(rev: str, tmp: str) -> str | None:
    """The gateway, trainwire_ops and client packages of git revision ``rev`` in a directory
    of their own; None when the revision is not in this checkout."""
    return export_revision(
        rev, ["gateway", "trainwire_ops", "clients/trainwire"], os.path.join(tmp, f"before-{rev}")
    )


def _live_configs(tmp: str) -> list[LiveGateway]:
    configs = []
    before = _export(LIVE_BEFORE, tmp)
    if before is None:
        print(f"(no revision {LIVE_BEFORE} in this checkout: no 'before' row)")
    else:
        configs.append(LiveGateway(f"before ({LIVE_BEFORE})", before))
    configs.append(LiveGateway("after", ROOT))
    if importlib.util.find_spec("uvloop") is not None:
        uvloop = "import asyncio, uvloop\nasyncio.set_event_loop_policy(uvloop.EventLoopPolicy())"
        configs.append(LiveGateway("after, uvloop", ROOT, uvloop))
    return configs


async def _live_run(
    gateway: LiveGateway,
    trainer_conn: Connection,
    watch_conn: Connection,
    interval: float,
    count: int,
) -> LiveRow:
    """One unpaced run of ``count`` episodes, one every ``interval`` s, watched live by
    ``LIVE_WATCHERS`` watchers. The trainer holds before episode 1 until every watcher has
    attached: all deliveries are live ones (none replayed from before attach)."""
    loop = asyncio.get_running_loop()
    trainer_conn.send((interval, True))
    trainer_conn.recv()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        live_id = await _create(gateway_service_pb2_grpc.GatewayServiceStub(channel), count)
    watch_conn.send(("live", gateway.port, live_id, LIVE_WATCHERS))
    assert await loop.run_in_executor(None, watch_conn.recv) == "ready"
    cpu = gateway.cpu()
    wall = time.perf_counter()
    trainer_conn.send("release")
    trainer_conn.recv()
    latencies, watch_cpu = await loop.run_in_executor(None, watch_conn.recv)
    wall = time.perf_counter() - wall
    cpu = gateway.cpu() - cpu
    ms = [x for _, x in latencies]
    assert len(ms) == count * LIVE_WATCHERS, (gateway.name, len(ms))
    q = statistics.quantiles(ms, n=100)
    return LiveRow(q[49], q[98], max(ms), cpu / count * 1000, cpu / wall, watch_cpu / wall)


async def _live_section(
    trainer: str,
    trainer_conn: Connection,
    watch_conn: Connection,
    tmp: str,
    configs: list[LiveGateway] | None = None,
) -> None:
    configs = configs or _live_configs(tmp)
    rows: dict[tuple[str, float], list[LiveRow]] = {}
    try:
        for index, gateway in enumerate(configs):
            files = os.path.join(tmp, f"live{index}")
            os.makedirs(files)
            gateway.start(trainer, files)
        for _ in range(LIVE_ROUNDS):
            for gateway in configs:
                for interval, count in LIVE_RUNS:
                    row = await _live_run(gateway, trainer_conn, watch_conn, interval, count)
                    rows.setdefault((gateway.name, interval), []).append(row)
    finally:
        for gateway in configs:
            gateway.stop()

    def median(name: str, interval: float, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rows[(name, interval)])

    print()
    print(
        f"live: {LIVE_WATCHERS} watchers, unpaced run, trainer send -> watcher receive; "
        f"medians of {LIVE_ROUNDS} rounds, configurations in turn"
    )
    print(
        f"{'rate, configuration':<36}{'p50':>10}{'p99':>10}{'max':>10}"
        f"{'gw CPU/ep':>12}{'CPU gw/watch':>14}"
    )
    for interval, _ in LIVE_RUNS:
        for gateway in configs:
            n, i = gateway.name, interval
            print(
                f"{f'{1 / i:g}/s, {n}':<36}"
                f"{median(n, i, 'p50'):>7.1f} ms{median(n, i, 'p99'):>7.1f} ms"
                f"{median(n, i, 'max'):>7.1f} ms{median(n, i, 'cpu_per_episode_ms'):>9.2f} ms"
                f"{median(n, i, 'gateway_cpu'):>9.0%}/{median(n, i, 'watcher_cpu'):.0%}"
            )
    fast = LIVE_RUNS[0][0]
    names = [g.name for g in configs]
    base = names[0]
    print()
    for n in names:
        p99 = median(n, fast, "p99")
        cpu = median(n, fast, "cpu_per_episode_ms")
        ratio = cpu / median(base, fast, "cpu_per_episode_ms")
        cost = "" if n == base else f", {ratio:.2f}x {base} (goal <= 1x)"
        print(
            f"{n}: live p99 {p99:.1f} ms (goal <= {LIVE_P99_GOAL_MS:g} ms), gateway CPU per "
            f"episode {cpu:.2f} ms{cost}; {1 / fast:g} episodes/s x {LIVE_WATCHERS} watchers"
        )


# -- servers (this process) -------------------------------------------------------------------


def _bare_server(messages: dict[int, list[gateway_service_pb2.WatchRunResponse]]) -> Any:
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        for message in messages[int(request)]:
            yield message

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=lambda b: b,
                response_serializer=gateway_service_pb2.WatchRunResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    return server, port


async def _ask(conn: Connection, job: Any) -> Any:
    conn.send(job)
    return await asyncio.get_running_loop().run_in_executor(None, conn.recv)


async def _create(stub: Any, episodes: int, rate: float = -1.0) -> str:
    reply = await stub.CreateRun(
        gateway_service_pb2.CreateRunRequest(
            task=_task(),
            config=episode_pb2.TrainConfig(max_episodes=episodes),
            episodes_per_second=rate,
        ),
        timeout=10,
    )
    return reply.run.id


async def _wait_finished(stub: Any, run_id: str) -> None:
    call = stub.WatchRun(
        gateway_service_pb2.WatchRunRequest(run_id=run_id, after_episode=EPISODES), timeout=300
    )
    async for msg in call:
        if msg.WhichOneof("event") == "finished":
            return


async def _ingest(trainer: str, db: str) -> float:
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    gateway = Gateway(GatewayConfig(port=0, trainers=(trainer,), db=db, heartbeat_timeout_s=30))
    port = await gateway.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(ch)
        start = time.perf_counter()
        run_id = await _create(stub, EPISODES)
        await _wait_finished(stub, run_id)
        elapsed = time.perf_counter() - start
    await gateway.stop()
    return EPISODES / elapsed


async def _secure_replay(
    trainer: str, tmp: str, watch_conn: Connection, plain_port: int, plain_run: str
) -> tuple[list[float], list[float]]:
    """Replay rates of the plaintext gateway and of a second one serving TLS and checking a
    viewer's token on every call, best of ``SECURE_REPEATS`` each, measured alternately."""
    import trustme

    from gateway.auth import Role
    from gateway.config import GatewayConfig
    from gateway.server import Gateway
    from gateway.tools.add_token import add_token

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = os.path.join(tmp, "server.pem"), os.path.join(tmp, "server.key")
    leaf.cert_chain_pems[0].write_to_path(cert)
    leaf.private_key_pem.write_to_path(key)
    tokens = os.path.join(tmp, "tokens")
    viewer = add_token(Path(tokens), "bench-viewer", Role.VIEWER)
    operator = add_token(Path(tokens), "bench-operator", Role.OPERATOR)
    config = GatewayConfig(
        port=0,
        trainers=(trainer,),
        db=os.path.join(tmp, "bench-tls.sqlite3"),
        keepalive_s=15,
        tls_cert=cert,
        tls_key=key,
        auth_tokens=tokens,
    )
    secure = Gateway(config)
    port = await secure.start()
    ca_pem = ca.cert_pem.bytes()
    channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca_pem))
    metadata = (("authorization", f"Bearer {operator}"),)
    stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
    reply = await stub.CreateRun(
        gateway_service_pb2.CreateRunRequest(
            task=_task(),
            config=episode_pb2.TrainConfig(max_episodes=EPISODES),
            episodes_per_second=-1.0,
        ),
        timeout=10,
        metadata=metadata,
    )
    run_id = reply.run.id
    finished = stub.WatchRun(
        gateway_service_pb2.WatchRunRequest(run_id=run_id, after_episode=EPISODES),
        timeout=300,
        metadata=metadata,
    )
    async for msg in finished:
        if msg.WhichOneof("event") == "finished":
            break
    await _ask(watch_conn, ("replay_tls", port, run_id, ca_pem, viewer, 1))  # warm-up
    plain_rates, tls_rates = [], []
    for w in WATCHER_COUNTS:
        best = {"plain": 0.0, "tls": 0.0}
        for _ in range(SECURE_REPEATS):
            for kind, job in (
                ("plain", ("replay", plain_port, plain_run, w)),
                ("tls", ("replay_tls", port, run_id, ca_pem, viewer, w)),
            ):
                elapsed, count = await _ask(watch_conn, job)
                assert count == w * EPISODES, (kind, count)
                best[kind] = max(best[kind], count / elapsed)
        plain_rates.append(best["plain"])
        tls_rates.append(best["tls"])
    await channel.close()
    await secure.stop()
    return plain_rates, tls_rates


def _row(label: str, *cells: str) -> None:
    print(f"{label:<48}" + "".join(f"{c:>14}" for c in cells))


async def main() -> None:
    from gateway.config import GatewayConfig
    from gateway.server import Gateway
    from tests.fakes.fake_trainer import valid_episodes

    ctx = mp.get_context("spawn")
    trainer_conn, child = ctx.Pipe()
    trainer_proc = ctx.Process(target=_trainer_main, args=(child,), daemon=True)
    trainer_proc.start()
    trainer = trainer_conn.recv()
    watch_conn, child = ctx.Pipe()
    watcher_proc = ctx.Process(target=_watcher_main, args=(child,), daemon=True)
    watcher_proc.start()
    tmp = tempfile.mkdtemp(prefix="gateway-bench-")
    if ONLY == "live":
        await _live_section(trainer, trainer_conn, watch_conn, tmp)
        trainer_conn.send(None)
        watch_conn.send(None)
        trainer_proc.join(5)
        watcher_proc.join(5)
        return

    episodes = list(valid_episodes(EPISODES))
    messages = {
        1: [gateway_service_pb2.WatchRunResponse(episode=e) for e in episodes],
        50: [
            gateway_service_pb2.WatchRunResponse(
                batch=gateway_service_pb2.EpisodeBatch(episodes=episodes[i : i + 50])
            )
            for i in range(0, EPISODES, 50)
        ],
    }
    bare, bare_port = _bare_server(messages)
    await bare.start()

    config = GatewayConfig(
        port=0, trainers=(trainer,), db=os.path.join(tmp, "bench.sqlite3"), keepalive_s=15
    )
    gateway = Gateway(config)
    port = await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
    size = sum(len(e.SerializeToString()) for e in episodes)
    print(
        f"history: {EPISODES} imitation episodes, {size / EPISODES:.0f} B mean "
        f"(60x11 motion every 10th), {os.cpu_count()} CPUs"
    )

    # (a/b) replay vs bare server.
    run_id = await _create(stub, EPISODES)
    await _wait_finished(stub, run_id)
    await _ask(watch_conn, ("replay", port, run_id, 1))  # warm-up (loads the page cache)
    await _ask(watch_conn, ("bare", bare_port, 50, 1))
    print()
    _row("replay of a finished 5000-episode run", *(f"{w} watcher(s)" for w in WATCHER_COUNTS))
    results: dict[str, list[float]] = {}
    # CPU of the servers (this process) and of the watchers' process during each replay, in
    # % of one core: what bounds a figure (a process near 100 % bounds it).
    servers, watchers = psutil.Process(), psutil.Process(watcher_proc.pid)
    loads: dict[str, list[str]] = {}
    for label, job in (
        ("bare aio, 1 episode/message (episodes/s)", ("bare", bare_port, 1)),
        ("bare aio, batches of 50 (episodes/s)", ("bare", bare_port, 50)),
        ("gateway replay (episodes/s)", ("replay", port, run_id)),
    ):
        rates = []
        loads[label] = []
        for w in WATCHER_COUNTS:
            before = (sum(servers.cpu_times()[:2]), sum(watchers.cpu_times()[:2]))
            elapsed, count = await _ask(watch_conn, (*job, w))
            after = (sum(servers.cpu_times()[:2]), sum(watchers.cpu_times()[:2]))
            assert count == w * EPISODES, (label, count)
            rates.append(count / elapsed)
            server_pct, watcher_pct = (
                (a - b) / elapsed * 100 for a, b in zip(after, before, strict=True)
            )
            loads[label].append(f"{server_pct:.0f}%/{watcher_pct:.0f}%")
        results[label] = rates
        _row(label, *(f"{r:,.0f}" for r in rates))
    for label, cells in loads.items():
        _row(f"  CPU server/watchers, {label.split(' (')[0]}", *cells)
    ratios = [
        g / b
        for g, b in zip(
            results["gateway replay (episodes/s)"],
            results["bare aio, batches of 50 (episodes/s)"],
            strict=True,
        )
    ]
    _row("ratio gateway / bare-batched", *(f"{r:.2f}x" for r in ratios))

    # (a/b) with TLS and a bearer token on every call: a second gateway, the same history,
    # measured alternately with the plaintext one (a replay to one watcher lasts ~10 ms: best
    # of several, as for ingest below).
    plain_rates, secure_rates = await _secure_replay(trainer, tmp, watch_conn, port, run_id)
    print()
    _row(
        f"replay, plaintext vs TLS (best of {SECURE_REPEATS})",
        *(f"{w} watcher(s)" for w in WATCHER_COUNTS),
    )
    _row("gateway replay, plaintext (episodes/s)", *(f"{r:,.0f}" for r in plain_rates))
    _row("gateway replay, TLS + token (episodes/s)", *(f"{r:,.0f}" for r in secure_rates))
    _row(
        "ratio TLS + token / plaintext (target >= 0.7x)",
        *(f"{t / p:.2f}x" for t, p in zip(secure_rates, plain_rates, strict=True)),
    )
    if ONLY == "replay":
        trainer_conn.send(None)
        watch_conn.send(None)
        await channel.close()
        await gateway.stop()
        await bare.stop(0)
        trainer_proc.join(5)
        watcher_proc.join(5)
        return

    # (c) live latency, each configuration a gateway process of its own.
    await _live_section(trainer, trainer_conn, watch_conn, tmp)

    # (d) RSS per idle watcher: watchers on a run held before its first episode.
    trainer_conn.send((0.0, True))  # held before episode 1: the run stays quiet
    trainer_conn.recv()
    idle_id = await _create(stub, 10)
    gc.collect()
    await asyncio.sleep(0.5)
    process = psutil.Process()
    before = process.memory_info().rss
    watch_conn.send(("idle", port, idle_id, IDLE_WATCHERS))
    assert await asyncio.get_running_loop().run_in_executor(None, watch_conn.recv) == "ready"
    await asyncio.sleep(0.5)
    after = process.memory_info().rss
    watch_conn.send("release")
    await asyncio.get_running_loop().run_in_executor(None, watch_conn.recv)
    per = (after - before) / IDLE_WATCHERS
    print()
    _row(f"RSS per idle watcher ({IDLE_WATCHERS} watchers)", f"{per / 1024:.1f} KB")
    await stub.StopRun(gateway_service_pb2.StopRunRequest(run_id=idle_id), timeout=10)
    await channel.close()
    await gateway.stop()
    await bare.stop(0)

    # (e) ingest, file vs memory: best of 3 each, alternating.
    trainer_conn.send((0.0, False))
    trainer_conn.recv()
    file_rates, memory_rates = [], []
    for i in range(3):
        file_rates.append(await _ingest(trainer, os.path.join(tmp, f"ingest{i}.sqlite3")))
        memory_rates.append(await _ingest(trainer, ":memory:"))
    best_file, best_memory = max(file_rates), max(memory_rates)
    print()
    _row("ingest, unpaced 5000-episode run (episodes/s)", "--db file", ":memory:", "file cost")
    _row("", f"{best_file:,.0f}", f"{best_memory:,.0f}", f"{(1 - best_file / best_memory):.1%}")

    trainer_conn.send(None)
    watch_conn.send(None)
    trainer_proc.join(5)
    watcher_proc.join(5)


if __name__ == "__main__":
    asyncio.run(main())
