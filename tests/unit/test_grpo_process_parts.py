"""The parts of process-per-job GRPO that need no model: the channel's messages, slots that are
devices, multi-slot jobs in the runner, how a failed job is described, a real rank process that
reports a bad job spec and takes its group down when the trainer goes away, and whole jobs
(``process.run``) of real rank processes whose training is scripted (``tests.fakes.grpo_rank``)."""

from __future__ import annotations

import base64
import json
import logging
import os
import pathlib
import signal
import threading
import types
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import pytest

from tests.fakes.grpo_rank import scripted_ranks
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.grpo_fixtures import make_job, tiny_grpo_task
from trainer_service.__main__ import parse_args
from trainer_service.config import TrainerConfig
from trainer_service.core.errors import InvalidRequest, NoFreeSlot
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.providers._device import slot_devices
from trainer_service.providers.grpo import launch, process, wire
from trainer_service.providers.grpo.ranks import Rank
from trainer_service.testing import FakeProvider, imitation_request
from trainwire.contract import StreamChecker, check_task
from trainwire.v1 import episode_pb2

pytestmark = pytest.mark.slow

__all__ = ["scripted_ranks"]  # the fixture, re-exported for pytest


# -- the channel -------------------------------------------------------------------------------


def test_messages_keep_their_kind_and_payload_and_oversized_ones_break_the_channel() -> None:
    trainer, rank_connection = wire.ChannelEnd.pair()
    rank = wire.ChannelEnd(rank_connection)
    assert rank.send_step(7)
    assert rank.send(wire.EPISODE, b"x" * 70_000)
    assert rank.send_json(wire.ERROR, {"kind": "crash"})
    assert rank.send(wire.BEAT)
    messages, closed = trainer.read_available()
    assert [kind for kind, _ in messages] == [wire.STEP, wire.EPISODE, wire.ERROR, wire.BEAT]
    assert wire.step_of(messages[0][1]) == 7 and messages[1][1] == b"x" * 70_000
    assert json.loads(messages[2][1]) == {"kind": "crash"} and messages[3][1] == b""
    assert not closed and trainer.read_available() == ([], False)
    # A message over the limit is a broken peer: the channel reports it and gives up.
    oversized = threading.Thread(target=rank.send, args=(wire.EPISODE, b"x" * wire.MAX_MESSAGE))
    oversized.start()
    assert trainer.recv() is None and trainer.failure
    trainer.close()
    oversized.join(TIMEOUT)
    assert not rank.send(wire.BEAT)  # the peer is gone: False, nothing raised
    rank.close()
    ours, theirs = wire.ChannelEnd.pair()
    wire.ChannelEnd(theirs).close()
    assert ours.recv() is None and ours.failure is None  # end of file
    assert ours.read_available() == ([], True)
    ours.close()


# -- slots are devices -------------------------------------------------------------------------


def test_a_job_takes_slots_on_distinct_gpus_all_or_none() -> None:
    pool = SlotPool(4, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])
    assert pool.most_per_job() == 2
    assert pool.try_acquire(3) is None and pool.free == 4
    first = pool.try_acquire(2)
    assert first == (0, 1)
    second = pool.try_acquire(1)
    assert second == (2,)
    assert pool.try_acquire(2) is None  # slot 3 is free, but one GPU is not two
    pool.release(first)
    assert pool.try_acquire(2) == (0, 1)
    with pytest.raises(RuntimeError):
        pool.release((3,))
    cpu = SlotPool(3, ["cpu"] * 3)
    assert cpu.most_per_job() == 3 and cpu.try_acquire(3) == (0, 1, 2)


def test_slots_auto_is_one_slot_without_a_gpu_and_a_count_keeps_working() -> None:
    assert parse_args(["--slots", "auto"]).slots == "auto"
    assert parse_args(["--slots", "3"]).slots == 3
    with pytest.raises(ValueError, match="slots"):
        TrainerConfig(slots="many")
    assert slot_devices("auto", "cpu", "cpu", "auto") == (("cpu",), "cpu")
    assert slot_devices("cpu", "cpu", "cpu", 2) == (("cpu", "cpu"), "cpu")


