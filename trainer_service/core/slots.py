"""Job slots: how many training jobs run at once on this trainer."""

from __future__ import annotations

import threading


class SlotPool:
    """A fixed number of job slots; taking one never blocks.

    Args:
        total: Number of slots, at least 1.
    """

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a trainer needs at least one slot, got {total}")
        self._total = total
        self._busy = 0
        self._cond = threading.Condition()

    @property
    def total(self) -> int:
        """Number of slots."""
        return self._total

    @property
    def free(self) -> int:
        """Number of slots free right now."""
        with self._cond:
            return self._total - self._busy

    def try_acquire(self) -> bool:
        """Takes a slot if one is free; returns whether it did."""
        with self._cond:
            if self._busy >= self._total:
                return False
            self._busy += 1
            return True

    def release(self) -> None:
        """Gives a slot back.

        Raises:
            RuntimeError: More releases than acquisitions (a bug in the caller).
        """
        with self._cond:
            if self._busy == 0:
                raise RuntimeError("released a slot that was not taken")
            self._busy -= 1
            self._cond.notify_all()

    def wait_all_free(self, timeout: float | None = None) -> bool:
        """Blocks until every slot is free; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)
