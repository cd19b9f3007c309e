"""The cyclic garbage collector around a process's start-up: paused while it imports, then the
start-up's objects frozen out of every later collection.

A Trainwire process imports large libraries once and keeps them for its whole life (torch,
transformers, TRL: hundreds of thousands of objects, none of them ever garbage). While they are
imported, the collector's full collections re-scan the growing heap again and again; afterwards,
every full collection scans them once more. :func:`pause` stops the collector for the start-up;
:func:`freeze` then collects once (the start-up's garbage cycles would otherwise stay for
good), moves everything still alive to the permanent generation, which collections skip
(``gc.freeze``), and starts the collector again. A process that forks workers
without exec (a fork server) freezes before it forks: collections in the children then never
write to the parent's objects, so their memory pages stay shared (CPython's documented recipe
for ``gc.freeze``). ``bench/startup_gc.py`` measures both effects.

Invariant: every :func:`pause` is followed by one :func:`freeze` on the same path; a process
that exits between them never collected (it had nothing to collect that mattered).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["freeze", "pause", "paused_then_frozen"]


def pause() -> None:
    """Stops the cyclic collector (reference counting still frees what is not in a cycle)."""
    gc.disable()


def freeze() -> None:
    """Collects once (the start-up's own garbage cycles), moves every object still alive to the
    permanent generation, then starts the collector."""
    gc.collect()
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def paused_then_frozen() -> Iterator[None]:
    """:func:`pause` for the block, :func:`freeze` after it (also when it raises)."""
    pause()
    try:
        yield
    finally:
        freeze()
