"""Placement of PENDING runs on trainers, in virtual time: FIFO per task kind, a busy trainer
sends the run back to its place in the queue, a waiting run says why it waits, the pending
limit, dead and hung trainers, and health."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable

import pytest

from gateway.core.errors import TooManyPending
from gateway.core.runs import LOST_MESSAGE, RunState
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import JobScript, MemoryTrainer, TrainCall
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


def new_jobs(calls: Iterable[object], address: str) -> list[str]:
    """The run ids of the new jobs asked of a trainer, in order."""
    return [
        c.run_id
        for c in calls
        if isinstance(c, TrainCall) and c.address == address and c.attach_after is None
    ]


# A job holds its slot until its provider stops: with a lead of 20 episodes, a run of 40 keeps
# its trainer's slot until half of it is published (about 2 s at 10 episodes/s).
LONG = 40


async def test_runs_of_one_kind_start_in_creation_order_and_other_kinds_do_not_wait() -> None:
    imitation = MemoryTrainer("t-imitation", providers=("imitation",), slots_total=1)
    grpo = MemoryTrainer("t-grpo", providers=("grpo",), slots_total=1)
    async with running_core(imitation, grpo) as core:
        a1 = await core.create(max_episodes=LONG)
        a2 = await core.create(max_episodes=LONG)
        a3 = await core.create(max_episodes=LONG)
        g1 = await core.create(max_episodes=5, kind="grpo")

        # g1 came last but is of another kind: it does not queue behind a2 and a3.
        await core.wait_state(g1.id, RunState.RUNNING, RunState.DONE)
        assert (await core.run(a2.id)).state is RunState.PENDING
        for run in (a1, a2, a3, g1):
            await core.wait_state(run.id, RunState.DONE)

        assert new_jobs(core.connector.calls, "t-imitation") == [a1.id, a2.id, a3.id]
        assert new_jobs(core.connector.calls, "t-grpo") == [g1.id]
        starts = [(await core.run(r.id)).start_time for r in (a1, a2, a3)]
        assert starts == sorted(starts)


async def test_waiting_runs_say_which_trainer_is_busy_and_how_many_are_ahead() -> None:
    async with running_core(MemoryTrainer("t1", slots_total=1)) as core:
        first = await core.create(max_episodes=LONG)
        second = await core.create(max_episodes=LONG)
        third = await core.create(max_episodes=LONG)
        await core.wait_state(first.id, RunState.RUNNING)
        await until(lambda: core.trainer.probes >= 3, "a probe after the first run started")

        busy = "waiting for a free slot: t1 has 1/1 busy"
        assert (await core.run(second.id)).state_detail == busy
        running = await core.run(first.id)  # and the running one says where it trains
        assert re.fullmatch(
            rf"training on t1: episode {running.trainer_episode} of {LONG} trained, "
            r"granted through \d+",
            running.state_detail,
        ), running.state_detail
        assert (await core.run(third.id)).state_detail == (
            "waiting for a free slot: t1 has 1/1 busy; 1 run(s) ahead in the queue"
        )
        await core.registry.stop(first.id)
        await core.wait_state(second.id, RunState.RUNNING, RunState.DONE)
        probes = core.trainer.probes
        await until(lambda: core.trainer.probes > probes, "a probe after the second run started")
        assert (await core.run(third.id)).state_detail == busy


async def test_a_run_queued_before_the_next_probe_says_the_slot_is_busy() -> None:
    trainer = MemoryTrainer("t1", slots_total=1, call_s=0.5)  # probes take a while
    async with running_core(trainer) as core:
        first = await core.create(max_episodes=LONG)
        await until(lambda: first.id in trainer.jobs, "the first run's job")
        second = await core.create(max_episodes=LONG)
        assert (await core.run(second.id)).state_detail == (
            "waiting for a free slot: t1 has 1/1 busy"
        )


async def test_a_run_waits_while_no_trainer_answers_and_starts_once_one_does() -> None:
    trainer = MemoryTrainer("t1")
    trainer.kill()
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=5)
        await asyncio.sleep(3.0)
        waiting = await core.run(run.id)
        assert waiting.state is RunState.PENDING
        assert waiting.state_detail == "no trainer reachable: t1 (connection refused)"
        assert core.connector.trains(run.id) == []

        trainer.revive()
        revived = asyncio.get_running_loop().time()
        done = await core.wait_state(run.id, RunState.DONE)
        assert done.episode == 5
        assert core.connector.trains(run.id)[0].at >= revived


async def test_while_a_run_waits_its_trainer_is_probed_every_schedule_poll_s() -> None:
    trainer = MemoryTrainer("t1")
    trainer.kill()
    async with running_core(trainer) as core:
        assert core.settings.schedule_poll_s == 1.0
        run = await core.create(max_episodes=5)
        trainer.revive()
        await core.wait_state(run.id, RunState.RUNNING, RunState.DONE)
        # The trainer was probed at start (t=0) and answers from then on: the next probe, at
        # most schedule_poll_s later (and its round trip), places the run.
        placed = core.connector.trains(run.id)[0].at
        assert placed <= core.settings.schedule_poll_s + 2 * trainer.call_s


async def test_a_kind_no_trainer_offers_waits_alone_and_says_why() -> None:
    async with running_core(MemoryTrainer("t1", providers=("imitation",))) as core:
        grpo = await core.create(max_episodes=5, kind="grpo")
        imitation = await core.create(max_episodes=5)
        done = await core.wait_state(imitation.id, RunState.DONE)
        assert done.episode == 5

        waiting = await core.run(grpo.id)
        assert waiting.state is RunState.PENDING
        assert waiting.state_detail == "no trainer offers grpo: t1 offers imitation"
        assert core.connector.trains(grpo.id) == []


async def test_a_busy_answer_requeues_the_run_at_its_place_and_it_starts_later() -> None:
    trainer = MemoryTrainer("t1", slots_total=1, answer_busy=1)
    async with running_core(trainer) as core:
        first = await core.create(max_episodes=5)
        second = await core.create(max_episodes=5)
        await core.wait_state(first.id, RunState.RUNNING, RunState.DONE)
        done = await core.wait_state(first.id, RunState.DONE)
        await core.wait_state(second.id, RunState.DONE)

        # Refused once as busy, the first run is asked again before the second (its place).
        assert new_jobs(core.connector.calls, "t1") == [first.id, first.id, second.id]
        assert done.episode == 5
        assert done.error_message == ""
        assert trainer.answer_busy == 0


async def test_the_pending_limit_refuses_new_runs_until_one_leaves_the_queue() -> None:
    trainer = MemoryTrainer("t1")
    trainer.kill()
    async with running_core(trainer, max_pending=2) as core:
        first = await core.create()
        await core.create()
        with pytest.raises(TooManyPending, match=r"already has 2 runs waiting.*--max-pending 2"):
            await core.create()

        stopped = await core.registry.stop(first.id)
        assert stopped.state is RunState.STOPPED
        third = await core.create()
        assert third.state is RunState.PENDING
        # A run stopped while it waits never reached a trainer: nothing to cancel.
        assert core.connector.trains(first.id) == []
        assert core.connector.cancels(first.id) == []


async def test_a_dead_trainer_is_skipped_and_runs_go_to_the_one_that_answers() -> None:
    dead = MemoryTrainer("t-dead")
    alive = MemoryTrainer("t-alive", slots_total=2)
    dead.kill()
    async with running_core(dead, alive) as core:
        runs = [await core.create(max_episodes=5) for _ in range(2)]
        for run in runs:
            done = await core.wait_state(run.id, RunState.DONE)
            assert done.trainer == "t-alive"
        assert new_jobs(core.connector.calls, "t-dead") == []


async def test_a_hung_trainer_does_not_delay_placement_on_a_healthy_one() -> None:
    hung = MemoryTrainer("t-hung", call_s=30.0)  # its probes answer after 30 s
    healthy = MemoryTrainer("t-healthy")
    async with running_core(hung, healthy, trainer_call_timeout_s=30.0) as core:
        created = asyncio.get_running_loop().time()
        run = await core.create(max_episodes=3)
        done = await core.wait_state(run.id, RunState.DONE)
        assert done.trainer == "t-healthy"
        # Placed at once, while the hung trainer's probe waits for its answer.
        assert core.connector.trains(run.id)[0].at - created < 0.1
        assert hung.jobs == {}


async def test_two_trainers_share_runs_and_a_dead_one_leaves_its_run_lost_and_the_rest_go_on() -> (
    None
):
    one = MemoryTrainer("t-one", slots_total=1)
    two = MemoryTrainer("t-two", slots_total=1)
    async with running_core(one, two, heartbeat_timeout_s=2.0) as core:
        a = await core.create(max_episodes=LONG)
        b = await core.create(max_episodes=LONG)
        await core.wait_state(a.id, RunState.RUNNING)
        await core.wait_state(b.id, RunState.RUNNING)
        assert {(await core.run(r.id)).trainer for r in (a, b)} == {"t-one", "t-two"}

        one.kill()
        lost, kept = (a, b) if (await core.run(a.id)).trainer == "t-one" else (b, a)
        assert (await core.wait_state(lost.id, RunState.ERROR)).error_message == LOST_MESSAGE
        assert (await core.wait_state(kept.id, RunState.DONE)).episode == LONG
        later = await core.create(max_episodes=3)
        assert (await core.wait_state(later.id, RunState.DONE)).trainer == "t-two"


async def test_a_provider_error_before_the_first_episode_fails_the_run_without_a_retry() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(fail_after=0, user_message="The dataset file is missing."))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=5)
        failed = await core.wait_state(run.id, RunState.ERROR)
        assert (failed.error_message, failed.episode) == ("The dataset file is missing.", 0)
        assert len(core.connector.trains(run.id)) == 1  # never re-queued: only busy is


async def test_health_changes_are_reported_as_trainers_come_and_go() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer) as core:
        assert core.health == [True]
        trainer.kill()
        await until(lambda: core.health[-1] is False, "unhealthy reported")
        trainer.revive()
        await until(lambda: core.health[-1] is True, "healthy reported")
        assert core.health == [True, False, True]
