"""Signals for a process whose main thread waits for them: a handler that takes no lock.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is,
inside a lock it holds included. A handler that sets a ``threading.Event`` takes the lock of the
event's condition, which the main thread holds for a moment each time it waits on the event: a
signal landing in that moment deadlocks the process for good. ``SignalInbox``'s handler only appends
the signal's number to a deque, which takes no lock, and the main thread polls the deque: a signal
delivered to another thread (gRPC's, torch's) runs its handler only when the main thread next runs
bytecode, so one blocking wait could miss it, and a poll every ``POLL_S`` cannot.
"""

from __future__ import annotations

import collections
import math
import signal
import time
from collections.abc import Iterable
from types import FrameType

#: Seconds between two looks at the inbox.
POLL_S = 0.1


class SignalInbox:
    """Receives ``signals`` from now on (installs their handlers) and hands them to the main
    thread in the order they came. Build it in the main thread, before anything tells the
    world the process is ready, so a signal sent on seeing the ready line is never lost."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._received: collections.deque[int] = collections.deque()
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self._received.append(signum)

    def next(self, timeout: float | None = None) -> signal.Signals | None:
        """The oldest signal not yet taken, waiting for one up to ``timeout`` seconds (``None``:
        for ever); ``None`` if none came in time."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while not self._received:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(POLL_S, left))
        return signal.Signals(self._received.popleft())
