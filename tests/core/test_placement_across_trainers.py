"""One GRPO job placed on several trainers, in virtual time: a job that fits on one trainer goes
there; one that fits on none alone is placed on several, all or none, the most free first and
rank 0's first in ``Run.trainers``; one that fits only later waits saying what it needs, FIFO per
kind; ``CreateRun`` refuses one bigger than every trainer together; rank 0's trainer alone gets
grants and hyperparameters, and the other shares start on its rendezvous."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

from gateway.core.errors import InvalidRequest
from gateway.core.runs import RunState
from gateway.core.trainers import JobPlacement
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import GrantCall, HyperparametersCall, MemoryTrainer, TrainCall
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until
from trainwire.hyperparameters import Hyperparameters

pytestmark = VIRTUAL_TIME

#: A paced run this long holds its slots for a few virtual seconds.
LONG = 40


def grpo_trainer(address: str, slots: int = 1) -> MemoryTrainer:
    """A trainer that offers grpo in ``slots`` slots."""
    return MemoryTrainer(address, providers=("grpo",), slots_total=slots)


def new_jobs(calls: Iterable[object], run_id: str) -> list[TrainCall]:
    """The new jobs (and shares) asked for a run, in order."""
    return [
        c
        for c in calls
        if isinstance(c, TrainCall) and c.run_id == run_id and c.attach_after is None
    ]


async def test_a_job_that_fits_on_one_trainer_goes_to_the_first_with_the_slots() -> None:
    small, big = grpo_trainer("a:1", 2), grpo_trainer("b:1", 4)
    async with running_core(small, big) as core:
        three = await core.create(max_episodes=5, kind="grpo", processes=3)
        two = await core.create(max_episodes=5, kind="grpo", processes=2)
        for run, address in ((three, "b:1"), (two, "a:1")):
            done = await core.wait_state(run.id, RunState.DONE)
            assert (done.trainer, done.trainers) == (address, (address,))
            [job] = new_jobs(core.connector.calls, run.id)
            assert (job.address, job.placement) == (address, None)  # the whole job there


async def test_a_job_no_trainer_fits_alone_spans_two_rank_0_on_the_most_free() -> None:
    one, two = grpo_trainer("a:1", 1), grpo_trainer("b:1", 2)
    async with running_core(one, two) as core:
        run = await core.create(max_episodes=LONG, kind="grpo", processes=3)
        watch = core.watch(run.id)
        running = await core.wait_state(run.id, RunState.RUNNING)
        assert (running.trainer, running.trainers) == ("b:1", ("b:1", "a:1"))

        async def training() -> str | None:
            detail = (await core.run(run.id)).state_detail
            return detail if detail.startswith("training") else None

        detail = await until(training, "the run's detail while it trains")
        assert re.fullmatch(
            rf"training on b:1 \(ranks 0-1\), a:1 \(ranks 2-2\): episode \d+ of {LONG} trained, "
            r"granted through \d+",
            detail,
        ), detail
        # The share announces nothing but heartbeats; rank 0's trainer alone gets controls.
        await core.registry.set_hyperparameters(run.id, Hyperparameters(learning_rate=1e-3))
        done = await core.wait_state(run.id, RunState.DONE)
        await watch.ended()

        rank0, share = new_jobs(core.connector.calls, run.id)
        assert (rank0.address, rank0.placement) == ("b:1", JobPlacement(3, 0, 2, ""))
        assert share.address == "a:1" and share.placement is not None
        rendezvous = share.placement.rendezvous
        assert share.placement == JobPlacement(3, 2, 1, rendezvous) and rendezvous
        assert (share.grant, share.resume_from) == (0, ())  # unlimited, from scratch
        calls = core.connector.calls
        assert {c.address for c in calls if isinstance(c, GrantCall)} == {"b:1"}
        assert {c.address for c in calls if isinstance(c, HyperparametersCall)} == {"b:1"}
        assert watch.numbers() == list(range(1, LONG + 1))
        assert (done.trainer, done.trainers, done.error_message) == ("b:1", ("b:1", "a:1"), "")
        # The share ended with the job: nothing to cancel, and every slot is free again.
        assert core.connector.cancels(run.id) == []
        assert (one.slots_free, two.slots_free) == (1, 2)


async def test_three_trainers_all_or_none_with_the_wait_saying_what_it_needs_fifo() -> None:
    trainers = [grpo_trainer(a) for a in ("a:1", "b:1", "c:1")]
    imitation = MemoryTrainer("i:1", providers=("imitation",), slots_total=1)
    async with running_core(*trainers, imitation) as core:
        first = await core.create(max_episodes=LONG, kind="grpo")
        await core.wait_state(first.id, RunState.RUNNING)
        big = await core.create(max_episodes=10, kind="grpo", processes=3)
        later = await core.create(max_episodes=5, kind="grpo")  # fits, but comes after
        other_kind = await core.create(max_episodes=5)

        async def said(run_id: str, text: str) -> bool:
            return (await core.run(run_id)).state_detail == text

        needs = "needs 3 slots; free: a:1 0/1, b:1 1/1, c:1 1/1"
        await until(lambda: said(big.id, needs), "the wait's numbers")
        await until(lambda: said(later.id, f"{needs}; 1 run(s) ahead in the queue"), "FIFO")
        # Nothing of the big job started anywhere while it waits (all or none), and a run of
        # another kind does not wait behind it.
        assert (await core.wait_state(other_kind.id, RunState.DONE)).trainer == "i:1"
        assert new_jobs(core.connector.calls, big.id) == []
        assert new_jobs(core.connector.calls, later.id) == []
        assert (trainers[1].slots_free, trainers[2].slots_free) == (1, 1)

        await core.registry.stop(first.id)
        done = await core.wait_state(big.id, RunState.DONE)
        assert done.trainers == ("a:1", "b:1", "c:1")  # ties in configured order
        placements = [c.placement for c in new_jobs(core.connector.calls, big.id)]
        assert [(p.first_rank, p.processes) for p in placements if p] == [(0, 1), (1, 1), (2, 1)]
        later_done = await core.wait_state(later.id, RunState.DONE)
        assert later_done.start_time > done.start_time


async def test_a_job_bigger_than_every_trainer_together_is_refused_at_create() -> None:
    async with running_core(grpo_trainer("a:1"), grpo_trainer("b:1")) as core:
        with pytest.raises(InvalidRequest) as refused:
            await core.create(max_episodes=5, kind="grpo", processes=3)
        assert str(refused.value) == (
            "cannot create the run: task.grpo.num_processes is 3, but the trainers that offer "
            "grpo have 2 slots in all (a:1 1, b:1 1)"
        )
        [violation] = refused.value.violations
        assert violation.field == "task.grpo.num_processes"
        assert "3; at most 2" in violation.description
        fits = await core.create(max_episodes=5, kind="grpo", processes=2)
        assert (await core.wait_state(fits.id, RunState.DONE)).trainers == ("a:1", "b:1")


async def test_a_job_is_accepted_while_no_trainer_has_answered_and_waits() -> None:
    trainer = grpo_trainer("a:1")
    trainer.kill()
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=5, kind="grpo", processes=3)
        waiting = await core.run(run.id)
        assert waiting.state is RunState.PENDING
        assert waiting.state_detail == "no trainer reachable: a:1 (connection refused)"
        trainer.revive()
        # Once it answers, the job waits saying that it cannot fit.
        text = "needs 3 slots; the trainers that offer grpo have 1 in all (free: a:1 1/1)"

        async def said() -> bool:
            return (await core.run(run.id)).state_detail == text

        await until(said, "the wait saying the trainers are too small")
