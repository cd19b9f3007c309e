"""Broken disks and databases, against gateway processes: a database that cannot be used is one
line and exit code 2; an older one is migrated only when asked; a store that stops taking
writes (the file size limit of the process, as a full disk) fails the runs it cannot save with a
message that says so, refuses new runs UNAVAILABLE and turns health NOT_SERVING until writes
succeed again, losing nothing committed."""

from __future__ import annotations

import asyncio
import os
import re
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.store import STORE_MESSAGE
from gateway.core.store.sqlite_schema import SCHEMA_VERSION
from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import ROOT, WatchResult, absorb, collect, create_request
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.unit.test_store_schema import make_read_only, undo_read_only, v1_database
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc

pytestmark = pytest.mark.slow

pb = gateway_service_pb2
State = pb.Run.State
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
GATEWAY = [sys.executable, "-m", "gateway", "--port", "0", "--http-port", "-1"]


def run_gateway(*args: str) -> subprocess.CompletedProcess[str]:
    """A gateway that is expected to exit on its own (refusing its database)."""
    return subprocess.run(
        [*GATEWAY, "--trainer", "127.0.0.1:9", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("case", ["directory", "corrupt", "foreign", "read-only", "newer"])
def test_a_database_that_cannot_be_used_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    path = tmp_path / "gw.sqlite3"
    if case == "directory":
        path.mkdir()
    elif case == "corrupt":
        path.write_bytes(b"\x00garbage" * 512)
    elif case == "foreign":
        sqlite3.connect(path).executescript("CREATE TABLE orders (id INTEGER);")
    elif case == "newer":
        sqlite3.connect(path).executescript(
            "PRAGMA application_id=1415006546; PRAGMA user_version=99; CREATE TABLE runs (x);"
        )
    else:
        sqlite3.connect(path).executescript("PRAGMA user_version=0;")
        make_read_only(path)
    try:
        line = one_error_line(run_gateway("--db", str(path)))
    finally:
        if case == "read-only":
            undo_read_only(path)
    assert line.startswith(f"python -m gateway: error: cannot use the database {path}: ")


def test_an_older_database_is_migrated_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "gw.sqlite3"
    v1_database(path)
    line = one_error_line(run_gateway("--db", str(path)))
    assert f"python -m gateway migrate --db {path}" in line
    migrated = subprocess.run(
        [sys.executable, "-m", "gateway", "migrate", "--db", str(path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout == f"{path}: migrated from schema version 1 to {SCHEMA_VERSION}\n"
    again = subprocess.run(
        [sys.executable, "-m", "gateway", "migrate", "--db", str(path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert again.stdout == f"{path} is at schema version {SCHEMA_VERSION} already\n"


async def _spawn(trainer: str, db: Path) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    """A gateway process whose log goes to a pipe (a file size limit applies to regular files
    only: the database's, not its log); returns it, its address and its log lines so far."""
    proc = await asyncio.create_subprocess_exec(
        *GATEWAY,
        "--trainer",
        trainer,
        "--db",
        str(db),
        "--keepalive",
        "0.5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []

    async def drain(stream: asyncio.StreamReader) -> None:
        async for line in stream:
            lines.append(line.decode(errors="replace"))

    proc._drain = asyncio.create_task(drain(proc.stderr))  # type: ignore[attr-defined]
    line = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode()
    match = re.fullmatch(r"gateway listening on 127\.0\.0\.1:(\d+)\n", line)
    assert match, f"{line!r}: {''.join(lines)[-2000:]}"
    return proc, f"127.0.0.1:{match.group(1)}", lines


async def _health(stub: health_pb2_grpc.HealthStub) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)).status


async def test_a_full_disk_fails_runs_it_cannot_save_and_heals(
    fake: FakeTrainer, tmp_path: Path
) -> None:
    db = tmp_path / "gw.sqlite3"
    # Large motion details on every episode: a few episodes fill the room left below.
    fake.default = Script(frames=240, joints=32, detail_every=1, interval=0.02)
    proc, address, log = await _spawn(fake.address, db)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            assert await _health(health) == health_pb2.HealthCheckResponse.SERVING
            run = (await stub.CreateRun(create_request(max_episodes=500), timeout=TIMEOUT)).run
            seen = WatchResult()
            full = False
            async for message in stub.WatchRun(
                pb.WatchRunRequest(run_id=run.id), timeout=JOB_TIMEOUT
            ):
                absorb(seen, message)
                if not full and len(seen.episodes) >= 5:
                    # The disk fills up: no file of the gateway may grow past 64 KiB any more
                    # (Python ignores SIGXFSZ, so writes beyond fail as on a full disk).
                    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64 << 10, -1))
                    full = True
            final = seen.finished
            assert final is not None and final.state == State.STATE_ERROR
            assert final.error_message == STORE_MESSAGE
            assert 5 <= final.episode < 500
            assert seen.numbers == list(range(1, final.episode + 1))
            assert await _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CreateRun(create_request(max_episodes=5), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert STORE_MESSAGE in (info.value.details() or "")
            # Room again: the store's write probe notices within seconds.
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (-1, -1))

            async def serving() -> bool:
                return await _health(health) == health_pb2.HealthCheckResponse.SERVING

            await until(serving, "health back to SERVING")
            fake.default = Script()
            later = (await stub.CreateRun(create_request(max_episodes=5), timeout=TIMEOUT)).run
            done = await collect(stub, later.id, timeout=JOB_TIMEOUT)
            assert done.finished is not None and done.finished.state == State.STATE_DONE
            # Nothing a watcher saw is lost, and the failed run's end is saved after all.
            replay = await collect(stub, run.id, timeout=JOB_TIMEOUT)
            assert replay.numbers == seen.numbers
            assert replay.finished is not None
            assert replay.finished.state == State.STATE_ERROR
    finally:
        proc.terminate()
        await proc.wait()
        await proc._drain  # type: ignore[attr-defined]
    text = "".join(log)
    assert "Traceback" not in text, text[-3000:]
    assert text.count("storing episode") == 1  # one line for the failure, not one per layer
