"""``python -m gateway --db PATH`` where PATH cannot hold a database: exit 2 with one line that
names the path and the problem, for a directory the gateway cannot write (immutable, so it holds
for root too) and for a path through a regular file."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_store_failures import one_error_line, run_gateway
from tests.unit.test_store_schema import make_read_only, undo_read_only

PREFIX = "python -m gateway: error: cannot use the database"


def test_a_directory_the_gateway_cannot_write_is_one_line_and_exit_2(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    db = directory / "gw.sqlite3"
    make_read_only(directory)
    try:
        line = one_error_line(run_gateway("--db", str(db)))
    finally:
        undo_read_only(directory)
        directory.chmod(0o755)
    assert line == (
        f"{PREFIX} {db}: the directory {directory} is not writable for this user (permission "
        "denied creating the lock file gw.sqlite3.lock)"
    )
    assert not Path(f"{db}.lock").exists() and not db.exists()


def test_a_path_through_a_regular_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    db = blocker / "runs" / "gw.sqlite3"
    line = one_error_line(run_gateway("--db", str(db)))
    assert line == f"{PREFIX} {db}: {blocker} is not a directory, so {db.parent} cannot be created"
