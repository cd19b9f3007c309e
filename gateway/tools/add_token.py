"""``python -m gateway.tools.add_token NAME ROLE --tokens FILE``: make a bearer token.

Prints a new random token once, on stdout, and appends ``SHA256 ROLE NAME`` to the tokens file
(created with mode 600). The token itself is stored nowhere: whoever loses it gets a new one. A
tokens file that every user may read or write is refused, as the gateway refuses it. A running
gateway picks up the new line on SIGHUP.

Exit codes: 0 done; 2 bad arguments or an unusable file.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.auth import Role, TokenFileError, TokenTable, check_name, hash_token
from trainwire_ops.tls import private_file_problem

#: Recognisable in a leaked config or a log (secret scanners match prefixes), 256 random bits.
TOKEN_PREFIX = "tw_"


def new_token() -> str:
    """A fresh random token."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def add_token(path: Path, name: str, role: Role) -> str:
    """Appends a new token's line to ``path`` (created 0600 if missing); returns the token.

    Raises:
        TokenFileError: the file is too open, unreadable or malformed.
        ValueError: a bad name.
    """
    check_name(name)
    if path.exists():
        problem = private_file_problem(path)
        if problem is not None:
            raise TokenFileError(problem)
        existing = path.read_text(encoding="utf-8")
    else:
        existing = ""
    token = new_token()
    line = f"{hash_token(token)} {role.label} {name}\n"
    TokenTable.parse(existing + line, str(path))  # the file stays one the gateway accepts
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        if existing and not existing.endswith("\n"):
            out.write("\n")
        out.write(line)
    return token


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.add_token",
        description="Create a bearer token for the gateway's --auth-tokens file: the token is "
        "printed once, only its SHA-256 is stored.",
    )
    parser.add_argument("name", help="who holds the token (shown as Run.creator and in logs)")
    parser.add_argument("role", help="viewer, operator or admin")
    parser.add_argument("--tokens", required=True, type=Path, metavar="FILE", help="tokens file")
    args = parser.parse_args(argv)
    try:
        role = Role.parse(args.role)
        token = add_token(args.tokens, args.name, role)
    except (ValueError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"{parser.prog}: error: {reason}", file=sys.stderr)
        return 2
    print(token, flush=True)
    print(
        f"added {role.label} token {args.name!r} to {args.tokens}; it is shown only this once "
        "(a running gateway reads it on SIGHUP)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
