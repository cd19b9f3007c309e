"""The client package (and the gateway) import in a process where importing torch is impossible."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class _Block(importlib.abc.MetaPathFinder):
        BLOCKED = ("torch", "trl", "transformers", "accelerate", "datasets")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, _Block())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker failed: torch imported")
    """
)


def _run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_blocker_really_blocks_torch() -> None:
    result = _run_blocked("import torch\n")
    assert result.returncode != 0 and "blocked in this test" in result.stderr


@pytest.mark.parametrize(
    "modules",
    [
        "trainwire.v1.gateway_service_pb2_grpc, trainwire.v1.trainer_service_pb2_grpc",
        "trainwire.contract, trainwire.motion",
        "gateway.server, gateway.__main__, gateway.core.registry",
        "trainwire.client, trainwire.cli, trainwire_ops.logs",
    ],
)
def test_client_package_imports_without_torch(modules: str) -> None:
    result = _run_blocked(f"import {modules}\nimport sys\nprint(sorted(sys.modules).__len__())\n")
    assert result.returncode == 0, result.stderr
