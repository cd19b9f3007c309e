"""Credit for a run's trainer: how far it may train ahead of what the gateway published.

Grants follow commits: the trainer may hold ``lead`` episodes beyond the published one, so it
trains at the run's pace when publication is slow, stops when the run is paused, and never runs
further ahead than it keeps for a re-attach. A grant goes out when it moves the credit forward
by at least a quarter of the lead (or reaches the end), at most one at a time. Pure: no I/O,
no clock; the driver sends what ``due`` returns and reports back with ``sent``.

Invariant (with the driver): ``published <= trainer_episode <= granted`` and
``granted - published <= lead`` at the time of the last grant.
"""

from __future__ import annotations

import math

#: The smallest lead a paced run is granted, in episodes.
MIN_LEAD = 4
#: The credit window of an unpaced run, in episodes (far below what a trainer holds for a
#: re-attach, 1024 by default).
UNPACED_WINDOW = 256


def lead_for(rate: float | None, lead_s: float) -> int:
    """The credit a trainer may hold beyond the published episode.

    Args:
        rate: Episodes per second published (rate x speed); None when unpaced.
        lead_s: Seconds of that rate the trainer may run ahead.
    """
    if rate is None:
        return UNPACED_WINDOW
    return max(MIN_LEAD, math.ceil(lead_s * rate))


class CreditWindow:
    """The credit granted to one run's trainer.

    Args:
        max_episodes: The run's last episode (no grant goes beyond it).
        granted: What a previous stream was already granted (0: nothing).
    """

    __slots__ = ("granted", "in_flight", "max_episodes")

    def __init__(self, max_episodes: int, granted: int = 0) -> None:
        self.max_episodes = max_episodes
        #: The furthest episode the trainer may train (as far as the gateway knows it was told).
        self.granted = granted
        #: A grant was handed out and its answer is not back yet.
        self.in_flight = False

    def target(self, published: int, lead: int, paused: bool) -> int:
        """How far the trainer may train now: the current grant while paused."""
        if paused:
            return self.granted
        return min(self.max_episodes, published + lead)

    def opening(self, published: int, lead: int, paused: bool) -> int:
        """The grant a new stream opens with (the current one while a grant is in flight),
        counted as granted."""
        grant = self.granted if self.in_flight else self.target(published, lead, paused)
        self.granted = max(self.granted, grant)
        return grant

    def due(self, published: int, lead: int) -> int | None:
        """The grant to send now for a running run, or None; a returned grant is in flight
        until :meth:`sent`."""
        if self.in_flight:
            return None
        target = self.target(published, lead, paused=False)
        step = max(1, lead // 4)
        if target - self.granted < step and target < self.max_episodes:
            return None
        if target <= self.granted:
            return None
        self.in_flight = True
        return target

    def sent(self, target: int, delivered: bool) -> None:
        """The answer to the grant in flight: ``delivered`` when the trainer took it."""
        if delivered:
            self.granted = max(self.granted, target)
        self.in_flight = False
