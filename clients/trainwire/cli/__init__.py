"""The ``trainwire`` console script: drive and watch Trainwire runs from a terminal.

``main`` is the entry point (``trainwire = "trainwire.cli:main"``). Importing this package needs
only the bare client install; the live view (rich) and the pictures (Pillow) come with the
``cli`` extra and are imported by the commands that use them.
"""

from __future__ import annotations

import os

# gRPC's core logs a failed TLS handshake to stderr in several lines of its own; the command
# says what failed in one ``error:`` line instead. Set before grpc is imported (GRPC_VERBOSITY
# in the environment still wins).
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from trainwire.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
