"""The life of a job that spans trainers, in virtual time: a lost share restarts the run from
its checkpoint on other trainers, and after the last restart (or without a checkpoint) ends it
ERROR naming the trainer and its ranks; rank 0's trainer lost is named as such even when the
other ranks fail first; a share refused as busy queues the run again without a restart, and so
does a busy answer while the run is placed again; park
frees every slot and resume places the job again elsewhere; stop cancels every share after rank
0's final checkpoint; a gateway restart cancels every share and restarts from the checkpoint."""

from __future__ import annotations

from pathlib import Path

from gateway.core.runs import INTERRUPTED_MESSAGE, LOST_MESSAGE, RunState
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import CancelCall, MemoryTrainer, TrainCall
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME

#: Long enough to be mid-way when a trainer dies; checkpoints every ``EVERY`` episodes.
EPISODES = 60
EVERY = 5


def grpo_trainers(*addresses: str) -> list[MemoryTrainer]:
    """One-slot trainers that offer grpo."""
    return [MemoryTrainer(a, providers=("grpo",), slots_total=1) for a in addresses]


def new_jobs(core: Core, run_id: str) -> list[TrainCall]:
    """The new jobs and shares asked for a run, in order."""
    return [c for c in core.connector.trains(run_id) if c.attach_after is None]


async def checkpointed(core: Core, run_id: str, episode: int) -> None:
    async def reached() -> bool:
        return (await core.run(run_id)).checkpoint_episode >= episode

    await until(reached, f"run {run_id} checkpointed through {episode}")


async def test_a_lost_share_restarts_the_run_from_its_checkpoint_on_other_trainers() -> None:
    a, b, c = grpo_trainers("a:1", "b:1", "c:1")
    async with running_core(a, b, c) as core:
        run = await core.create(
            max_episodes=EPISODES, kind="grpo", processes=2, checkpoint_every=EVERY
        )
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 12)
        await checkpointed(core, run.id, 10)
        assert (await core.run(run.id)).trainers == ("a:1", "b:1")
        b.kill()
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()

        assert watch.numbers() == list(range(1, EPISODES + 1))  # exactly once
        assert (done.restarts, done.trainers, done.error_message) == (1, ("a:1", "c:1"), "")
        first, share, rank0, again = new_jobs(core, run.id)
        assert [j.address for j in (first, share, rank0, again)] == ["a:1", "b:1", "a:1", "c:1"]
        # Rank 0's job, its peer gone, was cancelled before the run was placed again.
        [cancel] = [x for x in core.connector.cancels(run.id) if x.address == "a:1"]
        assert not cancel.checkpoint and cancel.at <= rank0.at
        # The new share restores the one checkpoint rank 0 restored: the newest.
        assert rank0.resume_from and again.resume_from == rank0.resume_from[:1]
        assert again.placement is not None and again.placement.first_rank == 1
        assert (a.slots_free, c.slots_free) == (1, 1)


async def test_a_share_lost_after_the_last_restart_ends_the_run_naming_its_trainer() -> None:
    a, b, c = grpo_trainers("a:1", "b:1", "c:1")
    async with running_core(a, b, c, max_restarts=1) as core:
        run = await core.create(
            max_episodes=EPISODES, kind="grpo", processes=2, checkpoint_every=EVERY
        )
        await core.wait_episode(run.id, 12)
        await checkpointed(core, run.id, 10)
        b.kill()

        async def placed_again() -> bool:
            current = await core.run(run.id)
            return current.restarts == 1 and current.trainers == ("a:1", "c:1")

        await until(placed_again, "the run placed again on a:1 and c:1", 60.0)
        c.kill()
        failed = await core.wait_state(run.id, RunState.ERROR, timeout=60.0)
        assert failed.error_message == (
            f"trainer c:1 (ranks 1-1 of 2) was lost: {LOST_MESSAGE} "
            "Gave up after 1 restarts from checkpoints."
        )
        assert failed.restarts == 1
        await until(lambda: a.slots_free == 1, "rank 0's job cancelled")


