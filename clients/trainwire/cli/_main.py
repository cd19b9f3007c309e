"""The ``trainwire`` command line's entry point: parse, connect, run the command, map errors to
exit codes (arguments in ``_parser``, commands in ``_commands`` and ``_follow``).

Every command talks to the gateway through ``trainwire.client.GatewayClient`` (a deadline on every
call). Server errors become one ``error: CODE: message`` line on stderr and a non-zero exit,
never a traceback. rich (the live view) and Pillow (pictures) are imported only by the commands
that draw, so the rest works with the bare client install.

Exit codes: 0 success (``watch``: the run is DONE); 1 a server error, a failed run (ERROR) or a
local problem; 2 bad usage; 3 ``watch`` saw the run STOPPED; 130 interrupted (Ctrl+C detaches
from a watched run without stopping it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from trainwire.cli import _format
from trainwire.cli._output import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Output,
)
from trainwire.cli._parser import build_parser
from trainwire.client import GatewayClient, TrainwireError

__all__ = ["build_parser", "main"]

_LOGGER = logging.getLogger(__name__)


def _read_pem(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise CliError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _client(args: argparse.Namespace) -> GatewayClient:
    """The client of the connection options (TLS with --ca/--cert/--key, a --token)."""
    if (args.cert is None) != (args.key is None):
        raise CliError("--cert and --key go together (TRAINWIRE_CERT, TRAINWIRE_KEY)")
    options: list[tuple[str, str]] = []
    if args.server_name is not None:
        if args.ca is None and args.cert is None:
            raise CliError("--server-name checks a TLS certificate: give --ca (TRAINWIRE_CA) too")
        options.append(("grpc.ssl_target_name_override", args.server_name))
    try:
        return GatewayClient(
            args.gateway,
            timeout=args.timeout,
            options=options,
            root_certificates=_read_pem(args.ca, "--ca"),
            certificate_chain=_read_pem(args.cert, "--cert"),
            private_key=_read_pem(args.key, "--key"),
            token=args.token,
        )
    except ValueError as exc:  # a token of several lines, ...
        raise CliError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``trainwire`` command line; returns the exit code.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    local = getattr(args, "local", None)
    if local is not None:  # a command that needs no gateway (completion)
        code: int = local(parser, args)
        return code
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    out = Output(args.json)
    try:
        with _client(args) as client:
            result: int = args.handler(client, args, out)
            return result
    except TrainwireError as exc:
        _LOGGER.debug("call failed", exc_info=True)
        if args.json:
            print(_format.error_json(exc), file=sys.stderr)
        else:
            for line in _format.error_lines(exc, args.gateway, args.timeout):
                print(line, file=sys.stderr)
        if args.verbose:
            for line in _format.error_detail_lines(exc):
                print(line, file=sys.stderr)
        return EXIT_ERROR
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as exc:  # a missing extra (rich, Pillow): say how to install it
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `trainwire watch --json ID | head`: the reader left
        return EXIT_OK
