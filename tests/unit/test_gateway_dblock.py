"""The database lock's errors: a directory or lock file the gateway cannot create is one line
naming the path at fault and the problem, a ``DatabaseProblem`` like every other unusable
database, never a bare ``[Errno N]``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gateway.core.dblock import DatabaseLock, DatabasePathProblem, describe_path_error
from gateway.core.store import DatabaseProblem
from tests.unit.test_store_schema import make_read_only, undo_read_only


def _error(code: int, filename: Path | str) -> OSError:
    return OSError(code, os.strerror(code), str(filename))


def test_a_directory_it_cannot_write_names_the_directory(tmp_path: Path) -> None:
    db = tmp_path / "gw.sqlite3"
    text = describe_path_error(str(db), _error(errno.EACCES, f"{db}.lock"))
    assert text == (
        f"the directory {tmp_path} is not writable for this user (permission denied creating "
        "the lock file gw.sqlite3.lock)"
    )
    # An immutable directory refuses root with EPERM: the same words.
    assert describe_path_error(str(db), _error(errno.EPERM, f"{db}.lock")) == text


def test_a_lock_file_it_cannot_open_names_the_lock_file(tmp_path: Path) -> None:
    db = tmp_path / "gw.sqlite3"
    Path(f"{db}.lock").touch()
    assert describe_path_error(str(db), _error(errno.EACCES, f"{db}.lock")) == (
        f"its lock file {db}.lock cannot be opened for writing (permission denied)"
    )


def test_a_directory_it_cannot_create_names_that_directory(tmp_path: Path) -> None:
    db = tmp_path / "a" / "b" / "gw.sqlite3"
    text = describe_path_error(str(db), _error(errno.EACCES, tmp_path / "a"))
    assert text == f"the directory {tmp_path / 'a'} cannot be created (permission denied)"


def test_a_regular_file_in_the_path_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    # os.makedirs on the file itself: EEXIST; on a directory below it: ENOTDIR.
    direct = describe_path_error(str(blocker / "gw.sqlite3"), _error(errno.EEXIST, blocker))
    assert direct == f"{blocker} is not a directory"
    below = describe_path_error(
        str(blocker / "sub" / "gw.sqlite3"), _error(errno.ENOTDIR, blocker / "sub")
    )
    assert below == f"{blocker} is not a directory, so {blocker / 'sub'} cannot be created"


def test_other_errors_read_as_words_without_an_errno(tmp_path: Path) -> None:
    db = tmp_path / "gw.sqlite3"
    assert describe_path_error(str(db), _error(errno.EROFS, f"{db}.lock")) == (
        f"the directory {tmp_path} is on a read-only file system"
    )
    text = describe_path_error(str(db), _error(errno.ENOSPC, f"{db}.lock"))
    assert text == f"its lock file {db}.lock cannot be created (no space left on device)"


def test_the_lock_raises_a_database_problem_for_a_path_through_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    db = blocker / "gw.sqlite3"
    with pytest.raises(DatabasePathProblem) as info:
        DatabaseLock(str(db)).acquire()
    assert isinstance(info.value, DatabaseProblem)
    assert str(info.value) == f"cannot use the database {db}: {blocker} is not a directory"
    assert isinstance(info.value.__cause__, OSError)


def test_the_lock_raises_a_database_problem_for_a_directory_it_cannot_write(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    db = directory / "gw.sqlite3"
    make_read_only(directory)  # immutable for root, no write permission for others
    try:
        with pytest.raises(DatabasePathProblem) as info:
            DatabaseLock(str(db)).acquire()
    finally:
        undo_read_only(directory)
        directory.chmod(0o755)
    assert str(info.value) == (
        f"cannot use the database {db}: the directory {directory} is not writable for this "
        "user (permission denied creating the lock file gw.sqlite3.lock)"
    )