async def test_without_a_checkpoint_a_lost_share_ends_the_run_at_once() -> None:
    a, b = grpo_trainers("a:1", "b:1")
    async with running_core(a, b) as core:
        run = await core.create(max_episodes=EPISODES, kind="grpo", processes=2)
        await core.wait_episode(run.id, 5)
        b.kill()
        failed = await core.wait_state(run.id, RunState.ERROR)
        assert failed.error_message == f"trainer b:1 (ranks 1-1 of 2) was lost: {LOST_MESSAGE}"
        assert (failed.restarts, failed.trainers) == (0, ("a:1", "b:1"))
        # Every share is cancelled: rank 0's, and the lost one (its stream broke; its job
        # might still run).
        cancels = core.connector.cancels(run.id)
        assert sorted((x.address, x.checkpoint) for x in cancels) == [
            ("a:1", False),
            ("b:1", False),
        ]


async def test_rank_0_lost_is_named_although_the_other_ranks_fail_first() -> None:
    # Rank 0's trainer dies: its stream breaks (and is re-attached for the heartbeat timeout)
    # while the share on b:1 fails at once for want of its peer.
    a, b = grpo_trainers("a:1", "b:1")
    async with running_core(a, b) as core:
        run = await core.create(max_episodes=EPISODES, kind="grpo", processes=2)
        await core.wait_episode(run.id, 5)
        a.kill()
        failed = await core.wait_state(run.id, RunState.ERROR)
        assert failed.error_message == f"trainer a:1 (ranks 0-0 of 2) was lost: {LOST_MESSAGE}"
        await until(lambda: b.slots_free == 1, "the share on b:1 cancelled")


async def test_a_share_refused_as_busy_queues_the_run_again_without_a_restart() -> None:
    a, b = grpo_trainers("a:1", "b:1")
    b.answer_busy = 1  # another gateway took its slot since it was asked
    async with running_core(a, b) as core:
        run = await core.create(max_episodes=20, kind="grpo", processes=2)
        done = await core.wait_state(run.id, RunState.DONE)

        assert (done.restarts, done.error_message, done.episode) == (0, "", 20)
        assert [j.address for j in new_jobs(core, run.id)] == ["a:1", "b:1", "a:1", "b:1"]
        # Rank 0's job waited for its share and is cancelled; the refused share had no job.
        assert [x.address for x in core.connector.cancels(run.id)] == ["a:1"]


async def test_a_busy_answer_while_placing_the_run_again_queues_it_again() -> None:
    a, b, c = grpo_trainers("a:1", "b:1", "c:1")
    async with running_core(a, b, c) as core:
        run = await core.create(
            max_episodes=EPISODES, kind="grpo", processes=2, checkpoint_every=EVERY
        )
        await core.wait_episode(run.id, 12)
        await checkpointed(core, run.id, 10)
        b.kill()
        a.answer_busy = 1  # the restart's first try on a:1 races another gateway's run
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)

        assert (done.restarts, done.error_message, done.trainers) == (1, "", ("a:1", "c:1"))
        assert [j.address for j in new_jobs(core, run.id)] == ["a:1", "b:1", "a:1", "a:1", "c:1"]


