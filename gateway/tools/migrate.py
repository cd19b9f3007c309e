"""``python -m gateway migrate --db DB``: brings a database to this gateway's schema.

SQLite: it takes the database's lock first (a running gateway holds it: stop that one).
PostgreSQL (``--db postgresql://...``): it migrates under the schema's advisory lock, so it may
run while replicas of the older gateway are stopped for a rolling upgrade. Either way it migrates
in one transaction and says what it did in one line; a database it cannot use is one line and
exit code 2, as for the gateway itself.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from gateway.config import DEFAULT_DB
from gateway.core.dblock import DatabaseLock, DatabaseLocked
from gateway.core.store import DatabaseProblem, SqliteStore, is_postgres_url, postgres_schema
from gateway.core.store.sqlite_schema import SCHEMA_VERSION

PROG = "python -m gateway migrate"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m gateway migrate``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Migrate a gateway database to this gateway's schema "
        f"(version {SCHEMA_VERSION}); a database at that version is left as it is.",
    )
    parser.add_argument(
        "--db", default=DEFAULT_DB, help="the SQLite database file, or a postgresql:// URL"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if is_postgres_url(args.db):
        return asyncio.run(_migrate_postgres(args.db))
    lock = DatabaseLock(args.db)
    try:
        lock.acquire()
        store = SqliteStore(args.db, migrate=True)
    except (DatabaseLocked, DatabaseProblem) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    found = store.found_version
    store.close()
    if found == SCHEMA_VERSION:
        print(f"{args.db} is at schema version {SCHEMA_VERSION} already")
    elif found == 0:
        print(f"{args.db}: created at schema version {SCHEMA_VERSION}")
    else:
        print(f"{args.db}: migrated from schema version {found} to {SCHEMA_VERSION}")
    return 0


async def _migrate_postgres(url: str) -> int:
    import psycopg

    from gateway.core.store.postgres import safe_url

    where = safe_url(url)
    latest = postgres_schema.SCHEMA_VERSION
    try:
        try:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
        except psycopg.Error as exc:
            first = (str(exc).strip().splitlines() or ["?"])[0]
            raise DatabaseProblem(where, f"it cannot be reached ({first})") from None
        try:
            found = await postgres_schema.upgrade(conn, where, migrate=True)
        finally:
            await conn.close()
    except DatabaseProblem as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if found == latest:
        print(f"{where} is at schema version {latest} already")
    elif found == 0:
        print(f"{where}: created at schema version {latest}")
    else:
        print(f"{where}: migrated from schema version {found} to {latest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
