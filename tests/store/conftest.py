"""The fixtures of the store suites: every test runs against each backend, SQLite (the
embedded default) and PostgreSQL (a real server, ``tests/postgres_fixtures.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway.core.store import Store, open_store

Opener = Callable[[], Store]


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens (not starts) a store on one database per test; every call opens the same one."""
    if request.param == "sqlite":
        db = str(tmp_path / "db.sqlite3")
    else:
        db = request.getfixturevalue("postgres_url")
    return lambda: open_store(db)


@pytest.fixture
async def store(opener: Opener) -> AsyncIterator[Store]:
    s = opener()
    await s.start()
    try:
        yield s
    finally:
        await s.close()
