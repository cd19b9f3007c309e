"""GRPO jobs in process groups of their own (issue 14): a job on two processes, its determinism,
crash isolation, cancellation, and nothing left behind when the trainer is killed.

Every job here runs the offline tiny VLM on the CPU, two ranks under gloo, a few steps each. The
process table is read with psutil: a job's processes are the ranks below the trainer and every
member of their process group (fork servers, DataLoader workers, resource trackers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import psutil
import pytest

from tests.fakes.gateway_harness import trainer_process
from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, wait_for
from tests.grpo_fixtures import grpo_data_root, rank_in_title, tiny_grpo_task
from trainer_service.testing import imitation_request
from trainwire.contract import StreamChecker
from trainwire.errors import error_from_rpc
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from trainwire_ops.checkpoints import CheckpointStore

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

#: The promise: a job's processes are gone this soon after a cancel, a crash or a killed trainer.
GONE_S = 10.0


@pytest.fixture
def trainer(grpo_data_root: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[RunningTrainer]:
    """A trainer with three CPU slots: a two-process GRPO job and an imitation job fit."""
    with running_trainer(
        {
            "grpo": "trainer_service.providers.grpo",
            "imitation": "trainer_service.providers.imitation",
        },
        slots=3,
        warm_up=False,
        wait_idle=False,
        stop_wait=30,
        device="cpu",
        data_root=grpo_data_root,
        heartbeat_s=1.0,
        checkpoint_store=CheckpointStore(str(tmp_path / "checkpoints")),
    ) as running:
        yield running
        assert running.runner.wait_idle(30)
        _assert_gone(_job_processes(os.getpid()))


def _grpo_request(
    run_id: str, steps: int, *, workers: int = 0, seed: int = 5, checkpoint_every: int = 0
) -> trainer_service_pb2.TrainRequest:
    return trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=tiny_grpo_task(workers=workers, num_processes=2),
        config=episode_pb2.TrainConfig(
            max_episodes=steps, seed=seed, checkpoint_every=checkpoint_every
        ),
    )


def _ranks(root: int) -> list[psutil.Process]:
    """The GRPO ranks below process ``root``."""
    out = []
    for process in psutil.Process(root).children(recursive=True):
        try:
            if rank_in_title(process) is not None:
                out.append(process)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def _job_processes(root: int) -> list[psutil.Process]:
    """Every process of the GRPO jobs below ``root``: its descendants from the ranks down, and
    every other member of the ranks' process groups."""
    ranks = _ranks(root)
    groups = set()
    found: dict[int, psutil.Process] = {}
    for rank in ranks:
        try:
            groups.add(os.getpgid(rank.pid))
            found[rank.pid] = rank
            for child in rank.children(recursive=True):
                found[child.pid] = child
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in groups:
                found.setdefault(process.pid, process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return list(found.values())


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_gone(processes: list[psutil.Process], within: float = GONE_S) -> float:
    """Waits (``wait_for``) until none of ``processes`` is alive; returns how long that took."""
    start = time.monotonic()
    try:
        wait_for(lambda: not any(_alive(p) for p in processes), "the job's processes gone", within)
    except AssertionError:
        left = [p for p in processes if _alive(p)]
        described = [(p.pid, p.name()) for p in left if _alive(p)]
        for process in left:  # never leave them behind, whatever the outcome
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        pytest.fail(f"still alive {within:g} s later: {described}")
    return time.monotonic() - start


def _wait_free(trainer: RunningTrainer, slots: int) -> float:
    """Waits (``wait_for``) until ``slots`` slots are free; returns how long that took."""
    start = time.monotonic()
    wait_for(lambda: trainer.capabilities().slots_free == slots, f"{slots} free slots")
    return time.monotonic() - start


def _first_episode(call: Iterator[trainer_service_pb2.TrainResponse]) -> episode_pb2.Episode:
    for response in call:
        if response.WhichOneof("event") == "episode":
            return response.episode
    raise AssertionError("the stream ended without an episode")


def test_a_two_process_job_streams_to_the_end_and_resumes_from_its_checkpoint(
    trainer: RunningTrainer,
) -> None:
    # The same job twice: from scratch (a checkpoint after every step), then from its
    # checkpoint after step 1, in the same run (as the gateway restarts a run) on the wire.
    request = _grpo_request("run-two", steps=4, checkpoint_every=1)
    runs = []
    for attempt in range(2):
        checker = StreamChecker.for_task(request.task, request.config, request.run_id)
        episodes: list[episode_pb2.Episode] = []
        checkpoints: list[episode_pb2.Checkpoint] = []
        resumed: list[trainer_service_pb2.Resumed] = []
        ranks: list[psutil.Process] = []
        for response in trainer.stub.Train(request, timeout=JOB_TIMEOUT):
            kind = response.WhichOneof("event")
            if kind == "episode":
                checker.check(response.episode)
                episodes.append(response.episode)
                ranks = ranks or _ranks(os.getpid())
            elif kind == "checkpoint":
                checkpoints.append(response.checkpoint)
            elif kind == "resumed":
                assert not episodes, "resumed came after an episode"
                resumed.append(response.resumed)
                checker.resume(1, response.resumed.best_reward)
        checker.finish()
        assert len(ranks) == 2, "the job did not run on two processes"
        assert episodes[-1].episode == 4 and episodes[-1].done
        runs.append(
            [(e.reward, e.metrics["loss"], tuple(e.grpo.sample_completions)) for e in episodes]
        )
        assert trainer.runner.wait_idle(30)
        assert trainer.capabilities().slots_free == 3
        if attempt == 0:
            assert [e.episode for e in episodes] == [1, 2, 3, 4] and not resumed
            assert [c.episode for c in checkpoints] == [1, 2, 3, 4]
            request.resume_from.add(run_id=request.run_id, checkpoint=checkpoints[0])
        else:
            [restored] = resumed
            assert restored.checkpoint.checkpoint.episode == 1 and not restored.skipped
            assert [e.episode for e in episodes] == [2, 3, 4]
    # Both ranks sample (one prompt each) and the reward is gathered over both; the resumed
    # job, each rank on its own RNG state, gives the same steps: equal index streams, sampling
    # and collectives on every rank, and every rank's state restored.
    assert runs[1] == runs[0][1:]
    assert len({c for _, _, completions in runs[0] for c in completions}) >= 4


def test_a_killed_rank_ends_its_run_clearly_and_frees_both_slots_while_another_job_goes_on(
    trainer: RunningTrainer,
) -> None:
    # An imitation job, held at its grant, shares the trainer with the GRPO job.
    side = imitation_request("run-side", max_episodes=30)
    side.grant_through_episode = 5
    side_events: list[trainer_service_pb2.TrainResponse] = []
    side_call = trainer.stub.Train(side, timeout=JOB_TIMEOUT)
    reader = threading.Thread(target=lambda: side_events.extend(side_call), daemon=True)
    reader.start()
    call = trainer.stub.Train(_grpo_request("run-crash", steps=500), timeout=JOB_TIMEOUT)
    _first_episode(call)
    ranks = _ranks(os.getpid())
    doomed = [r for r in ranks if rank_in_title(r) == 1]
    assert len(ranks) == 2 and len(doomed) == 1
    job = _job_processes(os.getpid())
    os.kill(doomed[0].pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    error = error_from_rpc(info.value)
    assert error.localized_message == (
        "Training process rank 1 of 2 was killed (SIGKILL). If the machine ran out of memory, "
        "try a smaller batch_size or max_completion_length."
    )
    assert error.reason == "PROCESS_DIED"
    _wait_free(trainer, 2)  # both of its slots; the imitation job holds the third
    _assert_gone(job)
    # The other job never noticed: it goes on from its grant to its end.
    trainer.stub.Grant(
        trainer_service_pb2.GrantRequest(run_id="run-side", through_episode=30),
        timeout=TIMEOUT,
    )
    reader.join(JOB_TIMEOUT)
    episodes = [e.episode for e in side_events if e.WhichOneof("event") == "episode"]
    assert [e.episode for e in episodes] == list(range(1, 31)) and episodes[-1].done
    _wait_free(trainer, 3)


def test_cancel_stops_every_rank_within_one_step_and_frees_the_slots(
    trainer: RunningTrainer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    call = trainer.stub.Train(_grpo_request("run-cancel", steps=500), timeout=JOB_TIMEOUT)
    _first_episode(call)
    job = trainer.runner.job("run-cancel")
    assert job is not None
    processes = _job_processes(os.getpid())
    start = time.monotonic()
    trainer.stub.CancelJob(
        trainer_service_pb2.CancelJobRequest(run_id="run-cancel"), timeout=TIMEOUT
    )
    freed = _wait_free(trainer, 3)
    gone = _assert_gone(processes)
    took = time.monotonic() - start
    call.cancel()
    # Each rank reports the last step it finished: the steps the trainer took, plus at most the
    # one in flight when the stop came, and the same on every rank.
    ended = [r.getMessage() for r in caplog.records if "last step of each rank" in r.getMessage()]
    line = ended[0]
    steps = {int(s) for s in re.findall(r": (\d+)", line.split("each rank:", 1)[1])}
    assert len(steps) == 1, line
    assert job.produced <= steps.pop() <= job.produced + 1, (line, job.produced)
    assert job.produced < 500
    print(f"cancel: slots free after {freed:.2f} s, every process gone after {took:.2f} s")
    assert gone < GONE_S


def _scratch_of(pid: int, base: pathlib.Path) -> pathlib.Path:
    """The scratch directory of the trainer ``pid`` (exactly one)."""
    (own,) = base.glob(f"trainer-{pid}-*")
    return own


def test_kill_9_of_the_trainer_leaves_no_process_of_the_job(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    log = tmp_path / "trainer.log"
    # The trainers' TMPDIR, where their scratch goes: short, for multiprocessing's sockets in
    # it (a Unix socket's path has at most 107 bytes; tmp_path under xdist is too deep).
    temporary = pathlib.Path(tempfile.mkdtemp(prefix="tw-kill-"))
    env = {"TMPDIR": str(temporary)}
    processes: list[psutil.Process] = []
    try:
        with (
            trainer_process(log, "--data-root", str(grpo_data_root), slots=2, env=env) as (
                proc,
                address,
            ),
            grpc.insecure_channel(address) as channel,
        ):
            # One DataLoader worker per rank, forked from it and named after it.
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            call = stub.Train(_grpo_request("run-kill", steps=500, workers=1), timeout=JOB_TIMEOUT)
            _first_episode(call)
            _first_episode(call)
            processes = _job_processes(proc.pid)
            names = [" ".join(p.cmdline()) for p in processes]
            ranks = _ranks(proc.pid)
            assert sorted(rank_in_title(r) for r in ranks) == [0, 1], names
            for rank in ranks:
                title = f"GRPO rank {rank_in_title(rank)}, DataLoader worker 0, trainer {proc.pid}"
                workers = [c for c in rank.children() if title in " ".join(c.cmdline())]
                assert len(workers) == 1, names
            assert not any("forkserver" in n for n in names), names
            proc.kill()
            proc.wait()
            took = _assert_gone(processes)
            call.cancel()
        print(f"kill -9 of the trainer: every process of the job gone after {took:.2f} s")
        # The job's folder (its ranks' output) lies in its trainer's scratch directory, not
        # beside it (where multiprocessing's pymp-* sockets and torch's caches go).
        base = temporary / "trainwire-scratch"
        assert not [p.name for p in temporary.iterdir() if p.name.startswith("grpo-")]
        left = _scratch_of(proc.pid, base)
        assert sorted(p.name.split("-")[0] for p in left.iterdir()) == ["grpo", "lock"]
        # The next trainer on the machine sweeps it; its own goes when it stops.
        with trainer_process(log, "--data-root", str(grpo_data_root), env=env) as (again, _):
            assert not left.exists()
            assert list(base.iterdir()) == [_scratch_of(again.pid, base)]
            again.send_signal(signal.SIGTERM)
            assert again.wait(timeout=TIMEOUT) == 0
        assert list(base.iterdir()) == []
        assert f"removed the scratch directory {left} of a trainer that is gone" in log.read_text()
    finally:
        for process in processes:
            if _alive(process):
                process.kill()
        shutil.rmtree(temporary, ignore_errors=True)
