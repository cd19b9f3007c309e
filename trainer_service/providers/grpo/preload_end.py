"""Last in a fork server's preload: freezes everything the preload imported and starts the
cyclic collector again (:mod:`.preload_begin` paused it), so that the processes the server forks
never scan, nor write to, those objects when they collect (:mod:`trainwire_ops.heap`).

Imported for that effect alone, by name, in a fresh fork server only."""

from __future__ import annotations

from trainwire_ops import heap

heap.freeze()
