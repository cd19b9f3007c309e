"""A replica that lost a run's lease while its job streamed, in virtual time.

The new owner re-attaches to the job, so the old owner's stream ends (``ABORTED``: another caller
re-attached) and its restart policy decides to restart the run. Before it touches the job it
stores the run (``STORE_FIRST`` in ``gateway.core.lifecycle``); the store's ``NotOwner`` makes it
let the run go: it neither cancels the job the new owner streams now nor places the run again.
(The ten-minute chaos soak of seed 3 found the other order: the old owner cancelled the job and
placed the run on a second trainer before its store write failed, and the new owner then
re-attached to a job that did not continue what it had published.)
"""

from __future__ import annotations

import asyncio

from gateway.core import lifecycle as lc
from gateway.core.runs import RunState
from gateway.core.store import NotOwner
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import JobScript, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until
from trainwire.v1 import episode_pb2

pytestmark = VIRTUAL_TIME


async def test_a_replica_that_lost_the_run_leaves_the_job_to_the_new_owner() -> None:
    one, two = MemoryTrainer("t1"), MemoryTrainer("t2")
    one.script(JobScript(episode_s=1.0))
    async with running_core(one, two) as core:
        run = await core.create(max_episodes=100, checkpoint_every=5)
        await core.wait_episode(run.id, 12)
        driver = core.registry.table.get(run.id)
        assert driver is not None and driver.task is not None
        drive = driver.task

        # The lease is gone: the store refuses this replica's writes of the run, and the new
        # owner re-attaches to the job after what the store holds.
        core.store.update_error = NotOwner(run.id)
        held = await core.run(run.id)
        taken_over = core.connector.train(
            "t1", run.id, run.task, run.config, held.episode + 20, held.episode
        )
        events = aiter(taken_over)
        first = await asyncio.wait_for(anext(events), 10.0)
        while not isinstance(first, episode_pb2.Episode):
            first = await asyncio.wait_for(anext(events), 10.0)

        await until(lambda: core.registry.table.get(run.id) is None, "the run let go")
        await until(drive.done, "the old owner's stream task ended")
        assert drive.exception() is None  # nothing escaped the driver
        await asyncio.sleep(30.0)  # what a restart would have done by now

        assert core.connector.cancels(run.id) == []
        trains = core.connector.trains(run.id)
        assert [(c.address, c.attach_after) for c in trains] == [
            ("t1", None),
            ("t1", held.episode),
        ], "not placed again"
        assert not two.jobs
        job = core.connector.job(run.id)
        assert not job.stopped
        # The new owner's stream goes on from where it attached.
        assert first.episode == held.episode + 1
        assert (await core.run(run.id)).restarts == 0


async def test_a_run_stopped_while_its_restart_is_stored_is_not_placed_again() -> None:
    # The restart stores the run before anything else (a slow disk holds that write open); a
    # stop that comes meanwhile ends the run, and the rest of the restart does not place it.
    one, two = MemoryTrainer("t1"), MemoryTrainer("t2")
    one.script(JobScript(crash_after=12))
    async with running_core(one, two) as core:
        core.store.update_delay_s = 5.0
        run = await core.create(max_episodes=100, checkpoint_every=5, episodes_per_second=2.0)
        driver = core.registry.table.get(run.id)
        assert driver is not None
        await until(lambda: isinstance(driver.state, lc.Restarting), "the restart", 120.0)
        assert core.store.committed.get(run.id, 0) < 100

        stopped = await core.registry.stop(run.id)
        assert stopped.state is RunState.STOPPED
        await asyncio.sleep(30.0)

        assert [c.address for c in core.connector.trains(run.id)] == ["t1"], "not placed again"
        assert not two.jobs
        assert (await core.run(run.id)).state is RunState.STOPPED
