"""A dead trainer noticed in seconds, with real trainer processes (imitation on the CPU) sharing
a checkpoint directory and the gateway in-process (the rule: ``gateway.core.feed``; each case
in virtual time: ``tests/core/test_dead_trainers.py``):

- kill -9 of the trainer that runs a run: the broken stream and the refused connection, not the
  heartbeat timeout (60 s here), end the job, and the run goes on on the other trainer from its
  checkpoint (how fast, p50/p99 against the 5 s goal, is the chaos soak's figure:
  ``bench/chaos.py``; a timed test would fail on a loaded machine);
- SIGSTOP of that trainer: noticed by the heartbeat timeout, then the same; SIGCONT later
  changes nothing for the run;
- kill -9 and a new trainer process on the same port at once: the run restarts there with one
  new job (a re-attach never starts one).
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.gateway_harness import Client, WatchResult, absorb, get_run, running_gateway
from tests.fakes.gateway_harness import trainer_process as start_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State
TRAINER_FLAGS = ("--heartbeat", "0.5", "--detach-grace", "30")
#: Long, so that a restart long before it shows the fast path.
HEARTBEAT_TIMEOUT_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def trainers(store: Path, tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Two trainer processes of one slot each on the shared store."""
    flags = (*TRAINER_FLAGS, "--checkpoint-store", str(store))
    with (
        start_trainer(tmp_path / "t1.log", *flags, slots=1) as one,
        start_trainer(tmp_path / "t2.log", *flags, slots=1) as two,
    ):
        yield [one, two]


def _request(max_episodes: int, rate: float, every: int) -> pb.CreateRunRequest:
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
        ),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=3, checkpoint_every=every),
        episodes_per_second=rate,
    )


class Arrivals:
    """A watch of a run to its end, with when each episode arrived (monotonic seconds)."""

    def __init__(self, client: Client, run_id: str) -> None:
        self.seen = WatchResult()
        self.at: dict[int, float] = {}
        self.task = asyncio.create_task(self._watch(client, run_id))

    async def _watch(self, client: Client, run_id: str) -> None:
        call = client.stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=JOB_TIMEOUT)
        async for message in call:
            absorb(self.seen, message)
            now = time.monotonic()
            for episode in self.seen.episodes[len(self.at) :]:
                self.at[episode.episode] = now


async def _start(client: Client, request: pb.CreateRunRequest) -> tuple[str, Arrivals, float]:
    """Creates a run and watches it; returns its id, its watch and its job's start-up (from
    CreateRun to its first episode)."""
    created = time.monotonic()
    run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
    arrivals = Arrivals(client, run.id)
    await until(lambda: 1 in arrivals.at, f"run {run.id}: its first episode", JOB_TIMEOUT)
    return run.id, arrivals, arrivals.at[1] - created


async def _checkpointed(client: Client, run_id: str, episode: int) -> pb.Run:
    async def reached() -> pb.Run | None:
        run = await get_run(client.stub, run_id)
        return run if run.checkpoint_episode >= episode else None

    return await until(reached, f"run {run_id}: a checkpoint at {episode}", JOB_TIMEOUT)


async def test_kill_9_of_a_trainer_continues_the_run_on_the_other_within_seconds(
    trainers: list[tuple[subprocess.Popen[bytes], str]],
    store: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    addresses = tuple(address for _, address in trainers)
    async with running_gateway(
        addresses,
        checkpoint_store=str(store),
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        schedule_poll_s=0.2,
    ) as client:
        run_id, arrivals, startup = await _start(client, _request(400, 40.0, 20))
        running = await _checkpointed(client, run_id, 40)
        victim = next(proc for proc, address in trainers if address == running.trainer)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        received = (await get_run(client.stub, run_id)).trainer_episode
        await asyncio.wait_for(arrivals.task, JOB_TIMEOUT)

        done = arrivals.seen.finished
        assert done is not None and done.state == State.STATE_DONE, done
        assert (done.restarts, done.trainer != running.trainer) == (1, True)
        assert arrivals.seen.numbers == list(range(1, 401))
        # The first episode the restarted job trained (the ones up to ``received`` came from
        # the inbox or were trained again and dropped).
        recovery = arrivals.at[received + 1] - killed
        print(f"\nkill -9 -> first new episode {recovery:.2f} s (job start-up {startup:.2f} s)")
        # The fast path ended the job: the refused connection, long before the heartbeat.
        gone = f"trainer {running.trainer} refuses connections; its job is gone"
        assert any(gone in record.getMessage() for record in caplog.records), caplog.text
        assert recovery < HEARTBEAT_TIMEOUT_S / 2, (recovery, startup)


async def test_a_stopped_trainer_is_noticed_by_the_heartbeat_timeout(
    trainers: list[tuple[subprocess.Popen[bytes], str]], store: Path
) -> None:
    addresses = tuple(address for _, address in trainers)
    timeout = 4.0
    async with running_gateway(
        addresses, checkpoint_store=str(store), heartbeat_timeout_s=timeout, schedule_poll_s=0.2
    ) as client:
        run_id, arrivals, _ = await _start(client, _request(300, 40.0, 20))
        running = await _checkpointed(client, run_id, 40)
        victim = next(proc for proc, address in trainers if address == running.trainer)
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:

            async def moved() -> pb.Run | None:
                run = await get_run(client.stub, run_id)
                return run if run.restarts == 1 and run.trainer != running.trainer else None

            moved_run = await until(moved, f"run {run_id}: restarted elsewhere", JOB_TIMEOUT)
            assert moved_run.trainer != running.trainer
            assert time.monotonic() - stopped >= timeout
        finally:
            victim.send_signal(signal.SIGCONT)
        await asyncio.wait_for(arrivals.task, JOB_TIMEOUT)
        done = arrivals.seen.finished
        assert done is not None and done.state == State.STATE_DONE, done
        assert done.restarts == 1
        assert arrivals.seen.numbers == list(range(1, 301))


def _jobs_started(log: Path, run_id: str) -> int:
    return len(re.findall(rf"run {run_id}: \w+ job started", log.read_text()))


async def test_a_trainer_back_on_its_port_at_once_gets_one_new_job(
    store: Path, tmp_path: Path
) -> None:
    flags = (*TRAINER_FLAGS, "--checkpoint-store", str(store))
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with start_trainer(first_log, *flags, slots=2) as (proc, address):
        port = address.rsplit(":", 1)[1]
        async with running_gateway(
            (address,),
            checkpoint_store=str(store),
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            schedule_poll_s=0.2,
        ) as client:
            run_id, arrivals, _ = await _start(client, _request(300, 40.0, 20))
            await _checkpointed(client, run_id, 40)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = time.monotonic()
            with start_trainer(second_log, *flags, "--port", port, slots=2):
                await asyncio.wait_for(arrivals.task, JOB_TIMEOUT)
                elapsed = time.monotonic() - killed
            done = arrivals.seen.finished
            assert done is not None and done.state == State.STATE_DONE, done
            assert done.restarts == 1
            assert arrivals.seen.numbers == list(range(1, 301))
            assert _jobs_started(first_log, run_id) == 1
            assert _jobs_started(second_log, run_id) == 1
            assert elapsed < HEARTBEAT_TIMEOUT_S
