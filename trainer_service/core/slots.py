"""Job slots: how many training jobs (or processes of jobs) run at once on this trainer.

A slot is one device's worth of training: on a trainer with CUDA and ``--slots auto``, slot *i*
is GPU *i*; on a CPU, or with a plain slot count, every slot names the same device. A job takes
as many slots as it runs processes (a 2-process GRPO job takes two), all at once or none, and
gives them back together.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

#: Devices that several processes of one job may share (any other device is one per process).
SHAREABLE_DEVICES = frozenset({"", "cpu"})


class SlotPool:
    """A fixed number of job slots; taking slots never blocks.

    Args:
        total: Number of slots, at least 1.
        devices: The device of each slot (``cuda:0``, ...); by default none is named.
    """

    def __init__(self, total: int, devices: Sequence[str] | None = None) -> None:
        if total < 1:
            raise ValueError(f"a trainer needs at least one slot, got {total}")
        if devices is not None and len(devices) != total:
            raise ValueError(f"{len(devices)} slot devices given for {total} slots")
        self._total = total
        self.devices: tuple[str, ...] = tuple(devices) if devices is not None else ("",) * total
        self._free = list(range(total))
        self._cond = threading.Condition()

    @property
    def total(self) -> int:
        """Number of slots."""
        return self._total

    @property
    def free(self) -> int:
        """Number of slots free right now."""
        with self._cond:
            return len(self._free)

    def most_per_job(self) -> int:
        """The most slots one job can ever hold at once: every slot, except that a device
        that cannot be shared (a GPU) counts once."""
        shareable = sum(1 for d in self.devices if d in SHAREABLE_DEVICES)
        return shareable + len({d for d in self.devices if d not in SHAREABLE_DEVICES})

    def try_acquire(self, count: int = 1) -> tuple[int, ...] | None:
        """Takes ``count`` free slots, on distinct devices unless shareable; returns their
        indices (lowest first), or ``None`` (taking nothing) when they are not free."""
        with self._cond:
            taken: list[int] = []
            devices: set[str] = set()
            for index in self._free:
                device = self.devices[index]
                if device not in SHAREABLE_DEVICES and device in devices:
                    continue
                taken.append(index)
                devices.add(device)
                if len(taken) == count:
                    for slot in taken:
                        self._free.remove(slot)
                    return tuple(taken)
            return None

    def release(self, slots: Sequence[int] | None = None) -> None:
        """Gives slots back: ``slots`` as :meth:`try_acquire` returned them, or one (any) slot.

        Raises:
            RuntimeError: A slot that is not taken (a bug in the caller).
        """
        with self._cond:
            if slots is None:
                busy = sorted(set(range(self._total)) - set(self._free))
                if not busy:
                    raise RuntimeError("released a slot that was not taken")
                slots = busy[-1:]
            if any(s in self._free or not 0 <= s < self._total for s in slots):
                raise RuntimeError(f"released slots {list(slots)} that were not taken")
            self._free.extend(slots)
            self._free.sort()
            self._cond.notify_all()

    def wait_all_free(self, timeout: float | None = None) -> bool:
        """Blocks until every slot is free; returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == self._total, timeout)
