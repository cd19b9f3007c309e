"""A git revision's files, for benchmarks that compare the working tree with an earlier one."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_revision(rev: str, paths: list[str], into: str) -> str | None:
    """Extracts ``paths`` of git revision ``rev`` of this checkout into the directory ``into``
    and returns it; None when the revision is not in this checkout."""
    try:
        data = subprocess.run(
            ["git", "archive", rev, *paths], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into
