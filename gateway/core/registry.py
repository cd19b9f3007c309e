"""The run registry: creation, FIFO scheduling on trainers, driving, controls and watching.

``RunRegistry`` is the gateway's business logic, on one asyncio event loop (no locks: every
method runs between two awaits atomically). Each active run has one driver task that reads its
trainer stream, checks every episode against the contract, waits for its pace (and while the
run is paused stops reading, so gRPC flow control throttles the trainer), and hands the episode
to the store. Only when the store has committed it does the episode enter the run's
``EpisodeLog`` and become visible to watchers. Watchers are plain coroutines walking the log.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from gateway.config import GatewayConfig
from gateway.core.errors import IllegalTransition, InvalidRequest, RunNotFound, ShuttingDown
from gateway.core.history import PAGE_EPISODES, EpisodeLog, PageCache, encode_frame, split_batches
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer, clamp_speed
from gateway.core.runs import (
    CONTRACT_MESSAGE,
    INTERRUPTED_MESSAGE,
    LOST_MESSAGE,
    UNEXPECTED_MESSAGE,
    RunState,
    TrainingRun,
)
from gateway.core.store import EpisodeRecord, SqliteStore, StoreThread
from gateway.core.trainers import (
    Capabilities,
    TrainerBusy,
    TrainerConnector,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerLost,
    TrainerStream,
)
from trainwire.contract import ContractViolation, FieldViolation, StreamChecker, task_kind
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Episodes a run may have handed to the store but not yet seen committed; the driver waits
#: (and so stops reading from its trainer) beyond this.
MAX_UNCOMMITTED = 256
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


@dataclass(frozen=True, slots=True)
class EpisodeFrames:
    """Consecutive episodes for a watcher, as frames (see ``gateway.core.history``).

    ``batch`` says they go out as one ``EpisodeBatch``; otherwise there is exactly one frame and
    it goes out as a single ``episode``.
    """

    frames: Sequence[bytes]
    batch: bool


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The history that existed at attach time has been sent."""

    last_episode: int


@dataclass(frozen=True, slots=True)
class Keepalive:
    """Nothing was sent for the keepalive interval."""

    last_episode: int
    state: RunState


@dataclass(frozen=True, slots=True)
class Finished:
    """The run finished; the final run. The last event of a watch."""

    run: TrainingRun


WatchEvent = EpisodeFrames | CaughtUp | Keepalive | Finished


class _ActiveRun:
    """Everything the registry holds for one active run."""

    __slots__ = (
        "commit_error",
        "committed",
        "control",
        "driver",
        "finalizing",
        "log",
        "pacer",
        "pending",
        "run",
    )

    def __init__(
        self, run: TrainingRun, clock: Callable[[], float], min_wake_interval: float
    ) -> None:
        self.run = run
        self.log = EpisodeLog(run.id, min_wake_interval, clock)
        self.pacer = Pacer(run.episodes_per_second, run.speed, clock)
        # Set by every control (pause, resume, speed, stop) to wake a waiting driver.
        self.control = asyncio.Event()
        # Set by every commit of this run's episodes.
        self.committed = asyncio.Event()
        self.driver: asyncio.Task[None] | None = None
        # Episodes handed to the store, awaiting commit: (episode, reward, best_reward, frame).
        self.pending: deque[tuple[int, float, float, bytes]] = deque()
        self.commit_error: BaseException | None = None
        self.finalizing = False


def _log_end(run: TrainingRun) -> None:
    """The one INFO line of a run's end: finished (DONE), stopped or failed (ERROR)."""
    extra = {"run_id": run.id, "state": run.state.name}
    if run.state is RunState.DONE:
        _LOGGER.info(
            "run %s finished: %d episodes, best reward %g",
            run.id,
            run.episode,
            run.best_reward,
            extra={**extra, "event": "finished"},
        )
    elif run.state is RunState.STOPPED:
        _LOGGER.info(
            "run %s stopped at episode %d",
            run.id,
            run.episode,
            extra={**extra, "event": "stopped"},
        )
    else:
        _LOGGER.info(
            "run %s failed at episode %d: %s",
            run.id,
            run.episode,
            run.error_message,
            extra={**extra, "event": "failed"},
        )


