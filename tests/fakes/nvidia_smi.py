"""A fake ``nvidia-smi``: a real executable (a shell script) for a directory put first on a
process's ``PATH``, printing what the real one prints for the trainer's query on a machine of
four GPUs, or whatever else a test tells it to do; each run records its arguments."""

from __future__ import annotations

import stat
from pathlib import Path

#: What ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu
#: --format=csv,noheader,nounits`` prints on a machine of four GPUs (memory in MiB; the last
#: one's utilization not supported).
SMI_OUTPUT = """\
0, GPU-aaaa1111-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559, 1024, 0
1, GPU-bbbb2222-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559, 40960, 87
2, GPU-cccc3333-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559, 2, 100
3, GPU-dddd4444-0000-0000-0000-000000000000, NVIDIA A10, 23028, 512, [N/A]
"""
#: The shell that prints ``SMI_OUTPUT``.
ANSWER = f"cat <<'EOF'\n{SMI_OUTPUT}EOF"


def fake_smi(directory: Path, body: str = ANSWER) -> Path:
    """An executable ``nvidia-smi`` in ``directory`` that runs the shell ``body`` (by default it
    answers ``SMI_OUTPUT``); each run first appends its arguments to ``directory/calls``."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{directory}/calls"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def calls(directory: Path) -> list[str]:
    """The arguments of each run of the fake in ``directory``, in order."""
    path = directory / "calls"
    return path.read_text().splitlines() if path.exists() else []
