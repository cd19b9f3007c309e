"""The runs a gateway drives: one driver per active run (with replicas, those whose lease it
holds: ``gateway.core.router`` promotes and demotes them), whether it still takes new work, and
the creates in flight by request id (so that a retried request joins the first instead of making
a second run)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

from gateway.core.driver import RunDriver

T = TypeVar("T")


class RunTable:
    """Active drivers by run id, and the creates in flight."""

    def __init__(self) -> None:
        self._drivers: dict[str, RunDriver] = {}
        self._creating: dict[str, asyncio.Future[object]] = {}
        #: True once shutdown began: no new runs, no new watches.
        self.closing = False

    def __len__(self) -> int:
        return len(self._drivers)

    def get(self, run_id: str) -> RunDriver | None:
        """The run's driver (None: not driven here)."""
        return self._drivers.get(run_id)

    def add(self, driver: RunDriver) -> None:
        """Takes a driver in."""
        self._drivers[driver.run.id] = driver

    def remove(self, driver: RunDriver) -> bool:
        """Lets a driver go; False when another one holds its run now."""
        if self._drivers.get(driver.run.id) is driver:
            del self._drivers[driver.run.id]
            return True
        return False

    def drivers(self) -> list[RunDriver]:
        """Every driver."""
        return list(self._drivers.values())

    async def single_flight(self, key: str, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Runs ``work`` once per key at a time: a second call while the first runs gets the
        first one's result (or error). Returns the result and whether it joined another call.
        """
        in_flight = self._creating.get(key)
        if in_flight is not None:
            return cast(T, await asyncio.shield(in_flight)), True
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._creating[key] = future
        try:
            result = await work()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # read here: the joiners raise it
            raise
        finally:
            del self._creating[key]
        future.set_result(result)
        return result, False