def _require_run_id(run_id: str) -> None:
    if not run_id:
        raise InvalidRequest("run_id is required", [FieldViolation("run_id", "required")])


class RunRegistry:
    """Owns every run of the gateway.

    Args:
        config: Gateway settings (rates, timeouts, trainers).
        store: The store thread (not yet started).
        connector: How to reach trainers.
        observer: Metrics hooks.
        clock: Monotonic clock in seconds (pacing, keepalives).
        wall_clock: Wall time in Unix nanoseconds (run timestamps).
    """

    def __init__(
        self,
        config: GatewayConfig,
        store: StoreThread,
        connector: TrainerConnector,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._config = config
        self._store = store
        self._connector = connector
        self._observer = observer or Observer()
        self._clock = clock
        self._now = wall_clock
        self._active: dict[str, _ActiveRun] = {}
        self._queue: list[tuple[int, str]] = []  # (seq, run id) of PENDING runs awaiting a slot
        self._schedule = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._creating: dict[str, asyncio.Future[TrainingRun]] = {}
        self._pages = PageCache(self._load_page, int(config.history_cache_mb * (1 << 20)))
        self._closing = False
        self._unreachable: set[str] = set()
        # Runs dispatched to a trainer that has not answered yet, per trainer: its reported
        # free slots do not count them, so they are subtracted to avoid needless busy answers.
        self._starting: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the store, marks runs left active by a crash as interrupted, and schedules."""
        self._store.start()
        interrupted = await self._store.call(
            SqliteStore.interrupt_active, INTERRUPTED_MESSAGE, self._now()
        )
        for run_id in interrupted:
            _LOGGER.warning(
                "run %s was active when the gateway stopped: now ERROR",
                run_id,
                extra={"run_id": run_id, "event": "failed"},
            )
        counts = await self._store.call(SqliteStore.count_by_state)
        self._observer.runs_loaded({state.name: n for state, n in counts.items()})
        self._scheduler = asyncio.create_task(self._schedule_loop(), name="gateway-scheduler")

    @property
    def closing(self) -> bool:
        """True once shutdown began."""
        return self._closing

    def begin_shutdown(self) -> None:
        """Refuses new runs and watches and ends open watches with ``ShuttingDown``."""
        self._closing = True
        for active in self._active.values():
            active.log.wake()

    async def shutdown(self) -> None:
        """Ends watches (``ShuttingDown``), cancels trainer streams, records active runs as
        interrupted, and flushes and closes the store."""
        self.begin_shutdown()
        if self._scheduler is None:
            return  # never started, or already shut down
        if self._scheduler is not None:
            self._scheduler.cancel()
        drivers = [a.driver for a in self._active.values() if a.driver is not None]
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)
        # Every run still here was active (or half way through finishing, its driver now
        # cancelled): record how it ended, interrupted unless it already had an end.
        for active in list(self._active.values()):
            if active.run.state.active:
                active.run.fail(INTERRUPTED_MESSAGE, self._now())
            await self._finalize(active)
        await self._store.close()
        await self._connector.close()
        self._scheduler = None
        _LOGGER.info("gateway core stopped")

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
            return (await self._insert(spec)).snapshot()
        in_flight = self._creating.get(rid)
        if in_flight is not None:
            return self._current(await asyncio.shield(in_flight))
        future: asyncio.Future[TrainingRun] = asyncio.get_running_loop().create_future()
        self._creating[rid] = future
        try:
            existing = await self._store.call(SqliteStore.find_request, rid)
            run = existing if existing is not None else await self._insert(spec)
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
        active = self._active.get(run.id)
        return (active.run if active is not None else run).snapshot()

    async def _insert(self, spec: RunSpec) -> TrainingRun:
        rate = spec.episodes_per_second or self._config.episode_rate
        run = TrainingRun(
            id=uuid.uuid4().hex[:16],
            task=spec.task,
            config=spec.config,
            speed=clamp_speed(spec.speed),
            episodes_per_second=rate,
            create_time=self._now(),
            display_name=spec.display_name,
            request_id=spec.request_id,
        )
        run.seq = await self._store.call(SqliteStore.insert_run, run)
        if self._closing:
            raise ShuttingDown(f"the gateway is shutting down; run {run.id!r} was not started")
        self._active[run.id] = _ActiveRun(run, self._clock, self._config.live_coalesce_s)
        bisect.insort(self._queue, (run.seq, run.id))
        self._schedule.set()
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
        return run

    async def get(self, run_id: str) -> TrainingRun:
        """The run (a snapshot).

        Raises:
            InvalidRequest: empty run id.
            RunNotFound: no such run.
        """
        _require_run_id(run_id)
        active = self._active.get(run_id)
        if active is not None:
            return active.run.snapshot()
        run = await self._store.call(SqliteStore.get_run, run_id)
        if run is None:
            raise RunNotFound(run_id)
        return run

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
        rows = await self._store.call(SqliteStore.list_runs, state, before_seq, limit + 1)
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
        active = self._active.get(run_id)
        if active is not None:
            raise IllegalTransition(
                f"cannot delete run {run_id!r}: it is {active.run.state.name}; stop it first",
                run_id,
            )
        run = await self._store.call(SqliteStore.get_run, run_id)
        if run is None:
            raise RunNotFound(run_id)
        await self._store.call(SqliteStore.delete_run, run_id)
        self._pages.forget(run_id)
        self._observer.run_deleted(run_id, run.state.name)
        _LOGGER.info("run %s deleted", run_id, extra={"run_id": run_id, "event": "deleted"})
        return run

    # -- controls ----------------------------------------------------------------------------

    async def _active_run(self, run_id: str, action: str) -> _ActiveRun:
        _require_run_id(run_id)
        active = self._active.get(run_id)
        if active is not None and not active.finalizing:
            return active
        run = active.run if active is not None else await self.get(run_id)
        raise IllegalTransition(f"cannot {action} run {run_id!r}: it is {run.state.name}", run_id)

    async def pause(self, run_id: str) -> TrainingRun:
        """Pauses publication (no-op when paused).

        Raises:
            RunNotFound, IllegalTransition.
        """
        active = await self._active_run(run_id, "pause")
        if active.run.pause():
            active.control.set()
            active.log.wake()
            await self._persist(active)
            _LOGGER.info(
                "run %s paused at episode %d",
                run_id,
                active.run.episode,
                extra={"run_id": run_id, "event": "paused"},
            )
        return active.run.snapshot()

    async def resume(self, run_id: str) -> TrainingRun:
        """Resumes publication at the paced rate (no-op when running).

        Raises:
            RunNotFound, IllegalTransition.
        """
        active = await self._active_run(run_id, "resume")
        if active.run.resume():
            active.pacer.restart()
            active.control.set()
            active.log.wake()
            await self._persist(active)
            _LOGGER.info(
                "run %s resumed at episode %d",
                run_id,
                active.run.episode,
                extra={"run_id": run_id, "event": "resumed"},
            )
        return active.run.snapshot()

    async def set_speed(self, run_id: str, speed: float) -> TrainingRun:
        """Changes the speed (clamped to 0.1..20), effective at once.

        Raises:
            InvalidRequest: non-finite speed.
            RunNotFound, IllegalTransition.
        """
        _require_run_id(run_id)
        active = self._active.get(run_id)
        if active is None or active.finalizing:
            run = active.run if active is not None else await self.get(run_id)
            run.snapshot().set_speed(speed)  # raises the right error for a finished run
            raise AssertionError("unreachable")  # pragma: no cover
        active.run.set_speed(speed)
        active.pacer.set_speed(active.run.speed)
        active.control.set()
        await self._persist(active)
        _LOGGER.info(
            "run %s speed %g",
            run_id,
            active.run.speed,
            extra={"run_id": run_id, "event": "speed"},
        )
        return active.run.snapshot()

    async def stop(self, run_id: str) -> TrainingRun:
        """Stops a run: cancels its trainer stream and ends it STOPPED.

        Raises:
            RunNotFound, IllegalTransition.
        """
        active = await self._active_run(run_id, "stop")
        active.run.stop(self._now())
        active.finalizing = True
        self._dequeue(run_id)
        if active.driver is not None:
            active.driver.cancel()
            await asyncio.gather(active.driver, return_exceptions=True)
        await self._finalize(active)
        return active.run.snapshot()

    async def _persist(self, active: _ActiveRun) -> None:
        await self._store.call(SqliteStore.update_run, active.run.snapshot())
        self._observer.run_state_changed(active.run.id, active.run.state.name)

    # -- scheduling --------------------------------------------------------------------------

    def _dequeue(self, run_id: str) -> None:
        self._queue = [q for q in self._queue if q[1] != run_id]

    async def _schedule_loop(self) -> None:
        while True:
            await self._schedule.wait()
            self._schedule.clear()
            while self._queue:
                try:
                    await self._place_pending()
                except Exception:  # the scheduler must survive anything
                    _LOGGER.exception("scheduling failed; retrying")
                if not self._queue:
                    break
                # No slot for the rest: wait for a freed slot, a new run, or the poll interval.
                try:
                    async with asyncio.timeout(self._config.schedule_poll_s):
                        await self._schedule.wait()
                except TimeoutError:
                    pass
                self._schedule.clear()

    async def _probe(self, address: str) -> Capabilities | None:
        try:
            caps = await self._connector.capabilities(address, self._config.trainer_call_timeout_s)
        except TrainerError as exc:
            self._observer.trainer_probed(address, None)
            if address not in self._unreachable:
                self._unreachable.add(address)
                _LOGGER.warning("trainer %s unreachable: %s", address, exc)
            return None
        self._observer.trainer_probed(address, caps)
        if address in self._unreachable:
            self._unreachable.discard(address)
            _LOGGER.info("trainer %s reachable again", address)
        return caps

    async def _place_pending(self) -> None:
        addresses = self._config.trainers
        caps = await asyncio.gather(*(self._probe(a) for a in addresses))
        free = {
            a: c.slots_free - self._starting.get(a, 0)
            for a, c in zip(addresses, caps, strict=True)
            if c is not None
        }
        providers = {a: c.providers for a, c in zip(addresses, caps, strict=True) if c is not None}
        blocked: set[str] = set()
        for seq, run_id in list(self._queue):
            active = self._active.get(run_id)
            if active is None or active.run.state is not RunState.PENDING or active.finalizing:
                self._dequeue(run_id)
                continue
            kind = task_kind(active.run.task)
            if kind in blocked:
                continue  # first in, first out: a later run of this kind must not overtake
            target = next(
                (
                    a
                    for a in addresses
                    if free.get(a, 0) > 0 and (not providers[a] or kind in providers[a])
                ),
                None,
            )
            if target is None:
                blocked.add(kind)
                continue
            free[target] -= 1
            self._starting[target] = self._starting.get(target, 0) + 1
            self._queue.remove((seq, run_id))
            active.driver = asyncio.create_task(
                self._drive(active, target), name=f"gateway-run-{run_id}"
            )

    # -- driving a run -----------------------------------------------------------------------

    async def _drive(self, active: _ActiveRun, trainer: str) -> None:
        """Runs one trainer stream to its end and records how the run ended."""
        run = active.run
        message: str | None = None
        try:
            await self._consume(active, trainer)
        except asyncio.CancelledError:
            raise  # stop or shutdown: whoever cancelled finalizes the run
        except TrainerBusy as exc:
            if run.state is RunState.PENDING:
                _LOGGER.info(
                    "run %s: trainer %s is busy; back in the queue",
                    run.id,
                    trainer,
                    extra={"run_id": run.id},
                )
                self._observer.trainer_failure(run.id, "busy")
                active.driver = None
                bisect.insort(self._queue, (run.seq, run.id))
                # Retried after the poll interval, not at once: the trainer just said it is full.
                asyncio.get_running_loop().call_later(
                    self._config.schedule_poll_s, self._schedule.set
                )
                return
            message = UNEXPECTED_MESSAGE
            _LOGGER.warning(
                "run %s: trainer %s busy mid-stream: %s",
                run.id,
                trainer,
                exc,
                extra={"run_id": run.id},
            )
        except ContractViolation as exc:
            message = CONTRACT_MESSAGE
            self._observer.contract_violation(run.id, exc.rule)
            _LOGGER.error(
                "CONTRACT VIOLATION run=%s rule=%s trainer=%s episode=%s field=%s: %s",
                run.id,
                exc.rule,
                trainer,
                exc.episode,
                exc.field,
                exc,
                extra={"run_id": run.id, "rule": exc.rule},
            )
        except TrainerFailed as exc:
            message = exc.user_message
            self._observer.trainer_failure(run.id, "failed")
            _LOGGER.warning(
                "run %s: trainer %s failed: %s", run.id, trainer, exc, extra={"run_id": run.id}
            )
        except TrainerLost as exc:
            message = LOST_MESSAGE
            self._observer.trainer_failure(run.id, "lost")
            _LOGGER.warning(
                "run %s: trainer %s stopped responding: %s",
                run.id,
                trainer,
                exc,
                extra={"run_id": run.id},
            )
        except TrainerCrashed as exc:
            message = UNEXPECTED_MESSAGE
            self._observer.trainer_failure(run.id, "crashed")
            _LOGGER.warning(
                "run %s: trainer %s stopped: %s", run.id, trainer, exc, extra={"run_id": run.id}
            )
        except Exception:
            message = UNEXPECTED_MESSAGE
            _LOGGER.exception(
                "run %s: unexpected failure driving trainer %s",
                run.id,
                trainer,
                extra={"run_id": run.id},
            )
        if active.finalizing:
            return
        active.finalizing = True
        try:
            await self._flush(active)
        except Exception:
            _LOGGER.exception("run %s: store failure", run.id, extra={"run_id": run.id})
            message = message or UNEXPECTED_MESSAGE
        if message is None:
            run.complete(self._now())
        else:
            run.fail(message, self._now())
        await self._finalize(active)

    async def _consume(self, active: _ActiveRun, trainer: str) -> None:
        run = active.run
        checker = StreamChecker.for_task(run.task, run.config, run.id)
        timeout = self._config.heartbeat_timeout_s
        stream: TrainerStream = self._connector.train(trainer, run.id, run.task, run.config)
        reserved = True  # a slot of this trainer is counted as taken until its first answer
        try:
            events = stream.__aiter__()
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        event = await events.__anext__()
                except StopAsyncIteration:
                    checker.finish()
                    return
                except TimeoutError:
                    raise TrainerLost(
                        f"no episode or heartbeat from {trainer} for {timeout:g} s"
                    ) from None
                if reserved:
                    reserved = False
                    self._started(trainer)
                if run.state is RunState.PENDING:
                    run.start(trainer, self._now())
                    await self._persist(active)
                    _LOGGER.info(
                        "run %s started on trainer %s",
                        run.id,
                        trainer,
                        extra={"run_id": run.id, "event": "started"},
                    )
                if event is None:
                    self._observer.heartbeat_received(run.id)
                    continue
                self._observer.episode_received(run.id)
                checker.check(event)
                if event.done:
                    # Rule 3: nothing may follow the done episode. The trainer closes its
                    # stream right after it, so confirming that costs one read, and a bad
                    # stream never gets to publish a done episode.
                    await self._expect_end(events, checker, trainer, run.id)
                await self._until_publishable(active)
                self._publish(active, event)
                if event.done:
                    return
        finally:
            stream.cancel()
            if reserved:
                self._started(trainer)  # never started: give the reservation back

    def _started(self, trainer: str) -> None:
        left = self._starting.get(trainer, 0) - 1
        if left > 0:
            self._starting[trainer] = left
        else:
            self._starting.pop(trainer, None)

    async def _expect_end(
        self,
        events: AsyncIterator[episode_pb2.Episode | None],
        checker: StreamChecker,
        trainer: str,
        run_id: str,
    ) -> None:
        """Reads the stream after the done episode to its end (heartbeats are tolerated).

        Raises:
            ContractViolation: an episode followed the done episode.
        """
        try:
            async with asyncio.timeout(self._config.heartbeat_timeout_s):
                while True:
                    event = await events.__anext__()
                    if event is not None:
                        checker.check(event)  # raises: rule "done"
        except StopAsyncIteration:
            return
        except TimeoutError:
            _LOGGER.warning(
                "run %s: trainer %s kept the stream open after done",
                run_id,
                trainer,
                extra={"run_id": run_id},
            )
        except TrainerError as exc:  # the episodes are complete; the trainer's end is not ours
            _LOGGER.warning(
                "run %s: trainer %s failed after done: %s",
                run_id,
                trainer,
                exc,
                extra={"run_id": run_id},
            )

    async def _until_publishable(self, active: _ActiveRun) -> None:
        """Waits while the run is paused, then for its pace."""
        run = active.run
        while True:
            if active.commit_error is not None:
                raise active.commit_error
            if run.state is RunState.PAUSED:
                active.control.clear()
                await active.control.wait()
                continue
            if len(active.pending) >= MAX_UNCOMMITTED:
                active.committed.clear()
                await active.committed.wait()
                continue
            delay = active.pacer.delay()
            if delay <= 0:
                return
            active.control.clear()
            try:
                async with asyncio.timeout(delay):
                    await active.control.wait()
            except TimeoutError:
                pass

    def _publish(self, active: _ActiveRun, episode: episode_pb2.Episode) -> None:
        """Hands an episode to the store; it becomes visible when committed."""
        # Deterministic: map entries (metrics) in key order, so the stored bytes are canonical
        # and a watcher can compare what it got with any replay byte for byte.
        data = episode.SerializeToString(deterministic=True)
        n = episode.episode
        active.pending.append((n, episode.reward, episode.best_reward, encode_frame(data)))
        active.pacer.published()
        record = EpisodeRecord(active.run.id, n, episode.reward, episode.best_reward, data)
        self._store.submit(
            SqliteStore.append_episodes, (record,), callback=partial(self._committed, active)
        )

    def _committed(self, active: _ActiveRun, _result: object, error: BaseException | None) -> None:
        active.committed.set()
        if error is not None:
            _LOGGER.error(
                "run %s: storing an episode failed: %s",
                active.run.id,
                error,
                extra={"run_id": active.run.id},
            )
            active.commit_error = error
            active.control.set()
            return
        n, reward, best, frame = active.pending.popleft()
        active.run.record_episode(n, reward, best)
        active.log.publish((frame,))
        self._observer.episodes_published(active.run.id, 1)

    async def _flush(self, active: _ActiveRun) -> None:
        """Waits until every episode handed to the store is committed (and visible)."""
        while active.pending:
            if active.commit_error is not None:
                raise active.commit_error
            active.committed.clear()
            await active.committed.wait()

    async def _finalize(self, active: _ActiveRun) -> None:
        """After the final transition: flush, persist, release the run and end its watches."""
        active.finalizing = True
        run = active.run
        try:
            await self._flush(active)
        except Exception:
            _LOGGER.exception(
                "run %s: episodes lost on the way to the store", run.id, extra={"run_id": run.id}
            )
        try:
            await self._persist(active)
        except Exception:
            _LOGGER.exception(
                "run %s: could not store its final state", run.id, extra={"run_id": run.id}
            )
        self._active.pop(run.id, None)
        self._dequeue(run.id)
        active.log.close()
        self._schedule.set()  # a trainer slot may be free now
        _log_end(run)

    # -- watching ----------------------------------------------------------------------------

    async def _load_page(self, run_id: str, first: int, last: int) -> list[bytes]:
        return await self._store.call(SqliteStore.read_episodes, run_id, first, last)

    async def watch(self, run_id: str, after_episode: int) -> AsyncIterator[WatchEvent]:
        """Streams a run's history after ``after_episode``, then its live episodes.

        Raises:
            InvalidRequest: empty run id or negative after_episode.
            RunNotFound: no such run (or deleted while replayed).
            ShuttingDown: the gateway is stopping.
        """
        _require_run_id(run_id)
        if after_episode < 0:
            raise InvalidRequest(
                f"after_episode of run {run_id!r} must be >= 0, got {after_episode}",
                [FieldViolation("after_episode", f"{after_episode}; need >= 0")],
                run_id,
            )
        if self._closing:
            raise ShuttingDown(f"the gateway is shutting down; resume watching run {run_id!r}")
        observer = self._observer
        observer.watcher_attached(run_id)
        try:
            active = self._active.get(run_id)
            events = (
                self._watch_active(active, after_episode)
                if active is not None
                else self._watch_finished(await self.get(run_id), after_episode)
            )
            async for event in events:
                if type(event) is EpisodeFrames:  # one call per message, not per episode
                    observer.episodes_sent(run_id, len(event.frames))
                yield event
        finally:
            observer.watcher_detached(run_id)

    def _check_closing(self, run_id: str, cursor: int) -> None:
        if self._closing:
            raise ShuttingDown(
                f"the gateway is shutting down; resume watching run {run_id!r} "
                f"with after_episode={cursor}",
                run_id,
            )

    async def _watch_active(
        self, active: _ActiveRun, after_episode: int
    ) -> AsyncIterator[WatchEvent]:
        log = active.log
        log.watchers += 1
        try:
            async for event in self._walk_log(active, after_episode):
                yield event
        finally:
            log.watchers -= 1

    async def _walk_log(self, active: _ActiveRun, after_episode: int) -> AsyncIterator[WatchEvent]:
        log = active.log
        run_id = log.run_id
        frames = log.frames  # the list only grows; a finished run's log stays readable
        cursor = after_episode
        attach = log.last_episode
        for lo, hi in split_batches(frames, cursor, attach):
            self._check_closing(run_id, lo)
            yield EpisodeFrames(frames[lo:hi], True)
        cursor = max(cursor, attach)
        yield CaughtUp(cursor)
        keepalive = self._config.keepalive_s
        last_sent = self._clock()
        while True:
            self._check_closing(run_id, cursor)
            visible = log.last_episode
            if visible > cursor:
                # A watcher that fell behind (slow network, unpaced run) gets its backlog in
                # batches rather than one message per episode.
                for lo, hi in split_batches(frames, cursor, visible):
                    yield EpisodeFrames(frames[lo:hi], hi - lo > 1)
                cursor = visible
                last_sent = self._clock()
                continue
            if log.closed:
                yield Finished(active.run.snapshot())
                return
            remaining = keepalive - (self._clock() - last_sent)
            if remaining <= 0:
                yield Keepalive(visible, active.run.state)
                last_sent = self._clock()
                continue
            await log.wait(remaining)

    async def _watch_finished(
        self, run: TrainingRun, after_episode: int
    ) -> AsyncIterator[WatchEvent]:
        cursor = after_episode
        last = run.episode
        while cursor < last:
            self._check_closing(run.id, cursor)
            index = cursor // PAGE_EPISODES
            page = await self._pages.page(run.id, index, last)
            first = index * PAGE_EPISODES  # episode number before the page's first
            expected = min(last, first + PAGE_EPISODES) - first
            if len(page) < expected:
                raise RunNotFound(run.id)  # deleted while being replayed
            for lo, hi in split_batches(page, cursor - first, len(page)):
                yield EpisodeFrames(page[lo:hi], True)
            cursor = first + len(page)
        yield CaughtUp(max(cursor, after_episode))
        yield Finished(run)