def test_num_processes_is_checked_with_the_task() -> None:
    def task(n: int) -> episode_pb2.TrainTask:
        return episode_pb2.TrainTask(
            grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d.jsonl", num_processes=n)
        )

    config = episode_pb2.TrainConfig(max_episodes=3)
    assert check_task(task(0), config) == [] and check_task(task(64), config) == []
    for bad in (-1, 65):
        assert [v.field for v in check_task(task(bad), config)] == ["task.grpo.num_processes"]


class _TwoSlotProvider(FakeProvider):
    def slots_needed(self, task: episode_pb2.TrainTask) -> int:
        del task
        return 2


def test_the_runner_gives_a_job_its_slots_and_devices_and_takes_them_back() -> None:
    provider = _TwoSlotProvider(hold_after=1)
    pool = SlotPool(3, ["cuda:0", "cuda:1", "cuda:2"])
    runner = JobRunner(ProviderRegistry({"imitation": provider}), pool, RunnerSettings())
    runner.start(imitation_request("run-two"))
    assert provider.started.wait(TIMEOUT)
    assert pool.free == 1
    assert provider.jobs[0].devices == ("cuda:0", "cuda:1")
    assert provider.jobs[0].device == "cuda:0"
    with pytest.raises(NoFreeSlot):
        runner.start(imitation_request("run-other"))
    runner.cancel_job("run-two")
    assert runner.wait_idle(TIMEOUT) and pool.free == 3
    # A job that needs more than this trainer can ever give is a bad request, not "busy".
    lone = JobRunner(ProviderRegistry({"imitation": provider}), SlotPool(2, ["cuda:0"] * 2))
    with pytest.raises(InvalidRequest, match="needs 2 slots"):
        lone.start(imitation_request("run-too-big"))


# -- how a failed job reads --------------------------------------------------------------------


def _group(*ranks: dict[str, Any]) -> process.JobProcesses:
    job = TrainJob(
        "run-d",
        episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(num_processes=len(ranks))),
        episode_pb2.TrainConfig(max_episodes=5),
        "cpu",
        pathlib.Path("."),
        None,
        threading.Event(),
    )
    group = process.JobProcesses(job, len(ranks))
    for i, fields in enumerate(ranks):
        popen: Any = types.SimpleNamespace(pid=1000 + i)
        group.ranks.append(Rank(i, popen, None, **fields))  # type: ignore[arg-type]
    return group


def _report(kind: str, message: str, at: float, **fields: str) -> dict[str, Any]:
    return {**wire.error_payload(kind, message, **fields), "at": at}


def test_a_killed_rank_is_the_cause_over_its_peers_reports() -> None:
    group = _group(
        {"error": _report("crash", "Connection closed by peer", 2.0), "failed_at": 2.0},
        {"exit_status": -signal.SIGKILL, "closed": True, "failed_at": 1.5},
    )
    error = group.diagnose()
    assert error.user_message == (
        "Training process rank 1 of 2 was killed (SIGKILL). If the machine ran out of memory, "
        "try a smaller batch_size or max_completion_length."
    )
    assert (error.reason, error.code) == ("PROCESS_DIED", "INTERNAL")
    segv = _group({"exit_status": -signal.SIGSEGV, "failed_at": 1.0}).diagnose()
    assert segv.user_message == "The training process crashed (SIGSEGV)."


def test_the_first_report_wins_and_provider_errors_pass_as_they_are() -> None:
    group = _group(
        {"error": _report("crash", "gloo: connection reset", 5.0, exception="RuntimeError")},
        {"error": _report("crash", "boom", 4.0, exception="ValueError"), "exit_status": 1},
    )
    error = group.diagnose()
    assert error.user_message == (
        "Training process rank 1 of 2 failed with ValueError; the trainer's log has the details."
    )
    oom = _group(
        {
            "error": _report(
                "provider",
                "The GPU ran out of memory; try a smaller batch_size or max_completion_length.",
                1.0,
                code="RESOURCE_EXHAUSTED",
                reason="OUT_OF_MEMORY",
            )
        }
    ).diagnose()
    assert (oom.code, oom.reason) == ("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY")
    assert oom.user_message.startswith("The GPU ran out of memory")
    quiet = _group({}, {"exit_status": 3, "failed_at": 1.0}).diagnose()
    assert quiet.user_message == "Training process rank 1 of 2 exited unexpectedly (exit code 3)."


