"""First in a fork server's preload (the rank launcher's, the DataLoader workers'): importing it
pauses the cyclic collector while the server imports the training stack once
(:mod:`trainwire_ops.heap`). :mod:`.preload_end`, last in the same preload, freezes what was
imported and starts the collector again, before the server forks anything.

Imported for that effect alone, by name, in a fresh fork server only."""

from __future__ import annotations

from trainwire_ops import heap

heap.pause()
