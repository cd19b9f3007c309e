"""Watches of runs, in virtual time: every watcher gets every episode after its cursor exactly
once and in order, ``CaughtUp`` once with the history that existed when it attached,
keepalives while nothing happens, and the finished run last; shutdown and deletion end
watches."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gateway.core.errors import IllegalTransition, RunNotFound, ShuttingDown
from gateway.core.registry import CaughtUp, EpisodeFrames, Finished, Keepalive
from gateway.core.runs import RunState
from tests.fakes.core_harness import Watch, running_core
from tests.fakes.memory_trainer import MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME

pytestmark = VIRTUAL_TIME


def assert_well_formed(watch: Watch, after: int, last: int) -> None:
    """Episodes ``after+1..last`` once each, in order; one ``CaughtUp`` before any live
    episode; ``Finished`` last."""
    assert watch.error is None
    assert watch.numbers() == list(range(after + 1, last + 1))
    kinds = [type(event) for _, event in watch.events]
    assert kinds.count(CaughtUp) == 1
    assert kinds.count(Finished) == 1
    assert kinds[-1] is Finished
    caught_up = kinds.index(CaughtUp)
    [(_, event)] = watch.of(CaughtUp)
    replayed = sum(
        len(e.frames) for _, e in watch.events[:caught_up] if isinstance(e, EpisodeFrames)
    )
    # What existed when it attached came before CaughtUp, and CaughtUp names its end.
    assert event.last_episode == after + replayed


async def test_watchers_joining_at_any_time_get_every_episode_once() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=60)
        watches: list[tuple[int, Watch]] = [(0, core.watch(run.id)) for _ in range(20)]
        for episode, after in [(10, 0), (20, 5), (30, 30), (45, 12)]:
            await core.wait_episode(run.id, episode)
            watches += [(after, core.watch(run.id, after_episode=after)) for _ in range(10)]
        for _, watch in watches:
            await watch.ended()

        replay = core.watch(run.id)
        await replay.ended()
        history = replay.payloads()  # from the store
        assert len(history) == 60
        for after, watch in watches:
            assert_well_formed(watch, after, 60)
            assert watch.finished is not None and watch.finished.state is RunState.DONE
            # Byte for byte what the store holds: live or replayed, every watcher agrees.
            assert watch.payloads() == history[after:]


async def test_a_late_joiner_gets_the_history_in_batches_then_the_live_episodes() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=40)
        await core.wait_episode(run.id, 25)
        watch = core.watch(run.id)
        await watch.ended()

        caught_up = next(i for i, (_, e) in enumerate(watch.events) if isinstance(e, CaughtUp))
        history = [e for _, e in watch.events[:caught_up] if isinstance(e, EpisodeFrames)]
        live = [e for _, e in watch.events[caught_up:] if isinstance(e, EpisodeFrames)]
        assert all(e.batch for e in history)
        assert sum(len(e.frames) for e in history) >= 25
        # Live episodes come one per message, at the run's pace.
        assert live and all(not e.batch and len(e.frames) == 1 for e in live)
        assert_well_formed(watch, 0, 40)


async def test_caught_up_names_the_real_last_episode_when_the_cursor_is_beyond_it() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=30)
        await core.wait_episode(run.id, 5)
        active = core.watch(run.id, after_episode=1000)
        await active.ended()
        [(_, caught_up)] = active.of(CaughtUp)
        assert 5 <= caught_up.last_episode < 30
        assert active.numbers() == []

        finished = core.watch(run.id, after_episode=1000)
        await finished.ended()
        [(_, caught_up)] = finished.of(CaughtUp)
        assert caught_up.last_episode == 30


async def test_a_finished_run_is_replayed_from_the_store_in_batches() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=700, episodes_per_second=-1.0)
        await core.wait_state(run.id, RunState.DONE, timeout=60.0)
        watch = core.watch(run.id, after_episode=17)
        await watch.ended()

        assert_well_formed(watch, 17, 700)
        batches = [len(e.frames) for _, e in watch.of(EpisodeFrames)]
        assert all(e.batch for _, e in watch.of(EpisodeFrames))
        assert len(batches) >= 3 and max(batches) <= 256
        assert watch.finished is not None and watch.finished.episode == 700


async def test_keepalives_every_keepalive_s_while_a_run_waits_for_a_trainer() -> None:
    trainer = MemoryTrainer("t1")
    trainer.kill()
    async with running_core(trainer) as core:
        keepalive_s = core.settings.keepalive_s
        run = await core.create(max_episodes=5)
        watch = core.watch(run.id)
        await asyncio.sleep(4 * keepalive_s + 1.0)

        keepalives = watch.of(Keepalive)
        assert [(k.last_episode, k.state) for _, k in keepalives] == [(0, RunState.PENDING)] * 4
        times = [watch.of(CaughtUp)[0][0]] + [at for at, _ in keepalives]
        assert [round(b - a, 3) for a, b in itertools.pairwise(times)] == [keepalive_s] * 4


async def test_shutdown_ends_watches_and_refuses_new_ones() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 3)
        core.registry.begin_shutdown()
        await watch.ended()
        assert isinstance(watch.error, ShuttingDown)
        assert "after_episode=" in str(watch.error)  # says where to resume
        with pytest.raises(ShuttingDown):
            async for _ in core.registry.watch(run.id, 0):
                pass


async def test_a_deleted_run_is_not_found_for_watchers_and_an_active_one_cannot_be_deleted() -> (
    None
):
    async with running_core() as core:
        run = await core.create(max_episodes=5)
        watch = core.watch(run.id)
        with pytest.raises(IllegalTransition, match="stop it first"):
            await core.registry.delete(run.id)
        await watch.ended()  # Finished: the run has left the active runs
        deleted = await core.registry.delete(run.id)
        assert (deleted.state, deleted.episode) == (RunState.DONE, 5)

        with pytest.raises(RunNotFound):
            async for _ in core.registry.watch(run.id, 0):
                pass


async def test_a_run_reported_done_can_be_deleted() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=5)
        await core.wait_episode(run.id, 4)
        core.store.update_delay_s = 1.0  # the final state takes a while to the store
        done = await core.wait_state(run.id, RunState.DONE)
        assert done.state is RunState.DONE
        deleted = await core.registry.delete(run.id)
        assert deleted.id == run.id
