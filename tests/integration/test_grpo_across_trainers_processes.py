"""One GRPO job across trainer processes, driven by the gateway: what only processes show.

Three one-slot trainer processes on loopback (``python -m trainer_service``, gloo on the CPU,
the tiny VLM, one shared checkpoint directory) and the gateway in this process. A two-rank run
does not fit in any one trainer, so the gateway places it on two, all or none, rank 0 first in
``Run.trainers``. ``kill -9`` of the trainer that is not rank 0's stops the job everywhere
(every rank process of the job gone within 15 s, rank 0's too), and the run resumes from its
checkpoint once a trainer comes back (the third, started after the kill), streaming every
episode exactly once to DONE. A job bigger than every trainer together is refused at
``CreateRun``.

The decisions behind it (placement, all or none, restarts naming the lost trainer) are tested
in virtual time at the core's seams (``tests/core``); the trainer's side of a job across
trainers (rendezvous, relayed steps, rewards equal to one trainer's) in
``test_grpo_trainers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.fakes.gateway_harness import Client, collect, get_run, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.grpo_fixtures import DATASET_FILE, grpo_data_root, tiny_grpo_task
from trainwire.v1 import episode_pb2, gateway_service_pb2

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

pb = gateway_service_pb2
State = pb.Run.State
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: How long every process of a job may outlive the death of one of its trainers.
GONE_WITHIN_S = 15.0
STEPS = 12
EVERY = 3


def _flags(data_root: Path, store: Path) -> tuple[str, ...]:
    return (
        *("--data-root", str(data_root), "--checkpoint-store", str(store)),
        *("--heartbeat", "0.5", "--detach-grace", "60", "--rendezvous-host", "127.0.0.1"),
    )


def _free_port() -> int:
    """A port nothing listens on now: the trainer that comes back later takes it (the gateway
    must know its address from the start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ranks_of(trainer_pid: int) -> list[int]:
    """The pids of the rank processes a trainer started (each names its trainer on its command
    line)."""
    found = subprocess.run(
        [
            "pgrep",
            "-f",
            rf"trainer_service.providers.grpo.worker \(GRPO rank [0-9]+, trainer {trainer_pid}\)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return [int(pid) for pid in found.stdout.split()]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
    return alive


def _request(processes: int, steps: int = STEPS) -> pb.CreateRunRequest:
    task = tiny_grpo_task(dataset_path=DATASET_FILE, workers=0, num_processes=processes)
    return pb.CreateRunRequest(
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=5, checkpoint_every=EVERY),
        # Paced: the run is still training when the trainer is killed.
        episodes_per_second=2.0,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def two(
    grpo_data_root: Path, store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Two trainer processes of one slot each on the data root and the shared store: the
    module's tests share them (the refusal never reaches them), the kill -9 test, last, kills
    one."""
    flags = _flags(grpo_data_root, store)
    env = {"OMP_NUM_THREADS": "1"}
    logs = tmp_path_factory.mktemp("trainer-logs")
    with (
        trainer_process(logs / "t1.log", *flags, slots=1, env=env) as one,
        trainer_process(logs / "t2.log", *flags, slots=1, env=env) as other,
    ):
        yield [one, other]


async def test_a_job_bigger_than_every_trainer_together_is_refused(
    two: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    async with running_gateway(tuple(address for _, address in two)) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.stub.CreateRun(_request(3), timeout=TIMEOUT)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        message = info.value.details() or ""
        assert "num_processes" in message and "3" in message and "2" in message, message
    assert all(proc.poll() is None for proc, _ in two)


async def test_kill_9_of_a_trainer_stops_the_job_everywhere_and_it_resumes_on_another(
    two: list[tuple[subprocess.Popen[bytes], str]],
    grpo_data_root: Path,
    store: Path,
    tmp_path: Path,
) -> None:
    later = f"127.0.0.1:{_free_port()}"
    addresses = (two[0][1], two[1][1], later)
    pids = {address: proc.pid for proc, address in two}
    settings = {"heartbeat_timeout_s": 5.0, "schedule_poll_s": 0.2, "max_restarts": 2}
    async with running_gateway(addresses, **settings) as client:
        run = (await client.stub.CreateRun(_request(2), timeout=TIMEOUT)).run
        watching = asyncio.create_task(collect(client.stub, run.id, timeout=JOB_TIMEOUT * 3))

        async def checkpointed() -> pb.Run | None:
            got = await get_run(client.stub, run.id)
            return got if got.checkpoint_episode >= EVERY else None

        placed = await until(checkpointed, "a checkpoint of the run", JOB_TIMEOUT)
        assert placed.state == State.STATE_RUNNING
        assert list(placed.trainers) == [two[0][1], two[1][1]] or list(placed.trainers) == [
            two[1][1],
            two[0][1],
        ]
        assert placed.trainer == placed.trainers[0]
        leader, member = placed.trainers
        job_ranks = _ranks_of(pids[leader]) + _ranks_of(pids[member])
        assert len(job_ranks) == 2, job_ranks

        victim = next(proc for proc, address in two if address == member)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while _alive(job_ranks) and time.monotonic() - killed_at < GONE_WITHIN_S:
            await asyncio.sleep(0.1)
        assert _alive(job_ranks) == [], f"still running {GONE_WITHIN_S} s after kill -9"

        # No trainer pair has two free slots now: the run waits, saying for what.
        waiting = await until(
            lambda: _placing_again(client, run.id), "the run waiting to be placed again"
        )
        assert waiting.restarts == 1

        # A trainer comes back: the run continues from its checkpoint on it and rank 0's.
        flags = _flags(grpo_data_root, store)
        port = later.rsplit(":", 1)[1]
        log = tmp_path / "t3.log"
        with trainer_process(log, *flags, "--port", port, slots=1) as (_, address):
            assert address == later
            watched = await watching
        assert watched.finished is not None, "the stream ended without finished"
        assert watched.finished.state == State.STATE_DONE, watched.finished.error_message
        numbers = [episode.episode for episode in watched.episodes]
        assert numbers == list(range(1, STEPS + 1)), "every episode exactly once, in order"
        final = await get_run(client.stub, run.id)
        assert final.restarts == 1
        assert later in final.trainers and member not in final.trainers


async def _placing_again(client: Client, run_id: str) -> pb.Run | None:
    run = await get_run(client.stub, run_id)
    return run if run.restarts == 1 and "slot" in run.state_detail else None
