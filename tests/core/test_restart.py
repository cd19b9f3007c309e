"""A gateway restart on the same store file, in virtual time: a running run re-attaches to its
trainer job after its last committed episode and goes on with nothing lost or repeated, a paused
one stays paused, pending ones queue again in creation order, and one whose job is gone ends
ERROR with its history intact."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.core.errors import ShuttingDown
from gateway.core.runs import INTERRUPTED_MESSAGE, RunState
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import MemoryTrainer, TrainCall
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


async def test_a_running_run_re_attaches_after_a_restart_and_a_watcher_misses_nothing(
    tmp_path: Path,
) -> None:
    async with running_core(db=str(tmp_path / "gateway.db")) as core:
        run = await core.create(max_episodes=60)
        before = core.watch(run.id)
        await core.wait_episode(run.id, 15)
        at_shutdown = await core.run(run.id)
        # The trainer trained ahead: episodes were received that are not published yet.
        assert at_shutdown.trainer_episode > at_shutdown.episode

        await core.restart()
        assert isinstance(before.error, ShuttingDown)
        seen = before.numbers()
        after = core.watch(run.id, after_episode=seen[-1])
        await after.ended()

        assert seen + after.numbers() == list(range(1, 61))
        assert after.finished is not None and after.finished.state is RunState.DONE
        new, reattach = core.connector.trains(run.id)
        assert new.attach_after is None
        # After the last committed episode: what was received and not published comes again.
        assert reattach.attach_after == seen[-1] < at_shutdown.trainer_episode
        assert core.connector.job(run.id).streams == 2
        # The whole history, from the store, once.
        replay = core.watch(run.id)
        await replay.ended()
        assert replay.numbers() == list(range(1, 61))


async def test_a_paused_run_stays_paused_after_a_restart_and_gets_no_grant(
    tmp_path: Path,
) -> None:
    async with running_core(db=str(tmp_path / "gateway.db")) as core:
        run = await core.create(max_episodes=60)
        await core.wait_episode(run.id, 8)
        paused = await core.registry.pause(run.id)
        grants = core.connector.grants(run.id)
        credit = core.connector.job(run.id).grant

        await core.restart()
        await asyncio.sleep(10.0)
        held = await core.run(run.id)
        assert (held.state, held.episode) == (RunState.PAUSED, paused.episode)
        [reattach] = [c for c in core.connector.calls if isinstance(c, TrainCall)][1:]
        assert reattach.attach_after == paused.episode
        # A paused run gets no credit: the re-attach moves no grant, and none follows.
        assert core.connector.job(run.id).grant == credit
        assert core.connector.grants(run.id) == grants
        assert core.connector.job(run.id).last_produced == core.connector.granted(run.id)

        await core.registry.resume(run.id)
        done = await core.wait_state(run.id, RunState.DONE)
        assert done.episode == 60


async def test_pending_runs_queue_again_in_creation_order_after_a_restart(tmp_path: Path) -> None:
    trainer = MemoryTrainer("t1", slots_total=1)
    trainer.kill()
    async with running_core(trainer, db=str(tmp_path / "gateway.db")) as core:
        runs = [await core.create(max_episodes=3) for _ in range(3)]
        await core.restart()
        assert [(await core.run(r.id)).state for r in runs] == [RunState.PENDING] * 3

        trainer.revive()
        for run in runs:
            await core.wait_state(run.id, RunState.DONE)
        started = [c.run_id for c in core.connector.calls if isinstance(c, TrainCall)]
        assert started == [r.id for r in runs]


async def test_a_run_whose_job_is_gone_after_a_restart_ends_interrupted_with_its_history(
    tmp_path: Path,
) -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer, db=str(tmp_path / "gateway.db")) as core:
        run = await core.create(max_episodes=60)
        await core.wait_episode(run.id, 10)

        def trainer_restarts() -> None:  # its jobs are gone
            trainer.kill()
            trainer.revive()

        await core.restart(meanwhile=trainer_restarts)

        failed = await core.wait_state(run.id, RunState.ERROR)
        assert failed.error_message == INTERRUPTED_MESSAGE
        replay = core.watch(run.id)
        await replay.ended()
        assert replay.numbers() == list(range(1, failed.episode + 1))
        assert failed.episode >= 10


async def test_a_restart_while_the_last_episodes_wait_for_their_time_loses_none(
    tmp_path: Path,
) -> None:
    # At 2 episodes/s with a lead of 4, the trainer finishes (its end delivered, its slot
    # free) while the gateway still holds the last episodes for their time. A restarted
    # gateway re-attaches to the finished job and gets them again.
    async with running_core(db=str(tmp_path / "gateway.db")) as core:
        run = await core.create(max_episodes=10, episodes_per_second=2.0)
        watch = core.watch(run.id)

        def sent_all() -> bool:
            job = core.trainer.jobs.get(run.id)
            return job is not None and job.sent == 10

        await until(sent_all, "the trainer sent its last episode")
        held = await core.registry.pause(run.id)
        assert held.episode < held.trainer_episode == 10
        assert core.connector.job(run.id).stopped  # the trainer is done with it

        await core.restart()
        await core.registry.resume(run.id)
        rest = core.watch(run.id, after_episode=watch.numbers()[-1])
        await rest.ended()

        assert watch.numbers() + rest.numbers() == list(range(1, 11))
        assert rest.finished is not None and rest.finished.state is RunState.DONE
        assert core.connector.trains(run.id)[-1].attach_after == held.episode
