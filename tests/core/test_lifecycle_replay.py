"""A recorded event history of a real run (in the core under virtual time, against in-memory
trainers: parked, resumed, its trainer killed, restarted, then forked and the fork's trainer
killed) replayed through the pure state machine reaches the state the driver reached."""

from __future__ import annotations

from gateway.core import lifecycle as lc
from gateway.core.driver import RunDriver
from gateway.core.runs import RunState
from tests.core.test_forks import _fork
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


def _driver(core: Core, run_id: str) -> RunDriver:
    driver = core.registry.table.get(run_id)
    assert driver is not None, f"run {run_id} is not driven here"
    return driver


async def _checkpointed_through(core: Core, run_id: str, episode: int) -> None:
    async def reached() -> bool:
        return (await core.run(run_id)).checkpoint_episode >= episode

    await until(reached, f"run {run_id} checkpointed through {episode}")


async def test_a_recorded_history_replays_to_the_same_end() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two, park_after_s=20.0) as core:
        run = await core.create(max_episodes=60, checkpoint_every=5, episodes_per_second=10.0)
        driver = _driver(core, run.id)
        await core.wait_episode(run.id, 8)
        await core.registry.pause(run.id)

        await core.wait_parked(run.id)
        await core.registry.resume(run.id)
        await core.wait_episode(run.id, 25)
        await _checkpointed_through(core, run.id, 20)
        core.connector.trainers[(await core.run(run.id)).trainer].kill()
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await driver.ended()
        assert done.restarts == 1

        kinds = [type(e) for e in driver.history]
        assert kinds == [
            lc.Dispatch,
            lc.Answered,
            lc.Pause,
            lc.ParkDue,
            lc.ParkDone,
            lc.Resume,
            lc.Dispatch,
            lc.Answered,
            lc.StreamEnded,  # the trainer was killed: restarted
            lc.Dispatch,
            lc.Answered,
            lc.StreamEnded,  # done
            lc.Stored,
        ]
        assert lc.replay(driver.history) == driver.state == lc.Ended(lc.Exit.FINISHED)

        # A fork of it, whose trainer dies before and after its first checkpoint, then stopped.
        for trainer in (one, two):
            trainer.revive()
        fork = await _fork(core, run.id, 55, 200, every=50, rate=10.0)
        forked = _driver(core, fork.id)
        await core.wait_episode(fork.id, 58)
        core.connector.trainers[(await core.run(fork.id)).trainer].kill()
        await core.wait_episode(fork.id, 120)
        await core.registry.stop(fork.id)
        await forked.ended()

        assert lc.replay(forked.history) == forked.state == lc.Ended(lc.Exit.FINISHED)
        ends = [e for e in forked.history if isinstance(e, lc.StreamEnded)]
        assert [e.decision.action.value for e in ends if e.decision] == ["restart"]
        assert isinstance(forked.history[-2], lc.Stop)
        # Replayed step by step, the machine passed through the states the run went through.
        states = []
        state: lc.State = lc.Pending()
        for event in forked.history:
            state, _ = lc.step(state, event)
            states.append(type(state))
        assert states[-3:] == [lc.Running, lc.Finishing, lc.Ended]
        assert lc.Restarting in states
