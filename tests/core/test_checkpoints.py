"""Checkpoints in the gateway core, in virtual time: records and retention, a run restarted
from its checkpoint on another trainer when its trainer dies (exactly once for a watcher, its
reward going on), what is not restarted (no checkpoint yet, a provider error, a crash loop past
``max_restarts``), a corrupt latest checkpoint skipped, a failed write shown, a paused run
parked (its slot freed for another run) and resumed, also across a gateway restart, its job kept
while the store cannot take the parking, and a stop that keeps the job's final checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.core.runs import LOST_MESSAGE, UNEXPECTED_MESSAGE, RunState
from gateway.core.store import StoreWriteFailed
from tests.fakes.core_harness import Core, running_core
from tests.fakes.episodes import reward_of
from tests.fakes.memory_trainer import CancelCall, JobScript, MemoryCheckpoints, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


def _expected_rewards(last: int) -> list[float]:
    return [reward_of(n) for n in range(1, last + 1)]


async def _checkpointed_through(core: Core, run_id: str, episode: int) -> None:
    async def reached() -> bool:
        return (await core.run(run_id)).checkpoint_episode >= episode

    await until(reached, f"run {run_id} checkpointed through {episode}")


async def test_checkpoints_are_recorded_and_retention_keeps_the_latest() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=20, checkpoint_every=5, keep_checkpoints=2)
        done = await core.wait_state(run.id, RunState.DONE)

        records = await core.registry.list_checkpoints(run.id)
        assert [r.episode for r in records] == [15, 20]
        assert done.checkpoint_episode == 20
        # Retention deleted the older ones' files.
        await until(lambda: len(core.connector.checkpoints.deleted) == 2, "retention")
        assert sorted(core.connector.checkpoints.deleted) == [(run.id, 5), (run.id, 10)]


async def test_a_dead_trainer_restarts_the_run_on_another_from_its_checkpoint() -> None:
    one, two = MemoryTrainer("t1", slots_total=1), MemoryTrainer("t2", slots_total=1)
    async with running_core(one, two) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 12)
        await _checkpointed_through(core, run.id, 10)
        received = (await core.run(run.id)).trainer_episode
        one.kill()
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()

        # Exactly once, with the rewards the training produced, for the watcher.
        assert watch.numbers() == list(range(1, 41))
        assert [e.reward for e in watch.episodes()] == _expected_rewards(40)
        best = [e.best_reward for e in watch.episodes()]
        assert best == sorted(best)  # the running maximum never reset
        assert (done.restarts, done.trainer, done.error_message) == (1, "t2", "")
        # The new job started from the newest checkpoint the run had every episode of.
        restart = core.connector.trains(run.id)[-1]
        assert restart.address == "t2" and restart.attach_after is None
        kept = [e for e in range(5, 41, 5) if e <= received][-3:]  # keep_checkpoints: 3
        assert list(restart.resume_from) == kept[::-1]


async def test_a_run_without_a_checkpoint_fails_as_before() -> None:
    one, two = MemoryTrainer("t1"), MemoryTrainer("t2")
    async with running_core(one, two) as core:
        run = await core.create(max_episodes=40, episodes_per_second=10.0)
        await core.wait_episode(run.id, 5)
        one.kill()
        failed = await core.wait_state(run.id, RunState.ERROR, timeout=60.0)

        assert (failed.error_message, failed.restarts) == (LOST_MESSAGE, 0)
        assert {c.address for c in core.connector.trains(run.id)} == {"t1"}


async def test_a_provider_error_is_not_restarted() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(fail_after=12, user_message="The dataset has a bad row."))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5)
        failed = await core.wait_state(run.id, RunState.ERROR)

        assert (failed.error_message, failed.restarts) == ("The dataset has a bad row.", 0)
        assert failed.checkpoint_episode == 10
        assert len(core.connector.trains(run.id)) == 1


async def test_a_crash_loop_ends_in_error_after_the_last_restart() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(*(JobScript(crash_after=7) for _ in range(4)))
    async with running_core(trainer, max_restarts=2) as core:
        run = await core.create(max_episodes=40, checkpoint_every=5)
        watch = core.watch(run.id)
        failed = await core.wait_state(run.id, RunState.ERROR, timeout=60.0)
        await watch.ended()

        assert failed.restarts == 2
        assert failed.error_message == (
            f"{UNEXPECTED_MESSAGE} Gave up after 2 restarts from checkpoints."
        )
        # Each restart went back to episode 5 and trained 6 and 7 again: never re-sent.
        assert [c.resume_from[:1] for c in core.connector.trains(run.id)] == [(), (5,), (5,)]
        assert watch.numbers() == list(range(1, 8))


async def test_a_corrupt_latest_checkpoint_is_skipped_and_the_run_says_so() -> None:
    one, two = MemoryTrainer("t1"), MemoryTrainer("t2")
    async with running_core(one, two) as core:
        run = await core.create(max_episodes=60, checkpoint_every=5, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 11)
        await _checkpointed_through(core, run.id, 10)
        one.kill()
        *_, before, latest = await core.registry.list_checkpoints(run.id)
        core.connector.checkpoints.corrupt.add((run.id, latest.episode))

        async def said() -> str | None:
            detail = (await core.run(run.id)).state_detail
            return detail if "skipped" in detail else None

        detail = await until(said, "the skipped checkpoint in the run's detail", 60.0)
        assert f"continued from the checkpoint at episode {before.episode}" in detail
        files = MemoryCheckpoints.corrupt_digest(run.id, latest.episode)
        assert (
            f"skipped the checkpoint at episode {latest.episode} (digest mismatch: its files hash "
            f"to {files} ({latest.size_bytes} bytes), expected {latest.sha256})"
        ) in detail
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        assert watch.numbers() == list(range(1, 61))
        assert done.restarts == 1


async def test_a_failed_checkpoint_write_is_shown_and_training_goes_on() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(checkpoints_fail=True))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=30, checkpoint_every=5, episodes_per_second=10.0)

        async def said() -> str | None:
            detail = (await core.run(run.id)).state_detail
            return detail if "could not be written" in detail else None

        detail = await until(said, "the failed write in the run's detail", 30.0)
        assert "No space left on device" in detail
        done = await core.wait_state(run.id, RunState.DONE, timeout=60.0)
        assert done.episode == 30
        assert await core.registry.list_checkpoints(run.id) == []


async def test_a_parked_run_frees_its_slot_for_another_and_resumes_where_it_was() -> None:
    trainer = MemoryTrainer("t1", slots_total=1)
    async with running_core(trainer, park_after_s=30.0) as core:
        first = await core.create(max_episodes=60, checkpoint_every=10, episodes_per_second=10.0)
        watch = core.watch(first.id)
        await core.wait_episode(first.id, 8)
        paused = await core.registry.pause(first.id)
        second = await core.create(max_episodes=10)
        assert (await core.run(second.id)).state is RunState.PENDING  # the slot is held

        await core.wait_parked(first.id)
        run = await core.run(first.id)
        assert run.state is RunState.PAUSED and "parked at episode" in run.state_detail
        [cancel] = core.connector.cancels(first.id)
        assert cancel == CancelCall("t1", first.id, cancel.at, checkpoint=True)
        assert cancel.at >= core.connector.calls[0].at + 30.0
        # Its job wrote a checkpoint at its grant, which the run had received.
        assert run.checkpoint_episode == run.trainer_episode > paused.episode
        # The freed slot trains the other run.
        await core.wait_state(second.id, RunState.DONE, timeout=60.0)

        await core.registry.resume(first.id)
        done = await core.wait_state(first.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        assert watch.numbers() == list(range(1, 61))
        assert [e.reward for e in watch.episodes()] == _expected_rewards(60)
        assert (done.parked, done.restarts) == (False, 0)
        resumed = core.connector.trains(first.id)[-1]
        assert resumed.resume_from[0] == run.checkpoint_episode


async def test_a_parked_run_stays_parked_across_a_gateway_restart(tmp_path: Path) -> None:
    trainer = MemoryTrainer("t1", slots_total=1)
    async with running_core(trainer, db=str(tmp_path / "runs.db"), park_after_s=5.0) as core:
        run = await core.create(
            max_episodes=50, checkpoint_every=4, keep_checkpoints=20, episodes_per_second=10.0
        )
        await core.wait_episode(run.id, 9)
        paused = await core.registry.pause(run.id)

        await core.wait_parked(run.id)
        await core.restart()

        again = await core.run(run.id)
        assert (again.state, again.parked) == (RunState.PAUSED, True)
        assert again.episode == paused.episode
        watch = core.watch(run.id)
        await core.registry.resume(run.id)
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        assert watch.numbers() == list(range(1, 51))
        # What the old gateway received past its published episode went with it, so the new
        # job started from the newest checkpoint at or before that episode.
        restart = core.connector.trains(run.id)[-1]
        assert restart.resume_from[0] == paused.episode // 4 * 4
        assert done.restarts == 0


async def test_a_park_the_store_cannot_take_keeps_the_job_until_it_can() -> None:
    # Parking ends the job: what the run received past its published episode then lives only
    # in this gateway. While the run cannot be stored (here a full disk; in a replica set also
    # a lost lease), the job is kept, so whoever drives the run next still finds it.
    trainer = MemoryTrainer("t1", slots_total=1)
    async with running_core(trainer, park_after_s=5.0) as core:
        run = await core.create(max_episodes=40, checkpoint_every=10, episodes_per_second=10.0)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 6)
        await core.registry.pause(run.id)
        core.store.update_error = StoreWriteFailed("No space left on device")
        await asyncio.sleep(18.0)  # three park timeouts
        assert core.connector.cancels(run.id) == []
        assert not (await core.run(run.id)).parked

        core.store.update_error = None

        await core.wait_parked(run.id, 30.0)
        [cancel] = core.connector.cancels(run.id)
        assert cancel.checkpoint
        await core.registry.resume(run.id)
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()
        assert watch.numbers() == list(range(1, 41))
        assert (done.parked, done.restarts) == (False, 0)


async def test_stop_keeps_the_jobs_final_checkpoint() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=100, checkpoint_every=50, episodes_per_second=10.0)
        await core.wait_episode(run.id, 5)
        stopped = await core.registry.stop(run.id)

        async def recorded() -> bool:
            return bool(await core.registry.list_checkpoints(run.id))

        await until(recorded, "the final checkpoint", 30.0)
        [record] = await core.registry.list_checkpoints(run.id)
        assert record.episode >= stopped.episode
        [cancel] = core.connector.cancels(run.id)
        assert cancel.checkpoint
        assert (await core.run(run.id)).checkpoint_episode == record.episode
