"""Forks in the gateway core, in virtual time: a run started from another run's checkpoint numbers
its episodes from the fork episode + 1 with the parent's counters there, and its history starts
there everywhere (replay exactly once, the live tail, the curve, details, a gateway restart, a
restart from a checkpoint after its trainer died); a fork that cannot start from its checkpoint
fails instead of training from scratch; invalid forks are refused, naming the reason."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from gateway.core.details import DetailRetention
from gateway.core.errors import InvalidRequest
from gateway.core.registry import CaughtUp, RunSpec
from gateway.core.runs import RunState, TrainingRun
from tests.fakes.core_harness import TASKS, Core, running_core
from tests.fakes.episodes import reward_of
from tests.fakes.memory_trainer import JobScript, MemoryCheckpoints, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until
from trainwire.v1 import episode_pb2

pytestmark = VIRTUAL_TIME


async def _parent(core: Core, max_episodes: int = 40, every: int = 10) -> TrainingRun:
    """A finished run with checkpoints every ``every`` episodes (all kept)."""
    run = await core.create(
        max_episodes=max_episodes,
        checkpoint_every=every,
        keep_checkpoints=100,
        episodes_per_second=-1.0,
    )
    return await core.wait_state(run.id, RunState.DONE)


async def _fork(
    core: Core,
    parent_id: str,
    episode: int,
    max_episodes: int,
    task: episode_pb2.TrainTask | None = None,
    every: int = 0,
    rate: float = -1.0,
) -> TrainingRun:
    task = task or TASKS["imitation"]()
    spec = RunSpec(
        task=task,
        config=episode_pb2.TrainConfig(
            max_episodes=max_episodes, seed=11, checkpoint_every=every, keep_checkpoints=100
        ),
        episodes_per_second=rate,
        fork_run_id=parent_id,
        fork_episode=episode,
    )
    return await core.registry.create(spec)


def _best_through(episode: int) -> float:
    return max(reward_of(n) for n in range(1, episode + 1))


async def test_a_fork_numbers_on_from_its_checkpoint_with_the_parents_counters() -> None:
    async with running_core() as core:
        parent = await _parent(core)
        fork = await _fork(core, parent.id, 20, 50, every=10)

        # Before its first episode it stands where the parent stood at the fork.
        assert (fork.fork_run_id, fork.fork_episode) == (parent.id, 20)
        assert (fork.episode, fork.reward) == (20, reward_of(20))
        assert fork.best_reward == _best_through(20)
        live = core.watch(fork.id)
        done = await core.wait_state(fork.id, RunState.DONE)
        await live.ended()

        # The live watch from 0 starts at the fork episode + 1, every episode once.
        assert live.numbers() == list(range(21, 51))
        [(_, caught_up)] = live.of(CaughtUp)
        assert caught_up.last_episode >= 20
        episodes = live.episodes()
        assert [e.reward for e in episodes] == [reward_of(n) for n in range(21, 51)]
        # The running best goes on from the parent's best at the fork.
        assert [e.best_reward for e in episodes] == [
            max(_best_through(20), *(reward_of(k) for k in range(21, n + 1))) for n in range(21, 51)
        ]
        assert (done.episode, done.best_reward) == (50, _best_through(50))
        # Its job started from the parent's checkpoint; its own checkpoints are its own.
        [train] = core.connector.trains(fork.id)
        assert (train.resume_from, train.resume_runs) == ((20,), (parent.id,))
        mine = await core.registry.list_checkpoints(fork.id)
        assert [(r.run_id, r.episode) for r in mine] == [(fork.id, e) for e in (30, 40, 50)]
        # The parent is untouched.
        assert (await core.run(parent.id)).episode == 40


async def test_a_finished_forks_replay_starts_after_the_fork_exactly_once() -> None:
    async with running_core(history_cache_mb=0) as core:
        parent = await _parent(core, max_episodes=700, every=300)
        fork = await _fork(core, parent.id, 300, 900)
        await core.wait_state(fork.id, RunState.DONE)

        for after, first in ((0, 301), (120, 301), (300, 301), (555, 556), (900, 901)):
            replay = core.watch(fork.id, after_episode=after)
            await replay.ended()
            assert replay.numbers() == list(range(first, 901)), after
            [(_, caught_up)] = replay.of(CaughtUp)
            assert caught_up.last_episode == 900
            assert replay.finished is not None and replay.finished.episode == 900


async def test_a_late_watcher_of_a_long_fork_reads_its_older_history_from_the_store() -> None:
    # A live tail of 64: most of the fork's history is behind it, in pages of the store, the
    # first of which holds only the episodes after the fork.
    async with running_core(live_episodes=64) as core:
        parent = await _parent(core, max_episodes=300, every=100)
        fork = await _fork(core, parent.id, 100, 2000, rate=100.0)
        await core.wait_episode(fork.id, 900)
        late = core.watch(fork.id, after_episode=50)
        await late.ended()
        assert late.numbers() == list(range(101, 2001))


async def test_a_forks_curve_covers_its_own_episodes_and_matches_them() -> None:
    async with running_core() as core:
        parent = await _parent(core, max_episodes=400, every=130)
        # 130: not a multiple of 4, so the blocks around the fork hold the fork's episodes only.
        fork = await _fork(core, parent.id, 130, 1500)
        empty, last = await core.registry.curve(fork.id, 10, ())
        assert (empty, last) == ([], 130)
        await core.wait_state(fork.id, RunState.DONE)
        replay = core.watch(fork.id)
        await replay.ended()
        episodes = {e.episode: e for e in replay.episodes()}

        for buckets, first, last_asked in ((7, 0, 0), (500, 0, 0), (3, 1, 200), (5, 140, 1500)):
            got, last = await core.registry.curve(fork.id, buckets, ["loss"], first, last_asked)
            assert last == 1500
            start = max(first, 131)
            assert got[0].first == start
            assert got[-1].last == (last_asked or 1500)
            for left, right in itertools.pairwise(got):
                assert right.first == left.last + 1
            for bucket in got:
                span = [episodes[n] for n in range(bucket.first, bucket.last + 1)]
                rewards = [e.reward for e in span]
                assert bucket.reward_min == min(rewards)
                assert bucket.reward_max == max(rewards)
                assert bucket.reward_mean == pytest.approx(sum(rewards) / len(rewards))
                assert bucket.best_reward == span[-1].best_reward
                losses = [e.metrics["loss"] for e in span]
                assert bucket.metrics_mean["loss"] == pytest.approx(sum(losses) / len(losses))


async def test_a_fork_goes_on_after_a_gateway_restart(tmp_path: Path) -> None:
    async with running_core(db=str(tmp_path / "gateway.db")) as core:
        parent = await _parent(core, max_episodes=200, every=70)
        fork = await _fork(core, parent.id, 70, 600, rate=50.0)
        before = core.watch(fork.id)
        await core.wait_episode(fork.id, 170)

        await core.restart()
        seen = before.numbers()
        after = core.watch(fork.id, after_episode=seen[-1])
        await after.ended()
        assert seen + after.numbers() == list(range(71, 601))
        # The curve kept folding after the restart (its open blocks restored past the fork).
        got, _ = await core.registry.curve(fork.id, 600, ())
        assert [(b.first, b.last) for b in got] == [(n, n) for n in range(71, 601)]
        assert [b.reward_max for b in got] == [reward_of(n) for n in range(71, 601)]


async def test_a_pending_fork_starts_from_its_checkpoint_after_a_gateway_restart(
    tmp_path: Path,
) -> None:
    trainer = MemoryTrainer("t1", slots_total=1)
    async with running_core(trainer, db=str(tmp_path / "gateway.db")) as core:
        parent = await _parent(core, max_episodes=60, every=30)
        trainer.kill()
        fork = await _fork(core, parent.id, 30, 80)
        await core.restart()
        assert (await core.run(fork.id)).state is RunState.PENDING
        trainer.revive()
        await core.wait_state(fork.id, RunState.DONE)
        replay = core.watch(fork.id)
        await replay.ended()
        assert replay.numbers() == list(range(31, 81))


async def test_a_fork_whose_trainer_dies_restarts_from_the_parents_checkpoint_or_its_own() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two) as core:
        parent = await _parent(core, max_episodes=40, every=20)
        # No checkpoint of its own yet when its trainer dies: it starts again from the parent's.
        fork = await _fork(core, parent.id, 20, 200, every=50, rate=10.0)
        watch = core.watch(fork.id)
        await core.wait_episode(fork.id, 22)  # trained through at most 42: before its first
        first = (await core.run(fork.id)).trainer
        core.connector.trainers[first].kill()
        await core.wait_episode(fork.id, 60)
        restart = core.connector.trains(fork.id)[-1]
        assert (restart.resume_from, restart.resume_runs) == ((20,), (parent.id,))

        # With checkpoints of its own: its own, newest first, then the parent's.
        async def own_checkpoint() -> bool:
            return (await core.run(fork.id)).checkpoint_episode >= 100

        await until(own_checkpoint, "the fork's checkpoint at 100")
        second = (await core.run(fork.id)).trainer
        core.connector.trainers[first].revive()
        core.connector.trainers[second].kill()
        done = await core.wait_state(fork.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        assert done.restarts == 2
        restart = core.connector.trains(fork.id)[-1]
        *own, last = restart.resume_from
        assert last == 20 and own[0] >= 100 and own == sorted(own, reverse=True)
        assert restart.resume_runs == (*(fork.id for _ in own), parent.id)
        assert watch.numbers() == list(range(21, 201))
        assert [e.reward for e in watch.episodes()] == [reward_of(n) for n in range(21, 201)]


async def test_a_fork_whose_checkpoint_is_gone_fails_instead_of_training_from_scratch() -> None:
    trainer = MemoryTrainer("t1", slots_total=1)
    async with running_core(trainer) as core:
        parent = await _parent(core, max_episodes=40, every=20)
        blocker = await core.create(max_episodes=1000, episodes_per_second=1.0)
        await core.wait_state(blocker.id, RunState.RUNNING)
        fork = await _fork(core, parent.id, 20, 60)
        await core.registry.delete(parent.id)  # its checkpoints go with it
        await core.registry.stop(blocker.id)

        failed = await core.wait_state(fork.id, RunState.ERROR)
        assert failed.error_message == (
            f"This fork could not start from the checkpoint of run {parent.id} at episode 20: "
            "that checkpoint is gone (deleted with its run or by its retention)."
        )
        assert core.connector.trains(fork.id) == []

        # A checkpoint the trainer cannot restore: the job it started is cancelled.
        other = await _parent(core, max_episodes=40, every=20)
        core.connector.checkpoints.corrupt.add((other.id, 20))
        fork = await _fork(core, other.id, 20, 60)
        failed = await core.wait_state(fork.id, RunState.ERROR)
        assert failed.error_message == (
            f"This fork could not start from the checkpoint of run {other.id} at episode 20: "
            "no checkpoint restored (episode 20: digest mismatch: its files hash to "
            f"{MemoryCheckpoints.corrupt_digest(other.id, 20)} (1020 bytes), expected "
            f"{MemoryCheckpoints.digest(other.id, 20)})."
        )
        assert failed.episode == 20
        await until(lambda: core.connector.cancels(fork.id), "the from-scratch job cancelled")


async def test_forking_an_active_run_from_its_latest_published_checkpoint() -> None:
    async with running_core() as core:
        parent = await core.create(
            max_episodes=400, checkpoint_every=10, keep_checkpoints=100, episodes_per_second=10.0
        )
        await core.wait_episode(parent.id, 35)
        published = (await core.run(parent.id)).episode
        fork = await _fork(core, parent.id, 0, 100)
        # 0: its latest checkpoint among the episodes it has published.
        assert fork.fork_episode == published // 10 * 10
        assert fork.fork_episode >= 30
        assert (await core.run(parent.id)).state is RunState.RUNNING
        done = await core.wait_state(fork.id, RunState.DONE)
        assert done.episode == 100
        await core.registry.stop(parent.id)


async def test_invalid_forks_are_refused_naming_the_reason() -> None:
    async with running_core() as core:
        parent = await _parent(core, max_episodes=40, every=10)

        async def refused(**fork: object) -> InvalidRequest:
            with pytest.raises(InvalidRequest) as caught:
                await _fork(core, **fork)  # type: ignore[arg-type]
            return caught.value

        missing = await refused(parent_id="nosuchrun", episode=0, max_episodes=60)
        assert [v.field for v in missing.violations] == ["fork_from.run_id"]
        assert "there is no run 'nosuchrun'" in str(missing)

        no_checkpoint = await refused(parent_id=parent.id, episode=25, max_episodes=60)
        assert [v.field for v in no_checkpoint.violations] == ["fork_from.episode"]
        assert f"run {parent.id!r} has no checkpoint at episode 25; it has 10, 20, 30, 40" in str(
            no_checkpoint
        )

        grpo = await refused(parent_id=parent.id, episode=20, max_episodes=60, task=TASKS["grpo"]())
        assert [v.field for v in grpo.violations] == ["task"]
        assert "a task of kind 'grpo'; the checkpoint is of kind 'imitation'" in str(grpo)

        walk = TASKS["imitation"]()
        walk.imitation.clip_name = "walk"
        clip = await refused(parent_id=parent.id, episode=20, max_episodes=60, task=walk)
        assert [v.field for v in clip.violations] == ["task.imitation.clip_name"]
        assert "'walk'; the checkpoint's task has 'wave'" in str(clip)

        short = await refused(parent_id=parent.id, episode=20, max_episodes=20)
        assert [v.field for v in short.violations] == ["config.max_episodes"]
        assert "config.max_episodes 20 is not after the fork episode 20" in str(short)

        # A run whose every checkpoint failed (a full disk): a trainer checkpoints after a
        # run's last episode whatever its checkpoint_every, so only a failure leaves none.
        core.trainer.script(JobScript(checkpoints_fail=True))
        fresh = await core.create(max_episodes=40)
        await core.wait_state(fresh.id, RunState.DONE)
        none = await refused(parent_id=fresh.id, episode=0, max_episodes=60)
        assert f"run {fresh.id!r} has no checkpoint to fork from yet" in str(none)

        # What a fork may change: its hyperparameters, seed and max_episodes.
        changed = TASKS["imitation"]()
        changed.imitation.learning_rate = 0.01
        changed.imitation.group_size = 8
        fork = await _fork(core, parent.id, 20, 60, task=changed)
        assert fork.fork_episode == 20


def test_a_fork_keeps_as_many_details_as_a_run_of_its_own_length() -> None:
    run = TrainingRun(
        id="f",
        task=TASKS["imitation"](),
        config=episode_pb2.TrainConfig(max_episodes=1_010_000),
        fork_run_id="p",
        fork_episode=1_000_000,
    )
    store: Any = None  # never reached: nothing to settle
    details = DetailRetention(run, "imitation", store, print, print, 2048, 10_000)
    # 10,000 episodes of its own: every detail kept; nothing before the fork to settle.
    assert (details.stride, details.thinned) == (1, 1_000_000)
    assert not details.active