# -- a real rank process -----------------------------------------------------------------------


@pytest.fixture
def rank_process() -> Iterator[tuple[BaseProcess, wire.ChannelEnd]]:
    """A rank process started as the trainer starts one (by its launcher, in a process group of
    its own), talking to this test over its channel."""
    proc, ours = launch.spawn_rank(launch.rank_env({}, 0, 1), None, 0)
    try:
        yield proc, ours
    finally:
        ours.close()
        proc.join(TIMEOUT)
        if proc.exitcode is None and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(TIMEOUT)


def _messages_until_end(channel: wire.ChannelEnd) -> list[tuple[bytes, bytes]]:
    out = []
    while (message := channel.recv()) is not None:
        out.append(message)
    return out


def test_a_rank_reports_a_bad_job_spec_as_a_crash_and_exits(
    rank_process: tuple[BaseProcess, wire.ChannelEnd],
) -> None:
    proc, channel = rank_process
    spec = {
        **{"run_id": "run-bad", "rank": 0, "world_size": 1, "device": "cpu"},
        **{"task": base64.b64encode(b"\xff\xff\xff").decode(), "config": "", "log": {}},
    }
    channel.send_json(wire.JOB, spec)
    received = _messages_until_end(channel)
    errors = [json.loads(payload) for kind, payload in received if kind == wire.ERROR]
    assert len(errors) == 1 and errors[0]["kind"] == "crash"
    assert errors[0]["exception"] == "DecodeError" and "Traceback" in errors[0]["detail"]
    proc.join(TIMEOUT)
    assert proc.exitcode == 1


def test_a_rank_takes_its_process_group_down_when_the_trainer_goes_away(
    rank_process: tuple[BaseProcess, wire.ChannelEnd],
) -> None:
    proc, channel = rank_process

    def beat_or_end() -> bool:
        message = channel.recv()
        return message is None or message[0] == wire.BEAT

    wait_for(beat_or_end, "a heartbeat from the rank")
    channel.close()  # what the trainer's death looks like from the rank
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL  # it killed its whole group, itself included


# -- whole jobs of scripted ranks --------------------------------------------------------------


def _scripted_job(steps: int, script: str = "", **job: Any) -> Any:
    task = tiny_grpo_task(model_path=f"scripted{script}", **job.pop("task", {}))
    return make_job(pathlib.Path("/nonexistent"), task, max_episodes=steps, **job)


def _ranks_left(module: str) -> list[psutil.Process]:
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if module in " ".join(child.cmdline()):
                left.append(child)
        except psutil.Error:
            continue
    return left


def _last_steps(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = [r.getMessage() for r in caplog.records if "last step of each rank" in r.getMessage()]
    return line.split("last step of each rank: ", 1)[1]


def test_a_two_rank_job_streams_every_step_and_reaps_its_ranks(
    scripted_ranks: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    phases: list[str] = []
    job = _scripted_job(4, task={"num_processes": 2}, set_phase=phases.append)
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    episodes = list(process.run(job))
    for episode in episodes:
        checker.check(episode)
    checker.finish()
    assert [(e.episode, e.reward) for e in episodes] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert episodes[-1].done
    assert _last_steps(caplog) == "{0: 4, 1: 4})"  # both ranks ran every step, no more
    assert "training" in phases  # rank 0's phases reach the job
    assert _ranks_left(scripted_ranks) == []


def test_a_failing_step_ends_the_stream_with_a_provider_error_and_no_rank_left(
    scripted_ranks: str,
) -> None:
    seen = []
    with pytest.raises(ProviderError) as info:
        for episode in process.run(_scripted_job(10, ":fail-at=3")):
            seen.append(episode.episode)
    assert seen == [1, 2]
    assert info.value.user_message == (
        "The training process failed with RuntimeError; the trainer's log has the details."
    )
    assert "boom" in info.value.detail and info.value.reason == "PROVIDER_FAILED"
    assert _ranks_left(scripted_ranks) == []
