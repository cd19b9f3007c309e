"""A job's flow-control bookkeeping: the episodes it holds for a re-attach and the credit that
bounds what its producer may pull next.

Before the producer pulls episode ``n`` from the provider's generator it needs *credit*:

- ``n <= grant`` when the job has a grant (credit-based flow control: the gateway grants a
  bounded lead over what it has published, so a paused run stops training and a slow run trains
  slowly); with no grant (``0``, direct use) ``n <= cursor + queue_size`` instead, where
  ``cursor`` is the last episode the attached stream handed to its RPC, so a slow reader
  throttles the provider as a bounded channel would;
- ``n <= cursor + retain``: the job holds its last ``retain`` episodes for a re-attach, and never
  drops one that no stream has sent yet.

Invariants: ``produced`` only grows; held episodes are ``produced - len(held) + 1 .. produced``.

:class:`EpisodeWindow` is plain bookkeeping: the job's shared state
(``trainer_service.core.job_state``) guards it with its condition, waits for credit and wakes
the job's streams.
"""

from __future__ import annotations

import collections

from trainwire.v1 import episode_pb2


class EpisodeWindow:
    """The episodes a job holds and its credit for the next ones.

    Not thread-safe: the job holds its condition around every use.

    Args:
        queue_size: Episodes the producer may run ahead of an attached stream without a grant.
        retain: Episodes held for a re-attach (at least ``queue_size``).
        grant: The initial grant (0: none).

    Attributes:
        grant: The last episode the job may produce (0: no grant).
        cursor: The last episode the current (or last) stream handed to its RPC.
        produced: The last episode the provider produced (0 before the first).
    """

    def __init__(self, queue_size: int, retain: int, grant: int) -> None:
        self.queue_size = max(1, queue_size)
        self.retain = max(self.queue_size, retain)
        self.grant = max(0, grant)
        self.cursor = 0
        self.produced = 0
        self._held: collections.deque[episode_pb2.Episode] = collections.deque()

    def allows(self, n: int) -> bool:
        """Whether episode ``n`` may be produced now (see the module docstring)."""
        window = self.retain if self.grant else self.queue_size
        if n > self.cursor + window:
            return False
        return not self.grant or n <= self.grant

    def move_grant(self, through_episode: int) -> bool:
        """Moves the grant to ``through_episode`` (grants only move forward); returns whether it
        moved."""
        if through_episode > self.grant:
            self.grant = through_episode
            return True
        return False

    def start_at(self, episode: int, cursor: int) -> None:
        """Numbers the job's episodes from ``episode + 1`` (a job restored from the checkpoint
        after ``episode``; 0 for one from scratch). Only before the first episode is held;
        ``cursor``: the attached stream's start point (the credit counts from the later of the
        two)."""
        if self._held:
            raise RuntimeError("the window already holds episodes")
        self.produced = episode
        self.cursor = max(episode, cursor)

    @property
    def first(self) -> int:
        """The first held episode (``produced + 1`` while none is held)."""
        return self.produced - len(self._held) + 1

    def hold(self, episode: episode_pb2.Episode) -> None:
        """Holds a new episode, dropping the oldest beyond ``retain``."""
        self._held.append(episode)
        self.produced = episode.episode
        while len(self._held) > self.retain:
            self._held.popleft()

    def episode(self, n: int) -> episode_pb2.Episode:
        """Held episode ``n`` (``first <= n <= produced``)."""
        return self._held[n - self.first]
