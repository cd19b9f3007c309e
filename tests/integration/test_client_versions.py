"""The client package installs beside a service pinned to the lowest grpcio/protobuf of its range
and beside one on the highest, and its tests pass in both.

For each end of the range: a fresh venv gets the client's wheel (built from clients/) with
grpcio, grpcio-status and protobuf pinned to that end, plus pytest; then the client's tests
against the real gateway (tests/servicer/test_client_gateway.py, sync and asyncio clients) run
in it. The gateway and the fake trainer run from the services' venv in a subprocess
(``TRAINWIRE_TEST_STACK_PYTHON``), since the services pin their own grpcio.

pip reaches the package index the first time; its wheel cache (and the wheel built here, once
per session) makes later runs fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: The ends of clients/pyproject.toml's range. The lowest are its floors (a test below checks
#: that); the highest are the newest releases, the services' protobuf pin among them.
ENDS = {
    "lowest": {"grpcio": "1.72.1", "grpcio-status": "1.72.1", "protobuf": "6.30.0"},
    "highest": {"grpcio": "1.85.3", "grpcio-status": "1.85.3", "protobuf": "7.36.2"},
}
#: What the tests need besides the client, at the services' pins (constraints.txt).
TEST_TOOLS = ("pytest", "pytest-timeout", "iniconfig", "packaging", "pluggy", "pygments")
#: The client tests that run in each venv.
CLIENT_TESTS = ("tests/servicer/test_client_gateway.py",)


def _pins(names: tuple[str, ...]) -> list[str]:
    wanted = {n.lower() for n in names}
    pins = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name = line.split("==", 1)[0].strip().lower()
        if name in wanted:
            pins.append(line.strip())
    assert len(pins) == len(wanted), f"constraints.txt lacks some of {sorted(wanted)}"
    return pins


def _run(args: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert result.returncode == 0, (
        f"{' '.join(args)}\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
    )
    return result


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = tmp_path_factory.mktemp("source") / "clients"
    shutil.copytree(
        ROOT / "clients",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        timeout=300,
    )
    (wheel,) = out.glob("trainwire-*.whl")
    yield wheel


def test_the_lowest_end_is_the_declared_floor() -> None:
    project = tomllib.loads((ROOT / "clients" / "pyproject.toml").read_text())["project"]
    floors = {}
    for spec in project["dependencies"]:
        name, _, rest = spec.partition(">=")
        floors[name.strip()] = rest.split(",")[0].strip()
    assert floors == ENDS["lowest"]


@pytest.mark.parametrize("end", sorted(ENDS))
def test_the_client_tests_pass_at_each_end_of_the_range(
    end: str, client_wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    versions = ENDS[end]
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            "--timeout",
            "60",
            str(client_wheel),
            *(f"{name}=={version}" for name, version in versions.items()),
            *_pins(TEST_TOOLS),
        ],
        timeout=600,
    )
    probe = _run(
        [
            str(python),
            "-W",
            "error",
            "-c",
            "import grpc, grpc_status, google.protobuf, trainwire, trainwire.aio, "
            "trainwire.client, trainwire.v1.gateway_service_pb2_grpc, "
            "trainwire.v1.trainer_service_pb2_grpc; "
            "print(grpc.__version__, google.protobuf.__version__, trainwire.__file__)",
        ],
        timeout=120,
        cwd=tmp_path,  # not the repository: the installed client, never the source tree's
    )
    grpc_version, protobuf_version, location = probe.stdout.split()
    assert (grpc_version, protobuf_version) == (versions["grpcio"], versions["protobuf"])
    assert Path(location).is_relative_to(venv), location
    tests = _run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            # Its own temporary root: a pytest that shares the suite's (pytest-of-USER) sets it
            # back to mode 0700, and the embedded PostgreSQL's user can then no longer reach its
            # data directory in there (initdb failed: "pg_control: Permission denied").
            f"--basetemp={tmp_path / 'inner'}",
            "-W",
            "ignore::pytest.PytestConfigWarning",  # asyncio_mode: no pytest-asyncio here
            *CLIENT_TESTS,
        ],
        timeout=840,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "TRAINWIRE_TEST_STACK_PYTHON": sys.executable,
        },
    )
    assert " passed" in tests.stdout and "failed" not in tests.stdout, tests.stdout[-3000:]