async def test_park_frees_every_slot_and_resume_places_the_job_again_elsewhere() -> None:
    a, b, c = grpo_trainers("a:1", "b:1", "c:1")
    async with running_core(a, b, c, park_after_s=3.0) as core:
        run = await core.create(
            max_episodes=EPISODES, kind="grpo", processes=2, checkpoint_every=EVERY
        )
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 12)
        await core.registry.pause(run.id)

        async def parked() -> bool:
            return (await core.run(run.id)).parked

        await until(parked, "the run parked", 30.0)
        await until(lambda: a.slots_free == b.slots_free == 1, "every slot of the job freed")
        rank0, share = core.connector.cancels(run.id)
        # Rank 0's trainer writes the final checkpoint, then the other share is cancelled.
        assert (rank0.address, rank0.checkpoint) == ("a:1", True)
        assert (share.address, share.checkpoint) == ("b:1", False)
        assert rank0.at <= share.at
        at_park = await core.run(run.id)

        # Another job takes a:1 meanwhile: the parked run resumes on b:1 and c:1.
        other = await core.create(max_episodes=EPISODES, kind="grpo")
        assert (await core.wait_state(other.id, RunState.RUNNING)).trainer == "a:1"
        await core.registry.resume(run.id)
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await watch.ended()

        assert watch.numbers() == list(range(1, EPISODES + 1))
        assert (done.trainers, done.restarts, done.parked) == (("b:1", "c:1"), 0, False)
        resumed, again = new_jobs(core, run.id)[-2:]
        assert resumed.resume_from[0] == at_park.checkpoint_episode
        assert again.resume_from == resumed.resume_from[:1]


async def test_stop_cancels_every_share_after_rank_0s_final_checkpoint() -> None:
    a, b, c = grpo_trainers("a:1", "b:1", "c:1")
    async with running_core(a, b, c) as core:
        run = await core.create(max_episodes=EPISODES, kind="grpo", processes=3)
        await core.wait_episode(run.id, 5)
        stopped = await core.registry.stop(run.id)
        assert stopped.state is RunState.STOPPED

        await until(lambda: len(core.connector.cancels(run.id)) == 3, "every share cancelled")
        rank0, *others = core.connector.cancels(run.id)
        assert (rank0.address, rank0.checkpoint) == ("a:1", True)
        assert sorted((x.address, x.checkpoint) for x in others) == [
            ("b:1", False),
            ("c:1", False),
        ]
        assert all(rank0.at <= x.at for x in others)
        await until(lambda: a.slots_free == b.slots_free == c.slots_free == 1, "slots free")


async def test_a_gateway_restart_cancels_every_share_and_restarts_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    a, b = grpo_trainers("a:1", "b:1")
    async with running_core(a, b, db=str(tmp_path / "gateway.db")) as core:
        # The trainer trains a lead of 20 episodes ahead: keep enough checkpoints that one is
        # at or before what was published (a restarted gateway has nothing after it).
        run = await core.create(
            max_episodes=EPISODES,
            kind="grpo",
            processes=2,
            checkpoint_every=EVERY,
            keep_checkpoints=10,
        )
        before = core.watch(run.id)
        await core.wait_episode(run.id, 12)
        await checkpointed(core, run.id, 10)

        await core.restart()
        seen = before.numbers()
        after = core.watch(run.id, after_episode=seen[-1])
        done = await core.wait_state(run.id, RunState.DONE, timeout=120.0)
        await after.ended()

        assert seen + after.numbers() == list(range(1, EPISODES + 1))
        assert (done.restarts, done.trainers, done.error_message) == (1, ("a:1", "b:1"), "")
        cancels = [x for x in core.connector.calls if isinstance(x, CancelCall)]
        assert {x.address for x in cancels} == {"a:1", "b:1"}
        # Nothing was re-attached: the new job started from the newest checkpoint the run had
        # published every episode of.
        assert all(c.attach_after is None for c in core.connector.trains(run.id))
        rank0 = new_jobs(core, run.id)[-2]
        assert rank0.resume_from[0] == max(e for e in range(EVERY, seen[-1] + 1, EVERY))


async def test_a_gateway_restart_without_a_checkpoint_ends_the_run_interrupted(
    tmp_path: Path,
) -> None:
    a, b = grpo_trainers("a:1", "b:1")
    async with running_core(a, b, db=str(tmp_path / "gateway.db")) as core:
        run = await core.create(max_episodes=EPISODES, kind="grpo", processes=2)
        await core.wait_episode(run.id, 8)
        await core.restart()
        failed = await core.wait_state(run.id, RunState.ERROR)
        assert failed.error_message == INTERRUPTED_MESSAGE
        await until(lambda: a.slots_free == b.slots_free == 1, "every share cancelled")
