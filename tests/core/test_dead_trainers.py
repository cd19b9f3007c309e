"""How fast a dead trainer is noticed, in virtual time (the rule in ``gateway.core.feed``):

- a killed trainer (its address refuses connections) restarts the run from its checkpoint on
  another trainer at the first re-attach, not after the heartbeat timeout;
- a killed trainer's run without a checkpoint fails at once, as lost;
- a silent trainer (stopped, or black-holed) is still noticed by the heartbeat timeout, and a
  silent trainer that speaks again within the re-attach window keeps its job (no restart);
- a trainer that comes back on the same address while the run re-attaches gets no second job:
  every re-attach names ``attach_after``, and the restart starts exactly one new job.
"""

from __future__ import annotations

import asyncio

from gateway.core.runs import LOST_MESSAGE, RunState
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME

#: The heartbeat timeout of these tests: long, so that noticing a kill in well under it shows.
TIMEOUT_S = 30.0


async def _checkpointed_through(core: Core, run_id: str, episode: int) -> None:
    async def reached() -> bool:
        return (await core.run(run_id)).checkpoint_episode >= episode

    await until(reached, f"run {run_id} checkpointed through {episode}", 120.0)


async def test_a_killed_trainer_restarts_the_run_on_another_at_once() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two, heartbeat_timeout_s=TIMEOUT_S) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await _checkpointed_through(core, run.id, 10)
        loop = asyncio.get_running_loop()
        one.kill()
        killed = loop.time()
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()

        assert (done.restarts, done.trainer) == (1, "t2")
        assert watch.numbers() == list(range(1, 41))
        restart = core.connector.trains(run.id)[-1]
        assert (restart.address, restart.attach_after) == ("t2", None)
        # Within a few re-attach backoffs and a scheduler probe: far from the 30 s timeout.
        assert restart.at - killed < 3.0, restart.at - killed
        # Its first episode after the checkpoint came within that too.
        first_new = max(e for e in range(1, 41) if watch.at(e) <= killed) + 1
        assert watch.at(first_new) - killed < 5.0


async def test_a_killed_trainer_fails_a_run_without_a_checkpoint_at_once() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer, heartbeat_timeout_s=TIMEOUT_S) as core:
        run = await core.create(max_episodes=100)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 5)
        loop = asyncio.get_running_loop()
        trainer.kill()
        killed = loop.time()
        failed = await core.wait_state(run.id, RunState.ERROR, timeout=60.0)
        await watch.ended()

        assert failed.error_message == LOST_MESSAGE
        assert loop.time() - killed < 2.0
        reattaches = core.connector.trains(run.id)[1:]
        assert reattaches and all(c.attach_after is not None for c in reattaches)


async def test_a_silent_trainer_is_noticed_by_the_heartbeat_timeout() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two, heartbeat_timeout_s=TIMEOUT_S) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5, episodes_per_second=10.0)
        await _checkpointed_through(core, run.id, 10)
        loop = asyncio.get_running_loop()
        one.freeze()
        frozen = loop.time()
        done = await core.wait_state(run.id, RunState.DONE, timeout=300.0)

        assert (done.restarts, done.trainer) == (1, "t2")
        restart = core.connector.trains(run.id)[-1]
        assert (restart.address, restart.attach_after) == ("t2", None)
        # Not before the trainer was silent for the heartbeat timeout (counted from the feed's
        # last read, which waits while the inbox is full: a few seconds of episodes); then
        # re-attached for up to that long again (a stopped process may go on with its job).
        [reattach] = [c for c in core.connector.trains(run.id) if c.attach_after is not None]
        assert frozen + TIMEOUT_S <= reattach.at <= frozen + TIMEOUT_S + 10.0
        assert reattach.at + TIMEOUT_S <= restart.at <= reattach.at + TIMEOUT_S + 1.0


async def test_a_silent_trainer_that_speaks_again_keeps_its_job() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two, heartbeat_timeout_s=TIMEOUT_S) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await _checkpointed_through(core, run.id, 10)
        one.freeze()
        await asyncio.sleep(TIMEOUT_S / 3)  # SIGSTOP ... SIGCONT within the timeout
        one.thaw()
        done = await core.wait_state(run.id, RunState.DONE, timeout=300.0)
        await watch.ended()

        assert (done.restarts, done.trainer) == (0, "t1")
        assert watch.numbers() == list(range(1, 41))
        assert {c.address for c in core.connector.trains(run.id)} == {"t1"}


async def test_a_trainer_back_on_its_address_while_the_run_re_attaches_gets_one_job() -> None:
    one = MemoryTrainer("t1", slots_total=2)
    async with running_core(one, heartbeat_timeout_s=TIMEOUT_S) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await _checkpointed_through(core, run.id, 10)
        one.kill(refuses=False)  # cut off first: re-attaches fail without a refusal
        await asyncio.sleep(2.0)
        one.revive()  # back on the same address, without the job
        done = await core.wait_state(run.id, RunState.DONE, timeout=300.0)
        await watch.ended()

        assert (done.restarts, done.trainer) == (1, "t1")
        assert watch.numbers() == list(range(1, 41))
        _, *others = core.connector.trains(run.id)
        new_jobs = [c for c in others if c.attach_after is None]
        # Re-attaches never start a job; the one restart does, from the checkpoint.
        assert len(new_jobs) == 1 and new_jobs[0].resume_from
        assert all(c.attach_after is not None for c in others if c is not new_jobs[0])
        assert others.index(new_jobs[0]) == len(others) - 1


async def test_a_run_placed_on_a_trainer_that_just_died_starts_on_another() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two, heartbeat_timeout_s=TIMEOUT_S) as core:
        await asyncio.sleep(1.0)  # both probed: t1 (first in order) has a free slot
        one.kill()  # before its next probe: the scheduler still counts its slot
        run = await core.create(max_episodes=30, episodes_per_second=10.0)
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)

        # Back in the queue, not failed, and no restart counted: nothing ran on t1.
        assert (done.restarts, done.trainer) == (0, "t2")
        first, *others = core.connector.trains(run.id)
        assert first.address == "t1" and first.attach_after is None
        assert [(c.address, c.attach_after) for c in others] == [("t2", None)]


async def test_a_restart_that_finds_its_job_still_alive_takes_it_over_intact() -> None:
    one = MemoryTrainer("t1", slots_total=2)
    async with running_core(one, heartbeat_timeout_s=3.0) as core:
        run = await core.create(max_episodes=60, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await _checkpointed_through(core, run.id, 15)
        one.freeze()  # black-holed past the timeout and the re-attach window: restarted

        async def restarting() -> bool:
            return (await core.run(run.id)).restarts == 1

        await until(restarting, "the restart decision", 60.0)
        one.thaw()  # the restart's new job finds the old one alive: it is taken over
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()

        assert done.state is RunState.DONE, done.error_message
        assert watch.numbers() == list(range(1, 61))
        best = [e.best_reward for e in watch.episodes()]
        assert best == sorted(best)
        *_, takeover = core.connector.trains(run.id)
        assert takeover.attach_after is not None  # the old job, re-attached
