"""What every command shares: exit codes, defaults, local errors and where output goes."""

from __future__ import annotations

import sys
from typing import Any

from trainwire.cli import _format

DEFAULT_GATEWAY = "localhost:50051"
DEFAULT_TIMEOUT = 10.0
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A local problem worth one ``error:`` line (missing extra, unwritable file, ...)."""


class Output:
    """Where a command writes: results to stdout, diagnostics to stderr, JSON or text."""

    def __init__(self, json_mode: bool) -> None:
        self.json = json_mode

    def result(self, text: str, data: Any) -> None:
        print(_format.dumps(data) if self.json else text, flush=True)

    def info(self, text: str) -> None:
        if not self.json:
            print(text, file=sys.stderr, flush=True)
