"""The replica router's candidates, at its seams (fake leases and scheduler, no database): a
placed candidate is claimed and promoted with its placement, or gives the placement back; a
control and a placement of the same candidate claim it once; a resync withdraws candidates
another replica took, never one being claimed here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.core.placement import Placement
from gateway.core.router import Candidate, ReplicaRouter
from gateway.core.runs import RunState, TrainingRun
from gateway.core.table import RunTable
from trainwire.v1 import episode_pb2


def _run(run_id: str, seq: int = 1) -> TrainingRun:
    task = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(clip_name="walk"))
    return TrainingRun(run_id, task, episode_pb2.TrainConfig(max_episodes=10), seq=seq)


class Leases:
    """Claims that answer when a test says so."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.answers: dict[str, asyncio.Future[TrainingRun | None]] = {}

    async def claim_pending(self, run_id: str) -> TrainingRun | None:
        self.calls.append(run_id)
        future = self.answers.setdefault(run_id, asyncio.get_running_loop().create_future())
        return await future

    def answer(self, run_id: str, run: TrainingRun | None) -> None:
        self.answers.setdefault(run_id, asyncio.get_running_loop().create_future())
        self.answers[run_id].set_result(run)


class Scheduler:
    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.started: list[tuple[str, int]] = []

    def enqueue(self, run: Any) -> None:
        self.queue.append(run)

    def dequeue(self, run: Any) -> None:
        self.queue = [q for q in self.queue if q is not run]

    def started_(self, address: str, slots: int) -> None:
        self.started.append((address, slots))


class Driver:
    """What the router needs of a promoted run's driver."""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.placements: list[Placement] = []
        self.finalizing = False

    @property
    def placeable(self) -> bool:
        return not self.placements

    def dispatch(self, placement: Placement) -> None:
        self.placements.append(placement)


class Store:
    def __init__(self, runs: dict[str, TrainingRun]) -> None:
        self.runs = runs

    async def get_run(self, run_id: str) -> TrainingRun | None:
        return self.runs.get(run_id)


def _router(runs: dict[str, TrainingRun]) -> tuple[ReplicaRouter, Leases, Scheduler, RunTable]:
    leases, scheduler, table = Leases(), Scheduler(), RunTable()
    scheduler_api = SimpleNamespace(
        enqueue=scheduler.enqueue, dequeue=scheduler.dequeue, started=scheduler.started_
    )
    tasks: set[asyncio.Task[None]] = set()

    def spawn(work: Any, name: str) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    router = ReplicaRouter(
        SimpleNamespace(leases=leases),  # type: ignore[arg-type]
        Store(runs),  # type: ignore[arg-type]
        table,
        scheduler_api,  # type: ignore[arg-type]
        Driver,  # type: ignore[arg-type]
        spawn,
        0.05,
        lambda: 0.0,
        lambda: 0,
    )
    return router, leases, scheduler, table


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_placed_candidate_is_claimed_and_promoted_with_its_placement() -> None:
    run = _run("a")
    router, leases, scheduler, table = _router({"a": run})
    router.sync_candidates([run])
    [candidate] = scheduler.queue
    assert isinstance(candidate, Candidate) and candidate.placeable
    placement = Placement.of([("t1", 2), ("t2", 1)])
    candidate.dispatch(placement)
    assert not candidate.placeable  # while its lease is claimed
    await _settle()
    assert table.get("a") is None  # not before the claim answered
    leases.answer("a", run)
    await _settle()

    driver = table.get("a")
    assert isinstance(driver, Driver) and driver.placements == [placement]
    assert scheduler.queue == [] and scheduler.started == []
    assert leases.calls == ["a"]


async def test_a_candidate_claimed_elsewhere_gives_its_placement_back() -> None:
    run = _run("a")
    router, leases, scheduler, table = _router({"a": run})
    router.sync_candidates([run])
    scheduler.queue[0].dispatch(Placement.of([("t1", 2), ("t2", 1)]))
    leases.answer("a", None)
    await _settle()

    assert table.get("a") is None and scheduler.queue == []
    assert scheduler.started == [("t1", 2), ("t2", 1)]  # the reservations end


async def test_a_control_and_a_placement_of_one_candidate_claim_it_once() -> None:
    run = _run("a")
    router, leases, scheduler, table = _router({"a": run})
    router.sync_candidates([run])
    placement = Placement.of([("t1", 1)])
    scheduler.queue[0].dispatch(placement)
    control = asyncio.ensure_future(router.control_target("a"))
    await _settle()
    leases.answer("a", run)
    target = await control
    await _settle()

    assert leases.calls == ["a"]
    assert target is table.get("a")
    assert isinstance(target, Driver) and target.placements == [placement]
    assert scheduler.started == []


async def test_a_control_claims_a_candidate_and_queues_its_driver_here() -> None:
    run = _run("a")
    router, leases, scheduler, table = _router({"a": run})
    router.sync_candidates([run])
    control = asyncio.ensure_future(router.control_target("a"))
    await _settle()
    leases.answer("a", run)
    target = await control

    assert isinstance(target, Driver) and target is table.get("a")
    assert scheduler.queue == [target]  # the candidate's place goes to its driver


async def test_a_control_of_a_run_another_replica_drives_is_forwarded() -> None:
    running = _run("b")
    running.state = RunState.RUNNING
    router, leases, _scheduler, _table = _router({"b": running})
    assert await router.control_target("b") is None
    assert leases.calls == []


async def test_a_resync_withdraws_candidates_taken_elsewhere_but_not_one_being_claimed() -> None:
    one, two = _run("a", 1), _run("b", 2)
    router, leases, scheduler, _table = _router({"a": one, "b": two})
    router.sync_candidates([one, two])
    claimed = scheduler.queue[1]
    scheduler.dequeue(claimed)  # (the scheduler takes what it places out of its queue)
    claimed.dispatch(Placement.of([("t1", 1)]))
    await _settle()
    router.sync_candidates([])  # another replica holds both now, as far as the scan saw

    assert scheduler.queue == []
    assert "b" in router._candidates  # being claimed here: the claim decides
    leases.answer("b", None)
    await _settle()
    assert "b" not in router._candidates and scheduler.started == [("t1", 1)]


async def test_a_run_created_here_and_seen_by_a_resync_is_queued_and_claimed_once() -> None:
    run = _run("a")
    router, leases, scheduler, table = _router({"a": run})
    router.candidate(run)  # CreateRun on this replica
    router.sync_candidates([run])  # a resync that read the store meanwhile
    assert len(scheduler.queue) == 1
    candidate = scheduler.queue[0]
    scheduler.dequeue(candidate)
    candidate.dispatch(Placement.of([("t1", 1)]))
    router.sync_candidates([run])  # its lease not claimed yet: still no second candidate
    assert scheduler.queue == []
    leases.answer("a", run)
    await _settle()
    router.sync_candidates([run])  # a scan older than the claim: the run is driven here
    driver = table.get("a")
    assert isinstance(driver, Driver) and len(driver.placements) == 1
    assert scheduler.queue == [] and leases.calls == ["a"]
