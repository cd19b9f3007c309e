"""The harness of the gateway core's tests: settings, the real SQLite store, in-memory trainers
and the ``RunRegistry`` built in one place (``build_core``), so a change to how the core is
constructed is one edit here.

Tests run it on the event loop's clock (``clock=loop.time``), so under ``looptime`` pacing,
heartbeats, keepalives and probes all run in virtual time; the store is wrapped in
``InFlightStore`` so virtual time waits for its commits (``tests.fakes.virtual_time``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.framing import frame_payload
from gateway.core.registry import (
    EpisodeFrames,
    Finished,
    RunRegistry,
    RunSpec,
    WatchEvent,
)
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.store import open_store
from tests.fakes.memory_trainer import MemoryConnector, MemoryTrainer
from tests.fakes.virtual_time import InFlightStore
from tests.fakes.waiting import TIMEOUT, until
from trainwire.v1 import episode_pb2

#: What core tests run on unless they say otherwise: round numbers to compute with. A paced run
#: publishes one episode per 0.1 s and leads its trainer by 20 episodes; every publication
#: wakes watchers at once (no coalescing window), so the times watchers see are exact.
TEST_SETTINGS: dict[str, Any] = {
    "episode_rate": 10.0,
    "keepalive_s": 5.0,
    "heartbeat_timeout_s": 10.0,
    "lead_s": 2.0,
    "shutdown_grace_s": 1.0,
    "schedule_poll_s": 1.0,
    "trainer_call_timeout_s": 1.0,
    "live_coalesce_s": 0.0,
}


def imitation_task() -> episode_pb2.TrainTask:
    """A valid imitation task."""
    return episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
    )


def grpo_task() -> episode_pb2.TrainTask:
    """A valid grpo task."""
    return episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="models/m", dataset_path="data/d.jsonl")
    )


TASKS = {"imitation": imitation_task, "grpo": grpo_task}


@dataclass
class Watch:
    """One watcher of a run: every event it got, with the loop time it came at."""

    run_id: str
    events: list[tuple[float, WatchEvent]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    error: BaseException | None = None

    def payloads(self) -> list[bytes]:
        """The serialized episodes it got, in order, as they came."""
        return [
            frame_payload(frame)
            for _, event in self.events
            if isinstance(event, EpisodeFrames)
            for frame in event.frames
        ]

    def episodes(self) -> list[episode_pb2.Episode]:
        """Every episode it got, in order."""
        return [episode_pb2.Episode.FromString(data) for data in self.payloads()]

    def numbers(self) -> list[int]:
        """The numbers of the episodes it got, in order."""
        return [e.episode for e in self.episodes()]

    def times(self) -> list[float]:
        """When each episode reached it (loop time), in order."""
        return [
            at
            for at, event in self.events
            if isinstance(event, EpisodeFrames)
            for _ in event.frames
        ]

    def of(self, kind: type[Any]) -> list[tuple[float, Any]]:
        """Its events of one kind, with their times."""
        return [(at, event) for at, event in self.events if isinstance(event, kind)]

    @property
    def finished(self) -> TrainingRun | None:
        """The run it finished with (None while it runs)."""
        ends = self.of(Finished)
        return ends[-1][1].run if ends else None

    async def ended(self, timeout: float = TIMEOUT) -> None:
        """Waits (at most ``timeout`` seconds) for the watch to end."""
        await until(
            lambda: self.task is not None and self.task.done(), f"watch of {self.run_id}", timeout
        )

    def at(self, episode: int) -> float:
        """When episode ``episode`` reached it."""
        return self.times()[self.numbers().index(episode)]


class Core:
    """A running core and what it is made of.

    Attributes:
        registry: The core under test.
        connector: The in-memory trainers and the record of every call to them.
        settings: Its settings.
        db: Where its store is (``:memory:`` or a file).
        store: Its store (the real one, wrapped for virtual time).
        health: Every health change the core reported (``on_health``), in order.
    """

    def __init__(self, settings: CoreSettings, connector: MemoryConnector, db: str) -> None:
        self.settings = settings
        self.connector = connector
        self.db = db
        self.health: list[bool] = []
        self.registry, self.store = build_core(settings, connector, db, self.health.append)
        self._watches: list[Watch] = []

    @property
    def trainer(self) -> MemoryTrainer:
        """The first trainer."""
        return next(iter(self.connector.trainers.values()))

    async def create(
        self,
        max_episodes: int = 20,
        kind: str = "imitation",
        speed: float = 0.0,
        episodes_per_second: float = 0.0,
        request_id: str = "",
        checkpoint_every: int = 0,
        keep_checkpoints: int = 0,
        processes: int = 0,
    ) -> TrainingRun:
        """Creates a run (0 speed/rate: the defaults; ``processes``: a grpo task's
        ``num_processes``)."""
        task = TASKS[kind]()
        if processes:
            task.grpo.num_processes = processes
        spec = RunSpec(
            task=task,
            config=episode_pb2.TrainConfig(
                max_episodes=max_episodes,
                seed=7,
                checkpoint_every=checkpoint_every,
                keep_checkpoints=keep_checkpoints,
            ),
            speed=speed,
            episodes_per_second=episodes_per_second,
            request_id=request_id,
        )
        return await self.registry.create(spec)

    async def run(self, run_id: str) -> TrainingRun:
        """The run now."""
        return await self.registry.get(run_id)

    async def wait_state(
        self, run_id: str, *states: RunState, timeout: float = TIMEOUT
    ) -> TrainingRun:
        """Waits (at most ``timeout`` seconds) until the run is in one of ``states``; returns
        it."""

        async def reached() -> TrainingRun | None:
            run = await self.registry.get(run_id)
            return run if run.state in states else None

        names = "/".join(s.name for s in states)
        return await until(reached, f"run {run_id} {names}", timeout)

    async def wait_parked(self, run_id: str, timeout: float = 60.0) -> TrainingRun:
        """Waits (at most ``timeout`` seconds) until the run is parked; returns it."""

        async def parked() -> TrainingRun | None:
            run = await self.registry.get(run_id)
            return run if run.parked else None

        return await until(parked, f"run {run_id} parked", timeout)

    async def wait_episode(self, run_id: str, episode: int) -> TrainingRun:
        """Waits until the run published ``episode``; returns it."""

        async def reached() -> TrainingRun | None:
            run = await self.registry.get(run_id)
            return run if run.episode >= episode else None

        return await until(reached, f"run {run_id} at episode {episode}")

    def watch(self, run_id: str, after_episode: int = 0) -> Watch:
        """Starts a watcher that records every event (ends with the run, or on shutdown)."""
        watch = Watch(run_id)
        loop = asyncio.get_running_loop()

        async def consume() -> None:
            try:
                async for event in self.registry.watch(run_id, after_episode):
                    watch.events.append((loop.time(), event))
            except Exception as exc:  # ShuttingDown, RunNotFound: the test reads it
                watch.error = exc

        watch.task = asyncio.create_task(consume(), name=f"watch-{run_id}")
        self._watches.append(watch)
        return watch

    async def restart(self, meanwhile: Callable[[], object] = lambda: None) -> None:
        """Shuts the core down (its trainers keep their jobs), calls ``meanwhile`` and starts a
        new core on the same store file and trainers."""
        if self.db == ":memory:":
            raise ValueError("a restart needs a store file (db=tmp_path / ...)")
        await self.stop()
        meanwhile()
        self.registry, self.store = build_core(
            self.settings, self.connector, self.db, self.health.append
        )
        await self.registry.start()

    async def stop(self) -> None:
        """Shuts the core down and ends its watches."""
        await self.registry.shutdown()
        watches, self._watches = self._watches, []
        for watch in watches:
            if watch.task is not None:
                await asyncio.wait([watch.task], timeout=1.0)
                watch.task.cancel()


def core_settings(trainers: tuple[str, ...], **overrides: Any) -> CoreSettings:
    """``TEST_SETTINGS`` with these trainers and overrides."""
    return dataclasses.replace(CoreSettings(trainers=trainers, **TEST_SETTINGS), **overrides)


def build_core(
    settings: CoreSettings,
    connector: MemoryConnector,
    db: str,
    on_health: Callable[[bool], None] = lambda healthy: None,
) -> tuple[RunRegistry, InFlightStore]:
    """The one place a test core is constructed: the real store of ``db`` (wrapped for virtual
    time), the connector, and the loop's clock for pacing, keepalives and probes."""
    store = InFlightStore(open_store(db))
    registry = RunRegistry(
        settings,
        store,
        connector,
        clock=asyncio.get_running_loop().time,
        on_health=on_health,
        checkpoint_files=connector.checkpoints,
    )
    return registry, store


@contextlib.asynccontextmanager
async def running_core(
    *trainers: MemoryTrainer, db: str = ":memory:", **settings: Any
) -> AsyncIterator[Core]:
    """A started core over these trainers (one default trainer ``t1`` when none); shut down
    on exit.

    Args:
        trainers: The trainers, in the order the scheduler tries them.
        db: The store (``:memory:``; a file for restarts).
        settings: Overrides of ``TEST_SETTINGS``.
    """
    connector = MemoryConnector(trainers or (MemoryTrainer("t1"),))
    core = Core(core_settings(connector.addresses, **settings), connector, db)
    await core.registry.start()
    try:
        yield core
    finally:
        await core.stop()
