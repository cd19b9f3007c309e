"""How trainer failures end a run, in virtual time: heartbeats keep a slow trainer alive, a
silent or broken stream is re-attached after ``trainer_episode`` within the heartbeat timeout
and only then fails the run (one silent from its start, never started, is not re-attached),
a provider error is the user's message, a crash and a contract
violation read the gateway's messages (and cancel the job)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.core.feed import REATTACH_BACKOFF_S
from gateway.core.registry import Finished
from gateway.core.runs import CONTRACT_MESSAGE, LOST_MESSAGE, UNEXPECTED_MESSAGE, RunState
from gateway.core.trainers import (
    TrainerBrokeContract,
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
)
from tests.fakes.core_harness import running_core
from tests.fakes.memory_trainer import GrantCall, JobScript, MemoryTrainer
from tests.fakes.virtual_time import TICK, VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME

#: The pause between two re-attach attempts.
BACKOFF_S = REATTACH_BACKOFF_S


async def test_heartbeats_keep_a_trainer_alive_that_takes_longer_than_the_timeout() -> None:
    trainer = MemoryTrainer("t1", heartbeat_s=4.0)
    trainer.script(JobScript(episode_s=25.0))  # 2.5 heartbeat timeouts per episode
    async with running_core(trainer) as core:
        assert core.settings.heartbeat_timeout_s == 10.0
        run = await core.create(max_episodes=3)
        done = await core.wait_state(run.id, RunState.DONE, timeout=100.0)

        assert (done.episode, done.error_message) == (3, "")
        assert len(core.connector.trains(run.id)) == 1  # never re-attached
        assert trainer.heartbeats_sent >= 3 * (25 // 4)
        assert done.end_time > done.start_time


# A broken stream is noticed once the episodes received before the break are published (the
# publisher raises the reader's failure when the inbox is empty); the re-attach window of
# heartbeat_timeout_s starts then. The tests read that moment from a watcher.


async def test_a_silent_stream_is_re_attached_after_the_timeout_then_the_run_fails() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(silent_after=3))  # not even heartbeats after the third episode
    async with running_core(trainer) as core:
        timeout = core.settings.heartbeat_timeout_s
        run = await core.create(max_episodes=50)
        watch = core.watch(run.id)
        await watch.ended(timeout=60.0)
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, LOST_MESSAGE)
        assert failed.episode == 3
        assert watch.numbers() == [1, 2, 3]
        first, *reattaches = core.connector.trains(run.id)
        # The third episode came at once; a heartbeat timeout later the stream counts as lost
        # and is re-attached after the last episode received ...
        assert [c.attach_after for c in reattaches] == [3]
        assert reattaches[0].at == pytest.approx(first.at + timeout + BACKOFF_S, abs=TICK)
        # ... and stays silent: the run fails a timeout after the stream was lost.
        [(ended_at, _)] = watch.of(Finished)
        assert ended_at == pytest.approx(first.at + 2 * timeout + BACKOFF_S, abs=TICK)
        # A lost trainer's job is not cancelled: the trainer ends it after its detach grace.
        assert core.connector.cancels(run.id) == []


async def test_a_stream_silent_from_its_start_fails_the_run_after_the_timeout_unstarted() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(silent_after=0))  # no episode, not even a heartbeat
    async with running_core(trainer) as core:
        timeout = core.settings.heartbeat_timeout_s
        run = await core.create(max_episodes=50)
        watch = core.watch(run.id)
        await asyncio.sleep(timeout / 2)
        assert (await core.run(run.id)).state is RunState.PENDING  # a run starts on an answer
        await watch.ended(timeout=60.0)
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, LOST_MESSAGE)
        assert (failed.episode, failed.trainer_episode, watch.numbers()) == (0, 0, [])
        # Never started, so nothing to re-attach to: the one Train call is lost a timeout later.
        [train] = core.connector.trains(run.id)
        [(ended_at, _)] = watch.of(Finished)
        assert ended_at == pytest.approx(train.at + timeout, abs=TICK)


async def test_a_trainer_cut_off_is_re_attached_for_the_heartbeat_timeout_then_lost() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer, heartbeat_timeout_s=3.0) as core:
        timeout = core.settings.heartbeat_timeout_s
        run = await core.create(max_episodes=100)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 5)
        received = (await core.run(run.id)).trainer_episode
        trainer.kill(refuses=False)  # connections reset: the gateway cannot tell it is gone
        await watch.ended()
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, LOST_MESSAGE)
        # Everything received before the kill is published, once.
        assert watch.numbers() == list(range(1, received + 1))
        noticed = watch.at(received)
        reattaches = core.connector.trains(run.id)[1:]
        assert {c.attach_after for c in reattaches} == {received}
        # One attempt per backoff for the whole timeout, then the end.
        assert reattaches[0].at == pytest.approx(noticed + BACKOFF_S, abs=TICK)
        assert reattaches[-1].at <= noticed + timeout + BACKOFF_S
        assert len(reattaches) == pytest.approx(timeout / BACKOFF_S, abs=1)
        [(ended_at, _)] = watch.of(Finished)
        # (noticed: when the watcher got it, just after the stream's failure was raised)
        assert noticed + timeout - 0.01 <= ended_at <= noticed + timeout + 2 * BACKOFF_S


async def test_a_trainer_back_without_the_job_fails_the_run_at_the_first_re_attach() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=100)
        watch = core.watch(run.id)
        await core.wait_episode(run.id, 5)
        received = (await core.run(run.id)).trainer_episode
        trainer.kill()
        trainer.revive()  # a restarted trainer: it answers, without the job
        await watch.ended()
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, LOST_MESSAGE)
        [reattach] = core.connector.trains(run.id)[1:]
        assert reattach.attach_after == received
        [(ended_at, _)] = watch.of(Finished)
        # Not the whole heartbeat timeout: the trainer said the job is gone.
        assert ended_at == pytest.approx(reattach.at, abs=0.01)


async def test_a_stream_that_breaks_once_is_re_attached_and_nothing_is_lost_or_repeated() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(lose_stream_after=7))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=40)
        watch = core.watch(run.id)
        await watch.ended()
        done = await core.run(run.id)

        assert (done.state, done.episode) == (RunState.DONE, 40)
        assert watch.numbers() == list(range(1, 41))
        new, reattach = core.connector.trains(run.id)
        assert (new.attach_after, reattach.attach_after) == (None, 7)
        assert reattach.at == pytest.approx(watch.at(7) + BACKOFF_S, abs=TICK)
        assert core.connector.job(run.id).streams == 2


async def test_a_stream_that_breaks_while_paused_is_re_attached_while_paused() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=100)
        await core.wait_episode(run.id, 5)
        paused = await core.registry.pause(run.id)
        assert paused.trainer_episode > paused.episode  # episodes wait in the inbox
        trainer.blip()
        blipped = asyncio.get_running_loop().time()
        await asyncio.sleep(2 * core.settings.heartbeat_timeout_s)

        reattaches = core.connector.trains(run.id)[1:]
        assert reattaches, "no re-attach while the run is paused"
        assert reattaches[0].attach_after == paused.trainer_episode
        assert reattaches[0].at <= blipped + core.settings.heartbeat_timeout_s


async def test_a_grant_the_trainer_refuses_is_not_sent_again_back_to_back() -> None:
    trainer = MemoryTrainer("t1")
    async with running_core(trainer, heartbeat_timeout_s=3.0) as core:
        run = await core.create(max_episodes=100)
        await core.wait_episode(run.id, 5)
        published = (await core.run(run.id)).episode
        trainer.kill()
        loop = asyncio.get_running_loop()
        killed = loop.time()
        failed = await core.wait_state(run.id, RunState.ERROR)
        elapsed = loop.time() - killed

        grants = [c for c in core.connector.calls if isinstance(c, GrantCall) and c.at >= killed]
        # Episodes received before the kill are still published: a grant may follow each
        # commit, or come again after a pause (a second), never back to back (thousands of
        # refused grants before the driver waited). Plus the grant in flight at the kill and
        # one retry the last pause's rounding may add.
        assert len(grants) <= failed.episode - published + elapsed + 2, len(grants)


async def test_a_provider_error_ends_the_run_with_its_message_for_users() -> None:
    trainer = MemoryTrainer("t1")
    message = "The model does not fit in the GPU's memory; try a smaller batch."
    trainer.script(JobScript(fail_after=4, user_message=message))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=50)
        watch = core.watch(run.id)
        await watch.ended()
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, message)
        assert failed.episode == 4  # what came before the failure is published
        assert watch.numbers() == [1, 2, 3, 4]
        assert watch.finished is not None and watch.finished.error_message == message
        assert core.connector.cancels(run.id) == []  # the provider stopped on its own


@pytest.mark.parametrize(
    "rule",
    [
        "sequence",
        "finite",
        "metric_finite",
        "best_reward",
        "done",
        "detail_kind",
        "detail_size",
        "done_missing",
    ],
)
async def test_a_contract_violation_fails_the_run_before_the_bad_episode_is_published(
    rule: str, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(violate=rule, violate_at=3))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=6)
        watch = core.watch(run.id)
        with caplog.at_level(logging.ERROR, logger="gateway"):
            await watch.ended()
        failed = await core.run(run.id)

        assert (failed.state, failed.error_message) == (RunState.ERROR, CONTRACT_MESSAGE)
        good = 5 if rule == "done_missing" else 2  # the last episode, or the third, is bad
        assert watch.numbers() == list(range(1, good + 1))
        assert failed.episode == good
        # One log line names the run and the rule.
        [line] = [r.getMessage() for r in caplog.records if "CONTRACT VIOLATION" in r.getMessage()]
        checked = {"metric_finite": "finite", "done_missing": "done"}.get(rule, rule)
        assert line.startswith(f"CONTRACT VIOLATION run={run.id} rule={checked} ")
        # The failure is the gateway's call: the trainer's job would compute for nobody.
        await until(lambda: core.connector.cancels(run.id), "CancelJob after the violation")


@pytest.mark.parametrize(
    ("error", "message", "cancelled"),
    [
        (TrainerBrokeContract("t1: INTERNAL: CONTRACT_VIOLATION"), CONTRACT_MESSAGE, True),
        (TrainerCrashed("t1: UNKNOWN"), UNEXPECTED_MESSAGE, True),
        (TrainerBusy("t1: SLOTS_BUSY"), UNEXPECTED_MESSAGE, True),  # busy once it started
        (TrainerFailed("t1: FAILED_PRECONDITION", "The dataset file is missing."), None, False),
    ],
    ids=["trainer-contract", "crashed", "busy-mid-run", "provider"],
)
async def test_each_trainer_failure_mid_run_reads_its_message_and_cancels_as_it_should(
    error: TrainerError, message: str | None, cancelled: bool
) -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(error_after=3, error=error))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=20)
        failed = await core.wait_state(run.id, RunState.ERROR)
        expected = message if message is not None else getattr(error, "user_message", "")
        assert (failed.error_message, failed.episode) == (expected, 3)
        await asyncio.sleep(1.0)  # a CancelJob would have gone out by now
        assert bool(core.connector.cancels(run.id)) is cancelled


async def test_a_stream_that_ends_without_done_is_a_contract_violation() -> None:
    trainer = MemoryTrainer("t1")
    trainer.script(JobScript(end_after=5))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=20)
        failed = await core.wait_state(run.id, RunState.ERROR)
        assert (failed.error_message, failed.episode) == (CONTRACT_MESSAGE, 5)
