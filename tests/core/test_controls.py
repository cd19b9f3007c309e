"""Pacing and the controls, in virtual time: episodes reach watchers at the run's rate x speed, a
speed change takes effect at once, pause holds publication and the trainer's credit, resume goes
on, and stop cancels the trainer's job."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.errors import IllegalTransition
from gateway.core.registry import Keepalive
from gateway.core.runs import RunState
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import GrantCall, MemoryTrainer
from tests.fakes.virtual_time import TICK, VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


#: How far a publication may land from its due time: virtual time moves with real time while a
#: commit is in flight (``tests.fakes.virtual_time``), so a commit slower than the time left to
#: the next timer delays what that timer starts by about as long (the pacer keeps the cadence).
JITTER = TICK


def assert_paced(times: list[float], interval: float) -> None:
    """Episode i comes at its due time ``times[0] + i * interval`` (to a tick), without drift.

    One may come late by less than an interval, and the next one then catches the cadence up
    (the pacer's rule): under load a commit's thread can take real time, which the virtual
    clock follows while it is in flight."""
    assert len(times) > 1
    late = [t - (times[0] + i * interval) for i, t in enumerate(times)]
    assert all(-JITTER <= d < interval + JITTER for d in late), late
    on_time = sum(1 for d in late if d <= JITTER)
    assert on_time >= len(times) * 3 // 4, late  # the cadence, not a constant lag


@pytest.mark.parametrize(
    ("rate", "speed", "interval"), [(10.0, 1.0, 0.1), (10.0, 2.0, 0.05), (4.0, 0.5, 0.5)]
)
async def test_episodes_are_published_at_rate_times_speed(
    rate: float, speed: float, interval: float
) -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=30, episodes_per_second=rate, speed=speed)
        watch = core.watch(run.id)
        await watch.ended()

        assert watch.numbers() == list(range(1, 31))
        assert_paced(watch.times(), interval)
        assert watch.finished is not None and watch.finished.state is RunState.DONE


async def test_a_speed_change_takes_effect_at_the_next_episode() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=60)  # 10 episodes/s
        watch = core.watch(run.id)
        # Between episodes 10 and 11 (the watcher looks every 10 ms; they come every 100 ms).
        await until(lambda: len(watch.numbers()) == 10, "episode 10 at the watcher")
        at = asyncio.get_running_loop().time()
        changed = await core.registry.set_speed(run.id, 4.0)
        assert changed.speed == 4.0
        await watch.ended()

        assert watch.numbers() == list(range(1, 61))
        times = watch.times()
        assert times[9] <= at < times[10]
        assert_paced(times[:10], 0.1)
        # Episode 11 is due one new interval after episode 10 (at once if that has passed),
        # and the ones after it come every new interval.
        assert times[10] - times[9] <= 0.1 + JITTER
        assert_paced(times[10:], 0.025)
        # The lead grows with the speed: 2 s at 40 episodes/s is 80 episodes, so the grant that
        # goes out with the change reaches the end; at 20 episodes before, none did.
        grants = [c for c in core.connector.calls if isinstance(c, GrantCall)]
        assert max(c.through_episode for c in grants if c.at < at) <= 10 + 20
        [to_the_end] = [c.at for c in grants if c.through_episode == 60]
        assert at <= to_the_end <= at + 0.01  # (after a grant in flight, if one was)


async def test_pause_holds_publication_and_the_trainer_at_its_grant_and_resume_goes_on() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100)  # lead 20
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 12)
        paused = await core.registry.pause(run.id)
        assert paused.state is RunState.PAUSED
        at_pause = asyncio.get_running_loop().time()
        grants_at_pause = len(core.connector.grants(run.id))

        await asyncio.sleep(30.0)
        held = await core.run(run.id)
        job = core.connector.job(run.id)
        granted = core.connector.granted(run.id)
        assert held.state is RunState.PAUSED
        assert held.episode == paused.episode  # nothing published while paused
        assert held.trainer_episode == job.last_produced == granted  # trained up to its grant
        assert granted <= paused.episode + 20  # ... which is the lead beyond what was published
        assert len(core.connector.grants(run.id)) == grants_at_pause  # and got no new grant
        assert held.state_detail == (
            f"paused at episode {held.episode}; training holds at episode {granted} "
            f"(granted through {granted})"
        )
        # Watchers hear keepalives (every keepalive_s) saying the run is paused.
        keepalives = [k for at, k in watch.of(Keepalive) if at > at_pause]
        assert len(keepalives) == 30 // 5
        assert {k.state for k in keepalives} == {RunState.PAUSED}
        assert {k.last_episode for k in keepalives} == {paused.episode}

        resumed = await core.registry.resume(run.id)
        assert resumed.state is RunState.RUNNING
        await watch.ended()
        assert watch.numbers() == list(range(1, 101))
        assert watch.finished is not None and watch.finished.state is RunState.DONE
        assert len(core.connector.grants(run.id)) > grants_at_pause


async def test_pausing_twice_is_a_no_op_and_resuming_a_running_run_too() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100)
        await core.wait_state(run.id, RunState.RUNNING)
        assert (await core.registry.resume(run.id)).state is RunState.RUNNING
        await core.registry.pause(run.id)
        assert (await core.registry.pause(run.id)).state is RunState.PAUSED
        stopped = await core.registry.stop(run.id)
        with pytest.raises(IllegalTransition, match=r"cannot resume run .*: it is STOPPED"):
            await core.registry.resume(run.id)
        assert stopped.state is RunState.STOPPED


async def test_stop_cancels_the_trainer_job_and_ends_the_run_stopped() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 5)
        stopped = await core.registry.stop(run.id)
        assert stopped.state is RunState.STOPPED
        await until(lambda: core.connector.cancels(run.id), "CancelJob of the stopped run")
        await watch.ended()

        [cancel] = core.connector.cancels(run.id)
        assert cancel.address == "t1"
        assert run.id not in core.trainer.jobs  # the trainer freed the job
        assert core.trainer.slots_free == core.trainer.slots_total
        assert watch.finished is not None and watch.finished.state is RunState.STOPPED
        assert watch.numbers() == list(range(1, watch.finished.episode + 1))
        # Nothing is published once it stopped.
        await asyncio.sleep(5.0)
        final = await core.run(run.id)
        assert (final.state, final.episode) == (RunState.STOPPED, stopped.episode)


async def test_stop_while_paused_cancels_the_job_too() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100)
        await core.wait_episode(run.id, 3)
        await core.registry.pause(run.id)
        await core.registry.stop(run.id)
        await until(lambda: core.connector.cancels(run.id), "CancelJob of the stopped run")
        assert (await core.run(run.id)).state is RunState.STOPPED


async def test_a_pending_run_cannot_be_paused_and_stops_at_once_without_a_trainer() -> None:
    trainer = MemoryTrainer("t1", slots_total=0)  # every slot taken
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=5)
        with pytest.raises(IllegalTransition, match=r"cannot pause run .*: it is PENDING"):
            await core.registry.pause(run.id)
        stopped = await core.registry.stop(run.id)
        assert (stopped.state, stopped.trainer, stopped.episode) == (RunState.STOPPED, "", 0)
        assert core.connector.calls == []  # no Train, no CancelJob


async def test_a_control_while_the_last_episode_is_committed_is_answered_for_the_end() -> None:
    async with running_core() as core:
        core.store.commit_delay_s = 2.0  # each episode takes 2 s to the store
        run = await core.create(max_episodes=5)
        # By 1 s every episode, the done one included, was handed to the store; none is
        # committed yet.
        await asyncio.sleep(1.0)
        running = await core.run(run.id)
        assert (running.state, running.episode, running.trainer_episode) == (
            RunState.RUNNING,
            0,
            5,
        )
        # Not "it is RUNNING": the control waits for the end and is refused as for it.
        with pytest.raises(IllegalTransition, match=r"cannot change the speed of .*: it is DONE"):
            await core.registry.set_speed(run.id, 2.0)
        assert (await core.run(run.id)).state is RunState.DONE
