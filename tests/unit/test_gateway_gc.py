"""A started gateway's long-lived objects are out of the cyclic collector's sight (its full
collections would otherwise walk them with the event loop stopped), frozen once per process."""

from __future__ import annotations

import gc

from gateway import server


def test_startup_objects_are_frozen_once_per_process() -> None:
    server.freeze_startup_objects()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    server.freeze_startup_objects()  # a second gateway in the process: nothing more to do
    assert gc.get_freeze_count() == frozen
