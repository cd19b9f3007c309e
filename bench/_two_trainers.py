"""One GRPO job across two trainer processes, as the gateway runs it, for the benchmarks.

:func:`across_trainers` starts two ``python -m trainer_service`` processes of one slot each
(``--rendezvous-host 127.0.0.1``), calls ``Train`` on the first with ``placement`` rank 0 of 2,
reads the rendezvous it announces, calls ``Train`` on the second with ``placement`` rank 1 of 2
at that address, and returns when each of rank 0's episodes arrived. Used by
``bench/grpo_process.py`` (CPU, gloo) and ``bench/gpu_grpo.sh`` (one GPU per trainer, NCCL).

It needs nothing from the tests: only the repository's packages, grpc and a data root holding
the task's model and dataset.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import grpc

from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"trainer listening on (\S+:\d+)\n")


def _python_path() -> str:
    """The repository and the client package, then this process's path (on a GPU machine the
    packages ``bench/gpu_check.sh`` installed from carried wheels)."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


@contextlib.contextmanager
def trainer(
    data_root: pathlib.Path, device: str, env: Mapping[str, str], log: pathlib.Path
) -> Iterator[str]:
    """A trainer process of one slot; yields its address once it listens."""
    store = tempfile.mkdtemp(prefix="bench-checkpoints-")
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "trainer_service", "--port", "0", "--slots", "1"),
                *("--device", device, "--data-root", str(data_root)),
                *("--rendezvous-host", "127.0.0.1", "--checkpoint-store", store),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": _python_path(), **env},
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        match = _LISTENING.fullmatch(line)
        if match is None:
            raise RuntimeError(f"trainer did not start ({line!r}); see {log}")
        yield match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def across_trainers(
    data_root: pathlib.Path,
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig,
    devices: Sequence[tuple[str, Mapping[str, str]]],
    logs: pathlib.Path,
    timeout: float = 900.0,
) -> tuple[float, list[float]]:
    """Runs ``task`` (its ``num_processes`` = ``len(devices)``) with one rank on each of
    ``len(devices)`` trainers; returns (the ``perf_counter`` when the first ``Train`` call
    went out, when each episode arrived). ``devices``: each trainer's ``--device`` and extra
    environment (e.g. ``CUDA_VISIBLE_DEVICES``). Trainer start-up is not counted: a trainer is a
    service that is up before a job comes.
    """
    world = len(devices)
    task = episode_pb2.TrainTask.FromString(task.SerializeToString())
    task.grpo.num_processes = world
    run_id = f"bench-across-{world}"
    with contextlib.ExitStack() as stack:
        addresses = [
            stack.enter_context(trainer(data_root, device, env, logs / f"trainer{i}.log"))
            for i, (device, env) in enumerate(devices)
        ]
        channels = [stack.enter_context(grpc.insecure_channel(a)) for a in addresses]
        stubs = [trainer_service_pb2_grpc.TrainerServiceStub(c) for c in channels]
        for stub in stubs:  # each trainer is up and answers before the clock starts
            stub.GetCapabilities(trainer_service_pb2.GetCapabilitiesRequest(), timeout=60)
        checker = StreamChecker.for_task(task, config, run_id)
        failures: list[BaseException] = []

        def share(rank: int, address: str) -> None:
            placement = trainer_service_pb2.JobPlacement(
                world_size=world, first_rank=rank, processes=1, rendezvous=address
            )
            request = trainer_service_pb2.TrainRequest(
                run_id=run_id, task=task, config=config, placement=placement
            )
            try:
                for response in stubs[rank].Train(request, timeout=timeout):
                    if response.WhichOneof("event") == "episode":
                        raise RuntimeError(f"rank {rank}'s trainer sent an episode")
            except BaseException as exc:  # reported by the caller
                failures.append(exc)

        placement = trainer_service_pb2.JobPlacement(world_size=world, first_rank=0, processes=1)
        request = trainer_service_pb2.TrainRequest(
            run_id=run_id, task=task, config=config, placement=placement
        )
        started = time.perf_counter()
        stamps: list[float] = []
        others: list[threading.Thread] = []
        for response in stubs[0].Train(request, timeout=timeout):
            event = response.WhichOneof("event")
            if event == "rendezvous":
                for rank in range(1, world):
                    thread = threading.Thread(
                        target=share, args=(rank, response.rendezvous.address), daemon=True
                    )
                    thread.start()
                    others.append(thread)
            elif event == "episode":
                stamps.append(time.perf_counter())
                checker.check(response.episode)
        checker.finish()
        for thread in others:
            thread.join(timeout=120)
        if failures:
            raise RuntimeError(f"a share failed: {failures[0]}") from failures[0]
        return started, stamps
