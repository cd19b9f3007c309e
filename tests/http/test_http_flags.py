"""``--http-port``: 8080 by default, 0 picks a free port, -1 turns the HTTP side off; the process
prints ``gateway http on http://HOST:PORT`` when it serves, and exits 1 naming a port it cannot
bind."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.config import DEFAULT_HTTP_PORT, GatewayConfig
from tests.fakes.gateway_harness import ROOT
from tests.fakes.waiting import TIMEOUT

pytestmark = pytest.mark.timeout(120)


def test_flag_defaults_and_off() -> None:
    assert DEFAULT_HTTP_PORT == 8080
    assert config_from_args(parse_args([])).http_port == 8080
    assert config_from_args(parse_args(["--http-port", "0"])).http_port == 0
    assert config_from_args(parse_args(["--http-port", "-1"])).http_port is None
    assert GatewayConfig().http_port is None  # embedded gateways (tests) open no port unasked
    for bad in (-2, 65536):
        with pytest.raises(ValueError, match="http_port"):
            GatewayConfig(http_port=bad)


GATEWAY = (sys.executable, "-m", "gateway", "--port", "0", "--db", ":memory:", "--trainer")


def _gateway(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*GATEWAY, "127.0.0.1:9", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_process_prints_its_http_address_and_serves_there() -> None:
    proc = _gateway("--http-port", "0")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("gateway listening on 127.0.0.1:")
        line = proc.stdout.readline()
        match = re.fullmatch(r"gateway http on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line
        with urllib.request.urlopen(match.group(1) + "/v1/runs", timeout=TIMEOUT) as reply:
            assert json.loads(reply.read()) == {}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_off_prints_no_http_line_and_a_busy_port_exits_1() -> None:
    proc = _gateway("--http-port", "-1")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("gateway listening on")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        assert proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [*GATEWAY, "127.0.0.1:9", "--http-port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    assert result.returncode == 1 and result.stdout == ""
    assert f"gateway http: cannot listen on 127.0.0.1:{port}" in result.stderr
