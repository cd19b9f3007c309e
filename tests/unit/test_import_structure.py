"""The import structure of ``[tool.importlinter]`` in pyproject.toml, checked by the same
``lint-imports`` that ``make lint`` runs: no cycles between the modules of any package, cores
without grpc (and the trainer's without torch), a client package that imports neither service,
and each service's layers pointing one way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"{lint_imports} is missing: install the dev extra"
    # The checkout's packages, whatever the environment has installed.
    path = os.pathsep.join([str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[report.find("Contracts") :]
    assert " 0 broken" in report, report
