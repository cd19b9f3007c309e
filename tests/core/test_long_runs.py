"""Long runs at the core's seams, in virtual time and scaled down (a live tail of 64 episodes, a
run keeping about 200 details): the live tail stays bounded while watchers still get every
episode once, old details are dropped to the documented set and shown as absent, a scalar watch
carries no detail, and the curve is exact, across a gateway restart too."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest

from gateway.core.details import detail_stride
from gateway.core.errors import InvalidRequest, RunNotFound
from gateway.core.runs import RunState
from tests.fakes.core_harness import Core, Watch, running_core
from tests.fakes.episodes import reward_of
from tests.fakes.memory_trainer import JobScript, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from trainwire.v1 import episode_pb2

pytestmark = VIRTUAL_TIME

LIVE = 64
DETAILS = 200
EPISODES = 3000  # stride 15: of the trainer's details (every 10th) those of every 30th stay
DETAIL_EVERY = 10
CHECKPOINT_EVERY = 500
SMALL = {"live_episodes": LIVE, "details_per_run": DETAILS}


def scalar_watch(core: Core, run_id: str) -> Watch:
    """A watcher of the numbers only."""
    watch = Watch(run_id)

    async def consume() -> None:
        async for event in core.registry.watch(run_id, 0, scalars=True):
            watch.events.append((0.0, event))

    watch.task = asyncio.create_task(consume())
    return watch


async def long_run(core: Core, episodes: int = EPISODES, rate: float = -1.0) -> str:
    """A run of ``episodes`` (unpaced unless ``rate`` says otherwise)."""
    core.trainer.script(JobScript(detail_every=DETAIL_EVERY))
    run = await core.create(
        max_episodes=episodes, episodes_per_second=rate, checkpoint_every=CHECKPOINT_EVERY
    )
    return run.id


def assert_curve_is_exact(buckets: list, episodes: list[episode_pb2.Episode]) -> None:
    assert buckets[0].first == episodes[0].episode and buckets[-1].last == episodes[-1].episode
    for a, b in itertools.pairwise(buckets):
        assert b.first == a.last + 1
    for bucket in buckets:
        part = episodes[bucket.first - episodes[0].episode : bucket.last - episodes[0].episode + 1]
        rewards = [e.reward for e in part]
        assert (bucket.reward_min, bucket.reward_max) == (min(rewards), max(rewards))
        assert bucket.reward_mean == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)
        assert bucket.best_reward == part[-1].best_reward
        losses = [e.metrics["loss"] for e in part]
        assert bucket.metrics_mean["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)


async def test_a_long_run_keeps_a_bounded_tail_and_the_documented_details() -> None:
    async with running_core(**SMALL) as core:
        # Paced (in virtual time), so it is still running when the checks below look at it.
        run_id = await long_run(core, rate=1000.0)
        early = core.watch(run_id)
        await core.wait_episode(run_id, 1500)
        driver = core.registry.table.get(run_id)
        assert driver is not None
        assert LIVE <= len(driver.log.frames) <= 2 * LIVE  # the live tail, not the history
        late = core.watch(run_id)  # most of its history comes from the store now
        await core.wait_state(run_id, RunState.DONE)
        await early.ended()
        await late.ended()
        replay = core.watch(run_id)
        await replay.ended()
        scalars = scalar_watch(core, run_id)
        await scalars.ended()

    numbers = list(range(1, EPISODES + 1))
    for watch in (early, late, replay, scalars):
        assert watch.error is None and watch.numbers() == numbers  # every episode once
    # Live, every detail the trainer sent; the early watcher replayed nothing from the store.
    sent = {n for n in numbers if n % DETAIL_EVERY == 0} | {EPISODES}
    assert {e.episode for e in early.episodes() if e.HasField("imitation")} == sent

    kept = {e.episode for e in replay.episodes() if e.HasField("imitation")}
    stride = detail_stride(EPISODES, DETAILS)
    assert stride == 15
    must = {n for n in sent if n % stride == 0 or n % CHECKPOINT_EVERY == 0} | {EPISODES}
    assert must <= kept <= sent
    # Besides those, only a few bests (one per thinned stretch of 2 x 64 episodes at most).
    extra = kept - must
    assert len(extra) <= EPISODES // (2 * LIVE) + 1
    best = max((reward_of(n), n) for n in sent)[1]
    assert best in kept
    # An episode without its detail is the episode's numbers, never made-up detail.
    full = {e.episode: e for e in early.episodes()}
    for episode in replay.episodes():
        if not episode.HasField("imitation"):
            expected = episode_pb2.Episode()
            expected.CopyFrom(full[episode.episode])
            expected.ClearField("imitation")
            assert episode == expected
    assert not any(e.HasField("imitation") for e in scalars.episodes())


async def test_a_run_that_ends_while_old_details_are_settled_still_settles_the_rest() -> None:
    async with running_core(**SMALL) as core:
        # The first chunk's settling outlasts the (unpaced) run: the run's end comes while it
        # is at work, and the rest of the run is settled after it, not left as it came.
        core.store.settle_delay_s = 5.0
        run_id = await long_run(core)
        await core.wait_state(run_id, RunState.DONE)
        await asyncio.sleep(4 * core.store.settle_delay_s)  # the chunk, then the rest
        replay = core.watch(run_id)
        await replay.ended()

    kept = {e.episode for e in replay.episodes() if e.HasField("imitation")}
    stride = detail_stride(EPISODES, DETAILS)
    sent = {n for n in range(DETAIL_EVERY, EPISODES + 1, DETAIL_EVERY)} | {EPISODES}
    must = {n for n in sent if n % stride == 0 or n % CHECKPOINT_EVERY == 0} | {EPISODES}
    # Two stretches were settled (the first chunk, then the rest at the end): one best each.
    assert must <= kept and len(kept - must) <= 2


async def test_the_curve_is_exact_at_every_scale_while_running_and_after() -> None:
    async with running_core(**SMALL) as core:
        run_id = await long_run(core)
        await core.wait_episode(run_id, 777)
        mid, last = await core.registry.curve(run_id, 50, ["loss"])
        assert last >= 777 and mid[-1].last == last  # the committed episodes, nothing more
        await core.wait_state(run_id, RunState.DONE)
        replay = core.watch(run_id)
        await replay.ended()
        episodes = replay.episodes()
        for buckets, first, upto in [(500, 0, 0), (7, 0, 0), (10_000, 0, 0), (40, 1234, 2345)]:
            got, last = await core.registry.curve(run_id, buckets, ["loss"], first, upto)
            assert last == EPISODES
            lo, hi = (first or 1), (upto or EPISODES)
            assert len(got) <= buckets
            assert_curve_is_exact(got, episodes[lo - 1 : hi])
        assert_curve_is_exact(mid, episodes[: mid[-1].last])


async def test_the_curve_and_the_tail_survive_a_gateway_restart(tmp_path: Path) -> None:
    trainer = MemoryTrainer("t1", heartbeat_s=1.0)
    async with running_core(trainer, db=str(tmp_path / "g.db"), **SMALL) as core:
        # Paced (in virtual time): an unpaced run could finish before the pause lands.
        run_id = await long_run(core, 2000, rate=100.0)
        await core.wait_episode(run_id, 1001)
        await core.registry.pause(run_id)
        await core.restart()
        driver = core.registry.table.get(run_id)
        assert driver is not None and len(driver.log.frames) <= LIVE
        await core.registry.resume(run_id)
        await core.wait_state(run_id, RunState.DONE)
        replay = core.watch(run_id)
        await replay.ended()
        assert replay.numbers() == list(range(1, 2001))
        got, last = await core.registry.curve(run_id, 333, ["loss"])
        assert last == 2000
        assert_curve_is_exact(got, replay.episodes())


async def test_bad_curve_requests_name_the_field() -> None:
    async with running_core(**SMALL) as core:
        run = await core.create(max_episodes=5)
        for kwargs, field in [
            ({"buckets": 10_001}, "buckets"),
            ({"buckets": -1}, "buckets"),
            ({"first_episode": 9, "last_episode": 3}, "first_episode"),
            ({"last_episode": -2}, "last_episode"),
            ({"metrics": ["bad name!"]}, "metrics[0]"),
        ]:
            args = {"buckets": 10, "metrics": [], **kwargs}
            with pytest.raises(InvalidRequest) as caught:
                await core.registry.curve(run.id, **args)
            assert caught.value.violations[0].field == field
            assert run.id in str(caught.value)
        with pytest.raises(RunNotFound):
            await core.registry.curve("no-such-run", 10, [])
        await core.wait_state(run.id, RunState.DONE)
        got, last = await core.registry.curve(run.id, 0, ["nope"])
        assert last == 5 and [(b.first, b.last) for b in got] == [(n, n) for n in range(1, 6)]
        assert all(b.metrics_mean == {} for b in got)
        assert math.isfinite(got[0].reward_mean)
