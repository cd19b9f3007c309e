"""GRPO runs through the gateway on the GPU: a parked run gives its GPU back and resumes, and a
run whose trainer is killed (``kill -9``) finishes on a second trainer process on the same GPU.

The trainers are real processes on ``cuda:0`` sharing a checkpoint directory; the gateway runs
in this process. A parked run's job ends (a final checkpoint, then its processes are killed and
reaped), so while it is parked its ranks are gone and the GPU memory they held is back: read
with ``nvidia-smi``, which also lists no process of the job (in a container it may list no
process at all; the memory it reads is the check that holds everywhere). The episodes the job
reported carry the peak of its own allocator (``gpu_memory_peak_gib``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.fakes.gateway_harness import collect, get_run, running_gateway
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until, wait_for
from tests.gpu.harness import (
    COLOURS_FILE,
    MODEL_DIR,
    alive,
    gpu_memory_used_mib,
    gpu_process_ids,
    gpu_trainer,
    job_device,
    rank_processes,
)
from tests.grpo_fixtures import tiny_grpo_task
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

pb = gateway_service_pb2
State = pb.Run.State
TRAINER_FLAGS = ("--heartbeat", "0.5", "--detach-grace", "60")
GATEWAY: dict[str, Any] = {"heartbeat_timeout_s": 5.0, "schedule_poll_s": 0.2}
EPISODES = 40
#: Paced, so the run is still training when the test pauses it or kills its trainer.
RATE = 10.0
#: What a CUDA context and the tiny model's job take at least (a context alone is ~500 MiB).
JOB_MIB = 200
#: GPU memory a parked run may leave in use over what was in use before it started.
LEFT_MIB = 64
TASK = tiny_grpo_task(MODEL_DIR, COLOURS_FILE, num_generations=4, max_completion_length=8)


def _request(checkpoint_every: int) -> gateway_service_pb2.CreateRunRequest:
    return pb.CreateRunRequest(
        task=TASK,
        config=episode_pb2.TrainConfig(
            max_episodes=EPISODES, seed=6, checkpoint_every=checkpoint_every
        ),
        episodes_per_second=RATE,
    )


@dataclasses.dataclass
class Parking:
    """What one park and resume of a run showed."""

    device: str
    finished: gateway_service_pb2.Run
    episodes: list[episode_pb2.Episode]
    parked: gateway_service_pb2.Run
    ranks_running: list[psutil.Process]
    ranks_resumed: list[psutil.Process]
    gone_while_parked: bool
    used_before: int = 0  #: MiB in use on the GPU before the run started
    used_running: int = 0
    used_parked: int = 0
    listed_parked: set[int] = dataclasses.field(default_factory=set)


def _gpu_used(device: str) -> int:
    return gpu_memory_used_mib() if device.startswith("cuda") else 0


async def _park_and_resume(device: str, root: pathlib.Path, where: pathlib.Path) -> Parking:
    store = where / "checkpoints"
    with gpu_trainer(where / "t.log", device, root, store, *TRAINER_FLAGS) as (proc, address):
        async with running_gateway(
            (address,), checkpoint_store=str(store), park_after_s=1.0, **GATEWAY
        ) as client:
            used_before = _gpu_used(device)
            run = (await client.stub.CreateRun(_request(0), timeout=TIMEOUT)).run
            watch = asyncio.create_task(collect(client.stub, run.id, timeout=JOB_TIMEOUT))

            async def reached(episode: int) -> gateway_service_pb2.Run | None:
                now = await get_run(client.stub, run.id)
                return now if now.episode >= episode else None

            await until(lambda: reached(5), "5 episodes published", JOB_TIMEOUT)
            ranks_running = rank_processes(proc.pid)
            used_running = _gpu_used(device)
            await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)

            async def is_parked() -> gateway_service_pb2.Run | None:
                now = await get_run(client.stub, run.id)
                return now if now.parked else None

            parked = await until(is_parked, f"run {run.id} parked", JOB_TIMEOUT)
            gone = await until(
                lambda: not any(alive(p) for p in ranks_running), "the job's ranks gone"
            )
            used_parked = _gpu_used(device)
            if device.startswith("cuda"):  # the driver may take a moment to count it freed
                deadline = time.monotonic() + TIMEOUT
                while used_parked > used_before + LEFT_MIB and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    used_parked = _gpu_used(device)
            listed = gpu_process_ids() if device.startswith("cuda") else set()

            await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
            await until(lambda: reached(parked.episode + 2), "training again", JOB_TIMEOUT)
            ranks_resumed = rank_processes(proc.pid)
            watched = await watch
    assert watched.finished is not None
    return Parking(
        device,
        watched.finished,
        watched.episodes,
        parked,
        ranks_running,
        ranks_resumed,
        gone,
        used_before,
        used_running,
        used_parked,
        listed,
    )


@pytest.fixture(scope="module")
def parking(
    gpu_data_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Parking]:
    """One run parked and resumed on the GPU (on the CPU under TRAINWIRE_GPU_TESTS_ON_CPU=1)."""
    device = job_device()
    if device is None:
        pytest.skip("needs a CUDA GPU")
    where = tmp_path_factory.mktemp("gpu-park")
    yield asyncio.run(_park_and_resume(device, gpu_data_root, where))


def test_a_parked_run_ends_its_job_processes_and_resumes_exactly_once(
    device: str, parking: Parking
) -> None:
    assert len(parking.ranks_running) == 1
    assert parking.gone_while_parked
    assert parking.parked.checkpoint_episode == parking.parked.trainer_episode
    assert parking.parked.episode < EPISODES
    # Resumed in new processes, from the checkpoint: every episode once, no restart.
    assert parking.ranks_resumed and not {p.pid for p in parking.ranks_resumed} & {
        p.pid for p in parking.ranks_running
    }
    assert parking.finished.state == State.STATE_DONE
    assert (parking.finished.parked, parking.finished.restarts) == (False, 0)
    assert [e.episode for e in parking.episodes] == list(range(1, EPISODES + 1))


def test_a_parked_run_gives_its_gpu_memory_back(cuda: str, parking: Parking) -> None:
    assert parking.used_running >= parking.used_before + JOB_MIB, parking
    assert parking.used_parked <= parking.used_before + LEFT_MIB, parking
    assert not {p.pid for p in parking.ranks_running} & parking.listed_parked
    peaks = [e.metrics["gpu_memory_peak_gib"] for e in parking.episodes]
    assert all(peak > 0 for peak in peaks), peaks


async def test_kill_9_of_the_trainer_finishes_the_run_on_a_second_trainer_on_the_same_gpu(
    device: str, gpu_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    store = tmp_path / "checkpoints"
    with (
        gpu_trainer(tmp_path / "t1.log", device, gpu_data_root, store, *TRAINER_FLAGS) as one,
        gpu_trainer(tmp_path / "t2.log", device, gpu_data_root, store, *TRAINER_FLAGS) as two,
    ):
        trainers: list[tuple[subprocess.Popen[bytes], str]] = [one, two]
        addresses = tuple(address for _, address in trainers)
        async with running_gateway(addresses, checkpoint_store=str(store), **GATEWAY) as client:
            run = (await client.stub.CreateRun(_request(5), timeout=TIMEOUT)).run
            watch = asyncio.create_task(collect(client.stub, run.id, timeout=JOB_TIMEOUT))

            async def checkpointed() -> gateway_service_pb2.Run | None:
                now = await get_run(client.stub, run.id)
                return now if now.checkpoint_episode >= 10 and now.episode >= 12 else None

            running = await until(checkpointed, "a checkpoint at episode 10", JOB_TIMEOUT)
            victim = next(proc for proc, address in trainers if address == running.trainer)
            ranks = rank_processes(victim.pid)
            assert ranks, "the run's trainer has no job process"
            victim.kill()
            watched = await watch
    done = watched.finished
    assert done is not None and done.state == State.STATE_DONE, done
    assert done.restarts == 1
    assert done.trainer != running.trainer
    assert [e.episode for e in watched.episodes] == list(range(1, EPISODES + 1))
    best = [e.best_reward for e in watched.episodes]
    assert best == sorted(best)
    # The killed trainer's job died with it (its ranks follow their trainer).
    wait_for(lambda: not any(alive(p) for p in ranks), "the killed trainer's ranks gone")
