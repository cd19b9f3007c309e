"""The run registry's runs: create (idempotent by request id), get, list and delete, and the
validated request a new run comes from (``RunSpec``).

``RunsMixin`` is part of ``RunRegistry`` (``gateway.core.registry``; split off to keep each
module readable in one sitting).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.settings import CoreSettings
from gateway.core.driver import DriverContext, RunDriver
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    RunNotFound,
    ShuttingDown,
    StoreUnavailable,
    TooManyPending,
)
from gateway.core.history import PageCache
from gateway.core.observer import Observer
from gateway.core.pacing import clamp_speed
from gateway.core.registry_replicas import _elsewhere_detail
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.store import STORE_MESSAGE, DuplicateRequest, Store, StoreWriteFailed
from trainwire.contract import FieldViolation, check_run_id, display_run_id, task_kind
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger("gateway.core.registry")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A validated request for a new run."""

    task: episode_pb2.TrainTask
    config: episode_pb2.TrainConfig
    speed: float = 0.0
    episodes_per_second: float = 0.0
    request_id: str = ""
    display_name: str = ""
    creator: str = ""  # the authenticated caller's name ("" without authentication)
    #: The fingerprint of the request (without its request_id): the same request_id with
    #: another fingerprint is a reused key, not a retry.
    request_hash: str = ""


def _check_same_request(request_id: str, run: TrainingRun, spec: RunSpec) -> None:
    """A request_id names one request: the same key with another request is refused.

    Raises:
        InvalidRequest: the fingerprints differ (runs stored before fingerprints match any).
    """
    if run.request_hash in ("", spec.request_hash):
        return
    raise InvalidRequest(
        f"request_id {request_id!r} was used for a different request (run {run.id}); an "
        "idempotency key names one request",
        [FieldViolation("request_id", f"already used by run {run.id} for another request")],
    )


def _require_run_id(run_id: str) -> None:
    violations = check_run_id(run_id)
    if violations:
        # A bad id is never echoed whole and never goes into trailing metadata.
        raise InvalidRequest(
            f"run_id {display_run_id(run_id)}: {violations[0].description}", violations
        )


