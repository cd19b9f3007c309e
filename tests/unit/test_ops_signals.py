"""``trainwire_ops.signals.SignalInbox``: signals handed to the main thread in order, a wait
that ends, and a handler that takes no lock (a storm of signals never hangs the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.fakes.waiting import TIMEOUT
from trainwire_ops.signals import SignalInbox


@pytest.fixture
def restored() -> Iterator[None]:
    """The handlers of SIGUSR1 and SIGUSR2 as they were before the test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_signals_come_out_in_the_order_they_came(restored: None) -> None:
    inbox = SignalInbox((signal.SIGUSR1, signal.SIGUSR2))
    assert inbox.next(timeout=0) is None
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert inbox.next(timeout=TIMEOUT) is signal.SIGUSR2
    assert inbox.next(timeout=TIMEOUT) is signal.SIGUSR1
    assert inbox.next(timeout=0) is None


def test_a_wait_without_a_signal_ends_at_its_timeout(restored: None) -> None:
    inbox = SignalInbox((signal.SIGUSR1,))
    began = time.monotonic()
    assert inbox.next(timeout=0.05) is None
    assert time.monotonic() - began >= 0.05


STORM = textwrap.dedent(
    """
    import os, signal, sys, threading
    from trainwire_ops.signals import SignalInbox

    inbox = SignalInbox((signal.SIGUSR1, signal.SIGTERM))
    def storm():
        for _ in range(3000):
            os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=storm, daemon=True).start()
    seen = 0
    while (sig := inbox.next()) is signal.SIGUSR1:
        seen += 1
    print(sig.name, seen > 0, flush=True)
    """
)


def test_a_storm_of_signals_while_the_main_thread_waits_never_hangs() -> None:
    """The deadlock this replaces: a handler setting a ``threading.Event`` while the main
    thread held the event's lock, waiting on it (a process given 3000 signals that way hangs
    within a few hundred)."""
    done = subprocess.run(
        [sys.executable, "-c", STORM], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert (done.returncode, done.stdout) == (0, "SIGTERM True\n"), done.stderr
