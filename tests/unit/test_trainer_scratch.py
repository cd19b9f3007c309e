"""A trainer's scratch directory: locked for its life, removed at exit, swept once its trainer is
gone, and never swept while its trainer lives (``trainer_service.scratch``). The sweep after a
real ``kill -9`` is in ``tests/integration/test_grpo_processes.py``."""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from trainer_service.scratch import LOCK_FILE, TrainerScratch, sweep

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _left(base: pathlib.Path, pid: int, *, lock: bool = True) -> pathlib.Path:
    path = base / f"trainer-{pid}-0123abcd"
    path.mkdir(parents=True)
    (path / "checkpoint.bin").write_bytes(b"x" * 16)
    if lock:
        (path / LOCK_FILE).touch()
    return path


def test_a_trainer_holds_its_directory_and_removes_it_at_exit(tmp_path: pathlib.Path) -> None:
    scratch = TrainerScratch(tmp_path)
    assert scratch.path.parent == tmp_path and scratch.path.name.startswith(
        f"trainer-{os.getpid()}-"
    )
    fd = os.open(scratch.path / LOCK_FILE, os.O_RDWR)
    try:  # held: nobody else can take it
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert sweep(tmp_path) == [] and scratch.path.is_dir()
    scratch.close()
    assert not scratch.path.exists()
    scratch.close()  # idempotent


def test_a_directory_kept_at_exit_is_swept_by_the_next_trainer_once_this_one_is_gone(
    tmp_path: pathlib.Path, dead_pid: int
) -> None:
    scratch = TrainerScratch(tmp_path)
    scratch.close(remove=False)
    assert scratch.path.is_dir()
    assert sweep(tmp_path) == []  # its pid still runs (this process)
    gone = _left(tmp_path, dead_pid)
    unlocked = tmp_path / "elsewhere"
    bare = _left(unlocked, dead_pid, lock=False)  # died before it locked
    foreign = tmp_path / f"run-{dead_pid}-0123abcd"
    foreign.mkdir()
    following = TrainerScratch(tmp_path)
    assert following.swept == [gone] and not gone.exists()
    assert sweep(unlocked) == [bare] and not bare.exists()
    assert foreign.is_dir() and scratch.path.is_dir() and following.path.is_dir()
    following.close()


def test_a_held_lock_is_never_swept_even_with_its_pid_gone(
    tmp_path: pathlib.Path, dead_pid: int
) -> None:
    held = _left(tmp_path, dead_pid)  # as seen from another pid namespace
    fd = os.open(held / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert sweep(tmp_path) == [] and held.is_dir()
    finally:
        os.close(fd)
    assert sweep(tmp_path) == [held]


def test_the_default_base_is_in_the_temporary_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    scratch = TrainerScratch()
    try:
        assert scratch.base == tmp_path / "trainwire-scratch"
        assert scratch.path.parent == scratch.base
        # Made for every user's trainers, as /tmp is; each trainer's own directory is private.
        assert scratch.base.stat().st_mode & 0o7777 == 0o1777
        assert scratch.path.stat().st_mode & 0o777 == 0o700
    finally:
        scratch.close()
        monkeypatch.setattr(tempfile, "tempdir", None)


def test_a_trainer_that_cannot_make_its_scratch_exits_2_naming_it(tmp_path: pathlib.Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    (temporary / "trainwire-scratch").write_text("a file where the base should be")
    done = subprocess.run(
        [sys.executable, "-m", "trainer_service", "--port", "0", "--device", "cpu"],
        env={**os.environ, "TMPDIR": str(temporary), "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m trainer_service: error: scratch directory: "), last
    assert str(temporary / "trainwire-scratch") in last
    assert "listening" not in done.stdout
