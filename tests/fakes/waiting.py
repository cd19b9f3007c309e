"""The suite's one wait-for-condition helper and its one timeout.

``until`` polls a condition on the event loop's own clock, so the same call waits in real time
on a real loop and in virtual time under ``looptime`` (where a condition that never comes true
fails after ``TIMEOUT`` virtual seconds, in milliseconds of real time).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

#: Seconds any test waits for anything before it fails.
TIMEOUT = 20.0
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
