"""The services as processes under the operating system's hand: IPv6 loopback, signals at
awkward moments, and a watcher that freezes (SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import ROOT, collect, create_request, running_gateway
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc

pytestmark = pytest.mark.slow

State = gateway_service_pb2.Run.State
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def _spawn(*args: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=err
        )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode()


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_both_services_listen_on_ipv6_loopback_and_print_brackets(tmp_path: Path) -> None:
    log = tmp_path / "services.log"
    trainer, line = _spawn("trainer_service", "--host", "::1", "--port", "0", log=log)
    try:
        match = re.fullmatch(r"trainer listening on \[::1\]:(\d+)\n", line)
        assert match, line
        trainer_address = f"[::1]:{match.group(1)}"
        gateway, line = _spawn(
            "gateway", "--host", "::1", "--port", "0", "--http-port", "0", "--db", ":memory:",
            "--trainer", trainer_address, log=log,
        )  # fmt: skip
        try:
            match = re.fullmatch(r"gateway listening on \[::1\]:(\d+)\n", line)
            assert match, line
            async with grpc.aio.insecure_channel(f"[::1]:{match.group(1)}") as channel:
                stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
                run = (await stub.CreateRun(create_request(max_episodes=5), timeout=TIMEOUT)).run
                result = await collect(stub, run.id, timeout=JOB_TIMEOUT)
                assert result.numbers == [1, 2, 3, 4, 5]
                assert result.finished is not None
                assert result.finished.state == State.STATE_DONE
                assert result.finished.trainer == trainer_address
        finally:
            assert _stop(gateway) == 0
    finally:
        assert _stop(trainer) == 0


def test_sigterm_right_after_the_ready_line_and_after_sigcont_is_never_lost(
    tmp_path: Path,
) -> None:
    log = tmp_path / "trainer.log"
    for pause in (False, True):
        proc, line = _spawn("trainer_service", "--port", "0", log=log)
        assert line.startswith("trainer listening on "), line
        if pause:
            proc.send_signal(signal.SIGSTOP)
            proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert _stop(proc) == 0, log.read_text()[-2000:]


WATCHER = textwrap.dedent(
    """
    import sys, grpc
    from trainwire.v1 import gateway_service_pb2 as pb, gateway_service_pb2_grpc as g
    channel = grpc.insecure_channel(sys.argv[1])
    call = g.GatewayServiceStub(channel).WatchRun(pb.WatchRunRequest(run_id=sys.argv[2]))
    for message in call:
        if message.WhichOneof("event") == "caught_up":
            print("attached", flush=True)
    """
)


async def test_a_frozen_watcher_is_released_after_the_ping_timeout(fake: FakeTrainer) -> None:
    fake.push(Script(hold_at=3))
    async with running_gateway(
        (fake.address,), client_ping_interval_s=1.0, client_ping_timeout_s=1.0
    ) as client:
        run = await client.create(max_episodes=10)
        metrics = client.gateway.metrics
        proc = subprocess.Popen(
            [sys.executable, "-c", WATCHER, client.address, run.id],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line == b"attached\n"
            assert metrics.value("trainwire_gateway_watchers") == 1
            proc.send_signal(signal.SIGSTOP)
            # Documented: cut off within ping interval + ping timeout (2 s here).
            await until(
                lambda: metrics.value("trainwire_gateway_watchers") == 0,
                "the frozen watcher released",
            )
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        fake.scripts.clear()
        await client.stub.StopRun(
            gateway_service_pb2.StopRunRequest(run_id=run.id), timeout=TIMEOUT
        )


def _busy_port() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize(
    ("service", "flag"),
    [
        ("gateway", "--port"),
        ("gateway", "--metrics-port"),
        ("trainer_service", "--port"),
        ("trainer_service", "--metrics-port"),
    ],
)
def test_a_port_in_use_is_one_clear_line(tmp_path: Path, service: str, flag: str) -> None:
    listener, port = _busy_port()
    args = [sys.executable, "-m", service, "--port", "0", flag, str(port)]
    if service == "gateway":
        args += ["--http-port", "-1", "--db", ":memory:", "--trainer", "127.0.0.1:9"]
    try:
        result = subprocess.run(
            args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
    finally:
        listener.close()
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines[0]
    assert result.stdout == ""
