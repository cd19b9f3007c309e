"""The ``trainwire`` console script: drive and watch Trainwire runs from a terminal.

``main`` is the entry point (``trainwire = "trainwire.cli:main"``). Importing this package needs
only the bare client install; the live view (rich) and the pictures (Pillow) come with the
``cli`` extra and are imported by the commands that use them.
"""

from __future__ import annotations

from trainwire.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
