"""Publication pacing: when the next episode of a run may be published.

One episode per ``1 / (episodes_per_second x speed)`` seconds; a negative rate means unpaced.
The pacer is pure (it reads an injected monotonic clock), so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MIN_SPEED = 0.1
MAX_SPEED = 20.0


def clamp_speed(speed: float, zero_is_default: bool = False) -> float:
    """Clamps a finite speed to ``MIN_SPEED..MAX_SPEED`` (one rule for every request).

    Args:
        speed: The requested speed.
        zero_is_default: 0 means "unset", the default 1.0 (``CreateRunRequest.speed``);
            otherwise 0 is clamped like any value (``SetRunSpeed(0)`` gives 0.1).

    Raises:
        ValueError: speed is NaN or infinite.
    """
    if not math.isfinite(speed):
        raise ValueError(f"speed must be finite, got {speed}")
    if speed == 0 and zero_is_default:
        return 1.0
    return min(MAX_SPEED, max(MIN_SPEED, speed))


class Pacer:
    """Decides how long to wait before publishing the next episode.

    The schedule is anchored on the previous publication: the next episode is due one interval
    after it. A speed change takes effect at once (the pending wait is recomputed from the same
    anchor). When episodes arrive slower than the pace they are published as they arrive; when
    a publication is late by less than one interval the cadence is kept (no drift from timer
    overshoot), otherwise the schedule restarts from now (no burst after a stall).

    Args:
        episodes_per_second: Base rate; negative (or infinite) means unpaced.
        speed: Multiplier, already clamped.
        clock: Monotonic clock in seconds.
    """

    def __init__(
        self, episodes_per_second: float, speed: float, clock: Callable[[], float]
    ) -> None:
        self._rate = episodes_per_second
        self._speed = speed
        self._clock = clock
        self._last: float | None = None

    @property
    def paced(self) -> bool:
        """False when episodes are published as fast as they arrive."""
        return self._rate > 0 and math.isfinite(self._rate)

    @property
    def interval(self) -> float:
        """Seconds between two publications at the current speed (0 when unpaced)."""
        if not self.paced:
            return 0.0
        return 1.0 / (self._rate * self._speed)

    def set_speed(self, speed: float) -> None:
        """Changes the speed; the wait for the next episode is recomputed at once."""
        self._speed = speed

    def delay(self) -> float:
        """Seconds to wait before the next episode may be published (0: publish now)."""
        if self._last is None or not self.paced:
            return 0.0
        return max(0.0, self._last + self.interval - self._clock())

    def published(self) -> None:
        """Records a publication now."""
        now = self._clock()
        if self._last is None or not self.paced:
            self._last = now
            return
        due = self._last + self.interval
        self._last = due if now - due < self.interval else now

    def restart(self) -> None:
        """Forgets the anchor (after a resume): the next episode may go out at once."""
        self._last = None
