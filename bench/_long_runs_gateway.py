"""``python -m gateway`` with its trainers in memory on its own event loop, for bench/long_runs.py.

The process is the real entry point (flags, store, recovery, gRPC and HTTP sides, signals, the
ready lines) with one change: trainers are reached through ``MemoryConnector`` instead of gRPC,
so an unpaced run is limited by the gateway alone, not by a trainer process and its stream.
Every job sends an imitation episode with a motion of 60 frames x 11 joints every 10th episode
(the provider's default detail). Unlike the test fake, a job here forgets the episodes its
stream has sent long ago and the connector records no calls: a million-episode run must not
grow this process's memory through its trainer (the gateway's memory is what is measured).

Run: ``python bench/_long_runs_gateway.py --db ... --port 0 --trainer 127.0.0.1:1 ...``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import deque
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import gateway.__main__ as entry  # noqa: E402
from gateway.server import Gateway  # noqa: E402
from tests.fakes.memory_trainer import (  # noqa: E402
    Call,
    JobScript,
    MemoryConnector,
    MemoryStream,
    MemoryTrainer,
)
from trainwire.v1 import episode_pb2  # noqa: E402

MOTION = (60, 11)  # frames x joints: the imitation provider's default detail
DETAIL_EVERY = 10
#: Episodes a job keeps after producing them: far beyond its credit (256 for an unpaced run),
#: so a re-attach after a blip still finds what it asks for.
KEPT = 16_384


class RecentEpisodes:
    """A job's produced episodes, indexed from 0 like the list it replaces, holding only the
    last ``KEPT`` (reading an older one is an ``IndexError``)."""

    def __init__(self, produced: list[episode_pb2.Episode]) -> None:
        self._count = len(produced)
        self._items: deque[episode_pb2.Episode] = deque(produced, maxlen=KEPT)

    def append(self, episode: episode_pb2.Episode) -> None:
        self._count += 1
        self._items.append(episode)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> episode_pb2.Episode:
        offset = index - (self._count - len(self._items))
        if offset < 0:
            raise IndexError(f"episode index {index} was forgotten")
        return self._items[offset]


class ForgetfulTrainer(MemoryTrainer):
    """A ``MemoryTrainer`` whose jobs keep only their recent episodes."""

    def open(self, run_id: str, *args: Any, **kwargs: Any) -> MemoryStream:
        self.script(JobScript(detail_every=DETAIL_EVERY, detail_shape=MOTION))
        stream = super().open(run_id, *args, **kwargs)
        job = self.jobs.get(run_id)
        if job is not None and not isinstance(job.produced, RecentEpisodes):
            job.produced = RecentEpisodes(job.produced)  # type: ignore[assignment]
        self._scripts.clear()  # the script was for this call's job, if it made one
        return stream


class QuietConnector(MemoryConnector):
    """A ``MemoryConnector`` that keeps no record of calls (one per grant, for ever)."""

    def _record(self, call: Call) -> None:
        pass


def main(argv: list[str]) -> int:
    config = entry.config_from_args(entry.parse_args(argv))
    connector = QuietConnector(ForgetfulTrainer(a, slots_total=16) for a in config.trainers)
    # The entry point builds its Gateway by this name; the rest of it runs unchanged.
    entry.Gateway = functools.partial(Gateway, connector=connector)  # type: ignore[assignment,misc]
    return entry.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
