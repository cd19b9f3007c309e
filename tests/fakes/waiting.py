"""The suite's one wait-for-condition helper and its one timeout.

``until`` polls a condition on the event loop's own clock, so the same call waits in real time
on a real loop and in virtual time under ``looptime`` (where a condition that never comes true
fails after ``TIMEOUT`` virtual seconds, in milliseconds of real time). ``wait_for`` is its twin
for tests that wait on a thread (no event loop), on ``time.monotonic``.

``TIMEOUT`` bounds every wait and every call of a test: it only decides how long a failing test
takes to fail, so it is generous. ``JOB_TIMEOUT`` is the one longer deadline: that of a stream or
a wait that spans a whole training job (a watch from a run's start to its end, a GRPO job on the
CPU) rather than one step of it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

#: Seconds any test waits for anything before it fails.
TIMEOUT = 20.0
#: Seconds a stream or wait that spans a whole training job may take (a watch from a run's start
#: to its end, a GRPO job's stream): the one deadline longer than ``TIMEOUT``.
JOB_TIMEOUT = 180.0
#: Seconds between two looks at a condition.
POLL_S = 0.01


async def until(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    """Waits until ``condition()`` (sync or async) returns something truthy; returns it.

    Raises:
        AssertionError: not within ``timeout`` seconds of the loop's clock; says ``what`` was
            awaited and the last value seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last: {value!r}"
            )
        await asyncio.sleep(POLL_S)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    """``until`` for a thread: waits until ``condition()`` returns something truthy; returns it.

    Raises:
        AssertionError: not within ``timeout`` seconds (``time.monotonic``); says ``what`` was
            awaited and the last value seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last: {value!r}"
            )
        time.sleep(POLL_S)