class RunsMixin:
    """See the module docstring; ``RunRegistry`` provides these attributes."""

    _config: CoreSettings
    _store: Store
    _observer: Observer
    _shared: bool
    _active: dict[str, RunDriver]
    _creating: dict[str, asyncio.Future[TrainingRun]]
    _unsaved: dict[str, TrainingRun]
    _ctx: DriverContext
    _pages: PageCache
    _closing: bool
    _now: Callable[[], int]
    scheduler: Scheduler

    # Defined by LifecycleMixin:
    _require_writable: Callable[[str], None]

    # -- runs --------------------------------------------------------------------------------

    async def create(self, spec: RunSpec) -> TrainingRun:
        """Creates a run (or returns the one created with the same request id).

        Raises:
            ShuttingDown: the gateway is stopping.
        """
        if self._closing:
            raise ShuttingDown("the gateway is shutting down; cannot create a run")
        rid = spec.request_id
        if not rid:
            return await self._insert(spec)
        in_flight = self._creating.get(rid)
        if in_flight is not None:
            run = await asyncio.shield(in_flight)
            _check_same_request(rid, run, spec)
            return self._current(run)
        future: asyncio.Future[TrainingRun] = asyncio.get_running_loop().create_future()
        self._creating[rid] = future
        existing: TrainingRun | None = None
        try:
            existing = await self._store.find_request(rid)
            if existing is None:
                try:
                    run = await self._insert(spec)
                except DuplicateRequest:  # the same request, just created by another replica
                    existing = await self._store.find_request(rid)
                    if existing is None:
                        raise
            if existing is not None:
                _check_same_request(rid, existing, spec)
                run = existing
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            del self._creating[rid]
        future.set_result(run)
        if existing is not None:
            _LOGGER.info(
                "run %s: request_id %r seen before; returning it",
                run.id,
                rid,
                extra={"run_id": run.id},
            )
        return self._current(run)

    def _current(self, run: TrainingRun) -> TrainingRun:
        """The freshest copy of a run: its driver's, an end the store could not take yet, or
        what the store has (with replicas: a run another replica drives, or none yet)."""
        driver = self._active.get(run.id)
        if driver is not None and driver.owned:
            return driver.snapshot()
        current = self._unsaved.get(run.id, run).snapshot()
        if self._shared and current.state.active:
            current.state_detail = _elsewhere_detail(current, driver)
        return current

    async def _insert(self, spec: RunSpec) -> TrainingRun:
        self._require_writable("create a run")
        limit = self._config.max_pending
        if self.scheduler.waiting >= limit:
            raise TooManyPending(
                f"the gateway already has {self.scheduler.waiting} runs waiting for a trainer "
                f"(--max-pending {limit}); try again when some have started"
            )
        rate = spec.episodes_per_second or self._config.episode_rate
        run = TrainingRun(
            id=uuid.uuid4().hex[:16],
            task=spec.task,
            config=spec.config,
            speed=clamp_speed(spec.speed, zero_is_default=True),
            episodes_per_second=rate,
            create_time=self._now(),
            display_name=spec.display_name,
            request_id=spec.request_id,
            creator=spec.creator,
            request_hash=spec.request_hash,
        )
        try:
            run.seq = await self._store.insert_run(run)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot create a run: {STORE_MESSAGE}") from None
        if self._closing:
            raise ShuttingDown(f"the gateway is shutting down; run {run.id!r} was not started")
        driver = RunDriver(run, self._ctx)
        driver.owned = not self._shared  # a replica claims it when it places it
        self._active[run.id] = driver
        self._observer.run_created(run.id)
        self._observer.run_state_changed(run.id, run.state.name)
        _LOGGER.info(
            "run %s created (%s, %d episodes, %s)",
            run.id,
            task_kind(run.task),
            run.config.max_episodes,
            "unpaced" if rate < 0 else f"{rate:g} episodes/s x {run.speed:g}",
            extra={"run_id": run.id, "event": "created"},
        )
        self.scheduler.enqueue(driver)
        return driver.snapshot()

    async def get(self, run_id: str) -> TrainingRun:
        """The run (a snapshot).

        Raises:
            InvalidRequest: empty run id.
            RunNotFound: no such run.
        """
        _require_run_id(run_id)
        driver = self._active.get(run_id)
        if driver is not None and driver.owned:
            return driver.snapshot()
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return self._current(run)

    async def list_runs(
        self, page_size: int, before_seq: int | None, state: RunState | None
    ) -> tuple[list[TrainingRun], int | None]:
        """A page of runs, newest first, and the cursor of the next page (None on the last).

        Raises:
            InvalidRequest: page_size out of 0..1000.
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidRequest(
                f"page_size {page_size} is not in 0..{MAX_PAGE_SIZE}",
                [FieldViolation("page_size", f"{page_size}; need 0..{MAX_PAGE_SIZE}")],
            )
        limit = page_size or DEFAULT_PAGE_SIZE
        rows = await self._store.list_runs(state, before_seq, limit + 1)
        more = len(rows) > limit
        runs = [self._current(r) for r in rows[:limit]]
        return runs, (runs[-1].seq if more else None)

    async def delete(self, run_id: str) -> TrainingRun:
        """Deletes a finished run and its history; returns the run as it was.

        Raises:
            RunNotFound: no such run.
            IllegalTransition: the run is active.
        """
        _require_run_id(run_id)
        driver = self._active.get(run_id)
        if driver is not None:
            raise IllegalTransition(
                f"cannot delete run {run_id!r}: it is {driver.run.state.name}; stop it first",
                run_id,
            )
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        if run.state.active:  # driven by another replica
            raise IllegalTransition(
                f"cannot delete run {run_id!r}: it is {run.state.name}; stop it first", run_id
            )
        try:
            await self._store.delete_run(run_id)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot delete run {run_id!r}: {STORE_MESSAGE}") from None
        self._pages.forget(run_id)
        self._observer.run_deleted(run_id, run.state.name)
        _LOGGER.info("run %s deleted", run_id, extra={"run_id": run_id, "event": "deleted"})
        return run
