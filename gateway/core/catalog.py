"""The catalogue of runs: create (idempotent by request id), get, list and delete, the
validated request a new run comes from (``RunSpec``), and the freshest copy of a run wherever
it is (its driver, an end the store could not take yet, or the store).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.core.driver import RunDriver
from gateway.core.errors import (
    IllegalTransition,
    InvalidRequest,
    RunNotFound,
    ShuttingDown,
    StoreUnavailable,
    TooManyPending,
)
from gateway.core.forks import ForkPoint, fork_point
from gateway.core.observer import Observer
from gateway.core.pacing import clamp_speed
from gateway.core.page_cache import PageCache
from gateway.core.placement import rewards_needed, slots_needed
from gateway.core.recovery import UnsavedEnds
from gateway.core.router import ReplicaRouter
from gateway.core.runs import RunState, TrainingRun
from gateway.core.scheduler import Scheduler
from gateway.core.search import run_query
from gateway.core.settings import CoreSettings
from gateway.core.store import STORE_MESSAGE, DuplicateRequest, Store, StoreWriteFailed
from gateway.core.table import RunTable
from trainwire.contract import (
    REWARD_FUNCTIONS,
    FieldViolation,
    check_display_name,
    check_labels,
    check_run_id,
    display_run_id,
    task_kind,
)
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

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
    labels: dict[str, str] = field(default_factory=dict)
    #: Fork from this run's checkpoint (``fork_episode``, 0: its latest); "" : from scratch.
    fork_run_id: str = ""
    fork_episode: int = 0


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


def require_run_id(run_id: str) -> None:
    violations = check_run_id(run_id)
    if violations:
        # A bad id is never echoed whole and never goes into trailing metadata.
        raise InvalidRequest(
            f"run_id {display_run_id(run_id)}: {violations[0].description}", violations
        )


class RunCatalog:
    """Creates, finds, lists and deletes runs (see the module docstring).

    Args:
        settings: Default rate, pending limit.
        store: Where runs are kept.
        table: The active runs (a new run's driver goes there).
        scheduler: Where a new run queues.
        router: With replicas, where a new run waits as a candidate and how runs driven
            elsewhere look (None: every run is driven here).
        unsaved: Final states the store could not take yet.
        pages: Cached history pages (a deleted run's are dropped).
        observer: Metrics hooks.
        make_driver: A new driver of a run driven here.
        now: Wall time in Unix nanoseconds.
    """

    def __init__(
        self,
        settings: CoreSettings,
        store: Store,
        table: RunTable,
        scheduler: Scheduler,
        router: ReplicaRouter | None,
        unsaved: UnsavedEnds,
        pages: PageCache,
        observer: Observer,
        make_driver: Callable[[TrainingRun], RunDriver],
        now: Callable[[], int],
    ) -> None:
        self._settings = settings
        self._store = store
        self._table = table
        self._scheduler = scheduler
        self._router = router
        self._unsaved = unsaved
        self._pages = pages
        self._observer = observer
        self._make_driver = make_driver
        self._now = now

    async def create(self, spec: RunSpec) -> TrainingRun:
        """Creates a run (or returns the one created with the same request id).

        Raises:
            ShuttingDown: the gateway is stopping.
        """
        if self._table.closing:
            raise ShuttingDown("the gateway is shutting down; cannot create a run")
        rid = spec.request_id
        if not rid:
            return await self._insert(spec)

        async def once() -> tuple[TrainingRun, bool]:
            existing = await self._store.find_request(rid)
            if existing is None:
                try:
                    return await self._insert(spec), False
                except DuplicateRequest:  # the same request, just created by another replica
                    existing = await self._store.find_request(rid)
                    if existing is None:
                        raise
            _check_same_request(rid, existing, spec)
            return existing, True

        (run, seen), joined = await self._table.single_flight(rid, once)
        if joined:
            _check_same_request(rid, run, spec)
        elif seen:
            _LOGGER.info(
                "run %s: request_id %r seen before; returning it",
                run.id,
                rid,
                extra={"run_id": run.id},
            )
        return self.current(run)

    def current(self, run: TrainingRun) -> TrainingRun:
        """The freshest copy of a run: its driver's, an end the store could not take yet, or
        what the store has (with replicas: a run another replica drives, or none yet)."""
        driver = self._table.get(run.id)
        if driver is not None:
            return driver.snapshot()
        current = (self._unsaved.get(run.id) or run).snapshot()
        if current.state.active and self._router is not None:
            current = self._router.elsewhere(current)
        return current

    async def _fork_point(self, spec: RunSpec) -> ForkPoint:
        """Where a fork starts (see ``gateway.core.forks``).

        Raises:
            InvalidRequest: no such parent run (``fork_from.run_id`` named: the request is
                bad, CreateRun's NOT_FOUND would read as the new run's), or a fork it does not
                allow.
        """
        parent_id = spec.fork_run_id
        try:
            parent = await self.get(parent_id)
        except RunNotFound:
            raise InvalidRequest(
                f"cannot fork: there is no run {parent_id!r} (fork_from.run_id)",
                [FieldViolation("fork_from.run_id", f"no run {parent_id!r}")],
            ) from None
        return await fork_point(self._store, parent, spec.task, spec.config, spec.fork_episode)

    def _check_fits(self, spec: RunSpec) -> None:
        """Refuses a job of several slots (a GRPO job of several processes) bigger than the
        slots of every answering trainer that offers its kind together: it would wait forever.
        While none of them has answered it may wait, and so does a job of one slot (as it
        always did).

        Raises:
            InvalidRequest: naming ``task.grpo.num_processes`` (only GRPO jobs take more than
                one slot).
        """
        kind = task_kind(spec.task)
        slots = slots_needed(spec.task)
        capacity = self._scheduler.capacity(kind)
        if slots == 1 or capacity is None or slots <= capacity[0]:
            return
        total, each = capacity
        raise InvalidRequest(
            f"cannot create the run: task.grpo.num_processes is {slots}, but the trainers that "
            f"offer {kind} have {total} slots in all ({each})",
            [
                FieldViolation(
                    "task.grpo.num_processes",
                    f"{slots}; at most {total}, the slots of every trainer that offers {kind} "
                    f"together ({each})",
                )
            ],
        )

    def _check_rewards(self, spec: RunSpec) -> None:
        """Refuses a GRPO task naming a reward function (``MODULE:FUNCTION``, from a trainer's
        ``--reward-module``) that no trainer offering GRPO has offered since the gateway
        started: no trainer could ever run it. While none of them has answered it may wait.

        Raises:
            InvalidRequest: naming ``task.grpo.reward_functions[i]`` of each such reward.
        """
        kind = task_kind(spec.task)
        needed = rewards_needed(spec.task)
        offered = self._scheduler.reward_functions(kind) if needed else None
        if offered is None:
            return
        custom = sorted(name for name in offered if name not in REWARD_FUNCTIONS)
        listed = ", ".join(custom) or "none"
        missing = [
            (f"task.grpo.reward_functions[{i}]", name)
            for i, name in enumerate(spec.task.grpo.reward_functions)
            if name in needed and name not in offered
        ]
        if missing:
            field, name = missing[0]
            raise InvalidRequest(
                f"cannot create the run: no trainer offers the reward function {name!r} ({field})",
                [
                    FieldViolation(
                        field,
                        f"no trainer offers {name!r}; the trainers' --reward-module rewards: "
                        f"{listed}",
                    )
                    for field, name in missing
                ],
            )

    async def _insert(self, spec: RunSpec) -> TrainingRun:
        self._check_fits(spec)
        self._check_rewards(spec)
        fork = await self._fork_point(spec) if spec.fork_run_id else None
        if not self._store.writable:
            raise StoreUnavailable(f"cannot create a run: {STORE_MESSAGE}")
        limit = self._settings.max_pending
        if self._scheduler.waiting >= limit:
            raise TooManyPending(
                f"the gateway already has {self._scheduler.waiting} runs waiting for a trainer "
                f"(--max-pending {limit}); try again when some have started"
            )
        rate = spec.episodes_per_second or self._settings.episode_rate
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
            labels=dict(spec.labels),
        )
        if fork is not None:
            # Its history starts after the fork episode, with the parent's counters there.
            run.fork_run_id, run.fork_episode = fork.run_id, fork.episode
            run.episode = run.trainer_episode = fork.episode
            run.reward, run.best_reward = fork.reward, fork.best_reward
        try:
            run.seq = await self._store.insert_run(run)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot create a run: {STORE_MESSAGE}") from None
        if self._table.closing:
            raise ShuttingDown(f"the gateway is shutting down; run {run.id!r} was not started")
        # With replicas, a new run is a candidate: the replica that places it claims it.
        driver = None
        if self._router is None:
            driver = self._make_driver(run)
            self._table.add(driver)
        self._observer.run_created(run.id)
        self._observer.run_state_changed(run.id, run.state.name)
        _LOGGER.info(
            "run %s created (%s, %d episodes, %s)%s",
            run.id,
            task_kind(run.task),
            run.config.max_episodes,
            "unpaced" if rate < 0 else f"{rate:g} episodes/s x {run.speed:g}",
            f", forked from run {run.fork_run_id} at episode {run.fork_episode}"
            if run.fork_run_id
            else "",
            extra={"run_id": run.id, "event": "created"},
        )
        if driver is None:
            assert self._router is not None
            self._router.candidate(run)
            return self.current(run)
        self._scheduler.enqueue(driver)
        return driver.snapshot()

    async def get(self, run_id: str) -> TrainingRun:
        """The run (a snapshot).

        Raises:
            InvalidRequest: empty run id.
            RunNotFound: no such run.
        """
        require_run_id(run_id)
        driver = self._table.get(run_id)
        if driver is not None:
            return driver.snapshot()
        run = await self._store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return self.current(run)

    async def list_runs(
        self,
        page_size: int,
        page_token: str,
        state: RunState | None,
        filter_text: str = "",
        order_by: str = "",
    ) -> tuple[list[TrainingRun], str]:
        """A page of the runs a search finds (newest first unless ``order_by`` says
        otherwise) and the token of the next page ("" on the last).

        The filter and order read the store's committed values (``gateway.core.search``);
        each run found is then returned as ``current`` has it, which may differ for a moment
        (a pause shows before the store has it).

        Raises:
            InvalidRequest: page_size out of 0..1000; a bad filter, order_by or page_token.
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidRequest(
                f"page_size {page_size} is not in 0..{MAX_PAGE_SIZE}",
                [FieldViolation("page_size", f"{page_size}; need 0..{MAX_PAGE_SIZE}")],
            )
        limit = page_size or DEFAULT_PAGE_SIZE
        query = run_query(filter_text, order_by, state, page_token, limit)
        page = await self._store.list_runs(query)
        return [self.current(r) for r in page.runs], query.page_token(page.after)

    async def update(
        self, run_id: str, display_name: str | None, labels: Mapping[str, str] | None
    ) -> TrainingRun:
        """Sets a run's display name and/or labels (None: left as they are), active or finished;
        returns the run as updated.

        Raises:
            InvalidRequest: a bad run id, display name or label.
            RunNotFound: no such run.
            StoreUnavailable: the database cannot be written.
        """
        require_run_id(run_id)
        violations = []
        if display_name is not None:
            violations += check_display_name(display_name, "run.display_name")
        if labels is not None:
            violations += check_labels(labels, "run.labels")
        if violations:
            raise InvalidRequest(
                f"cannot update run {run_id!r}: {violations[0].field}: {violations[0].description}",
                violations,
                run_id,
            )
        current = await self.get(run_id)
        name = current.display_name if display_name is None else display_name
        new_labels = dict(current.labels if labels is None else labels)
        try:
            found = await self._store.update_metadata(run_id, name, new_labels)
        except StoreWriteFailed:
            raise StoreUnavailable(f"cannot update run {run_id!r}: {STORE_MESSAGE}") from None
        if not found:
            raise RunNotFound(run_id)
        driver = self._table.get(run_id)
        if driver is not None:
            driver.take_metadata(name, new_labels)
        _LOGGER.info("run %s updated", run_id, extra={"run_id": run_id, "event": "updated"})
        return await self.get(run_id)

    async def delete(self, run_id: str) -> TrainingRun:
        """Deletes a finished run and its history; returns the run as it was.

        Raises:
            RunNotFound: no such run.
            IllegalTransition: the run is active.
        """
        require_run_id(run_id)
        driver = self._table.get(run_id)
        if driver is not None and driver.finalizing:
            await driver.ended()  # its final state is being stored
            driver = self._table.get(run_id)
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
