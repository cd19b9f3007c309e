"""The client package is typed for its users: `mypy --strict` passes on a consumer script that
uses GatewayClient (sync and asyncio) and the raw generated stubs, and the stubs are real types
(a wrong request type is an error, not Any)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"
sys.path.insert(0, str(ROOT / "scripts"))
import gen_protos  # noqa: E402  (scripts/ is not a package)

pytestmark = pytest.mark.slow


def _mypy(*files: Path) -> subprocess.CompletedProcess[str]:
    # The typing stubs (types-grpcio, types-protobuf) live in the generator venv, not in the
    # services' venv; mypy reads that venv's site-packages and the client from its source.
    python = gen_protos.gen_python()
    gen_protos.check_toolchain(python)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(TYPING / "mypy.ini"),
            "--python-executable",
            str(python),
            "--no-incremental",
            "--cache-dir",
            os.devnull,
            *(str(f) for f in files),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(ROOT / "clients")},
        check=False,
    )


def test_mypy_strict_passes_on_the_consumer_script() -> None:
    result = _mypy(TYPING / "consumer.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stubs_are_typed_not_any(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "import grpc\n"
        "from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc\n"
        "stub = gateway_service_pb2_grpc.GatewayServiceStub(grpc.insecure_channel('x:1'))\n"
        "stub.GetRun(gateway_service_pb2.ListRunsRequest())\n"
        "reveal_type(stub.GetRun)\n"
    )
    result = _mypy(wrong)
    assert result.returncode == 1
    assert 'incompatible type "ListRunsRequest"; expected "GetRunRequest"' in result.stdout
    assert "UnaryUnaryMultiCallable[trainwire.v1.gateway_service_pb2.GetRunRequest" in (
        result.stdout
    )
