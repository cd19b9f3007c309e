"""One GRPO job whose ranks span two trainers (issue 24): rank 0's trainer announces the
rendezvous and streams every episode and checkpoint, the other trainer's share streams
heartbeats and ends OK, the rewards are those of the same job in one trainer, the job resumed
on both trainers from a checkpoint continues bit for bit, and a dead share fails rank 0's
stream within seconds and leaves no process behind.

Each trainer is a real server in this process on port 0 with one CPU slot; each job runs the
offline tiny VLM, one rank per trainer, under gloo over loopback.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, wait_for
from tests.grpo_fixtures import grpo_data_root, rank_in_title, tiny_grpo_task
from tests.integration.test_grpo_processes import _assert_gone, _job_processes, _ranks
from trainwire.contract import StreamChecker
from trainwire.errors import error_from_rpc
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointStore

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

STEPS = 4
#: The promise: every rank of the job stops this soon after any trainer of it dies.
STOPPED_S = 15.0


@contextlib.contextmanager
def _trainer(data_root: pathlib.Path, store: pathlib.Path, slots: int) -> Iterator[RunningTrainer]:
    with running_trainer(
        {"grpo": "trainer_service.providers.grpo"},
        slots=slots,
        warm_up=False,
        wait_idle=False,
        stop_wait=30,
        device="cpu",
        data_root=data_root,
        heartbeat_s=1.0,
        checkpoint_store=CheckpointStore(str(store)),
    ) as running:
        yield running
        assert running.runner.wait_idle(30)


@pytest.fixture(scope="module")
def two_trainers(
    grpo_data_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningTrainer, RunningTrainer]]:
    """Two trainers of one slot each, sharing one checkpoint store (as a job's trainers must)."""
    store = tmp_path_factory.mktemp("checkpoints")
    with (
        _trainer(grpo_data_root, store, slots=1) as first,
        _trainer(grpo_data_root, store, slots=1) as second,
    ):
        yield first, second
    _assert_gone(_job_processes(os.getpid()))


def _request(
    run_id: str,
    steps: int,
    placement: trainer_service_pb2.JobPlacement | None = None,
    *,
    checkpoint_every: int = 0,
    resume_from: trainer_service_pb2.CheckpointRef | None = None,
) -> trainer_service_pb2.TrainRequest:
    request = trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=tiny_grpo_task(workers=0, num_processes=2),
        config=episode_pb2.TrainConfig(
            max_episodes=steps, seed=5, checkpoint_every=checkpoint_every
        ),
    )
    if placement is not None:
        request.placement.CopyFrom(placement)
    if resume_from is not None:
        request.resume_from.append(resume_from)
    return request


def _placement(
    first_rank: int, rendezvous: str = "", world_size: int = 2
) -> trainer_service_pb2.JobPlacement:
    return trainer_service_pb2.JobPlacement(
        world_size=world_size, first_rank=first_rank, processes=1, rendezvous=rendezvous
    )


@dataclass
class _Share:
    """What another trainer's share of a job streamed, read in a thread of its own."""

    kinds: list[str] = field(default_factory=list)
    error: grpc.RpcError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def read(self, call: Iterator[trainer_service_pb2.TrainResponse]) -> None:
        try:
            for response in call:
                self.kinds.append(response.WhichOneof("event") or "")
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()


@dataclass
class _PlacedJob:
    """A job placed across two trainers, as its first trainer's stream showed it."""

    kinds: list[str]
    episodes: list[episode_pb2.Episode]
    checkpoints: list[episode_pb2.Checkpoint]
    share: _Share
    to_rendezvous_s: float
    to_first_episode_s: float


def _start_share(
    trainer: RunningTrainer, request: trainer_service_pb2.TrainRequest, share: _Share
) -> threading.Thread:
    call = trainer.stub.Train(request, timeout=JOB_TIMEOUT)
    reader = threading.Thread(target=share.read, args=(call,), daemon=True)
    reader.start()
    return reader


def _run_placed(
    trainers: tuple[RunningTrainer, RunningTrainer], run_id: str, steps: int, **fields: Any
) -> _PlacedJob:
    """Runs a job with rank 0 on the first trainer and rank 1 on the second, as the gateway
    does: the first's Train, its rendezvous, then the second's Train with it."""
    first, second = trainers
    request = _request(run_id, steps, _placement(0), **fields)
    checker = StreamChecker.for_task(request.task, request.config, request.run_id)
    kinds: list[str] = []
    episodes: list[episode_pb2.Episode] = []
    checkpoints: list[episode_pb2.Checkpoint] = []
    share = _Share()
    reader = None
    started = time.monotonic()
    to_rendezvous = to_first = 0.0
    for response in first.stub.Train(request, timeout=JOB_TIMEOUT):
        kind = response.WhichOneof("event") or ""
        kinds.append(kind)
        if kind == "rendezvous":
            to_rendezvous = time.monotonic() - started
            placement = _placement(1, response.rendezvous.address)
            reader = _start_share(second, _request(run_id, steps, placement, **fields), share)
        elif kind == "resumed":
            checker.resume(
                response.resumed.checkpoint.checkpoint.episode, response.resumed.best_reward
            )
        elif kind == "episode":
            to_first = to_first or time.monotonic() - started
            checker.check(response.episode)
            episodes.append(response.episode)
        elif kind == "checkpoint":
            checkpoints.append(response.checkpoint)
    checker.finish()
    assert reader is not None, kinds
    reader.join(JOB_TIMEOUT)
    return _PlacedJob(kinds, episodes, checkpoints, share, to_rendezvous, to_first)


@pytest.fixture(scope="module")
def placed_job(two_trainers: tuple[RunningTrainer, RunningTrainer]) -> _PlacedJob:
    """A STEPS-step job of two ranks, rank 0 on the first trainer and rank 1 on the second,
    with a checkpoint after every step."""
    return _run_placed(two_trainers, "run-placed", STEPS, checkpoint_every=1)


def test_a_job_placed_on_two_trainers_streams_every_episode_once_and_both_streams_end_ok(
    two_trainers: tuple[RunningTrainer, RunningTrainer], placed_job: _PlacedJob
) -> None:
    job = placed_job
    # The rendezvous before any episode; then every episode once, in order, to done.
    assert "rendezvous" in job.kinds
    assert job.kinds.index("rendezvous") < job.kinds.index("episode")
    assert [e.episode for e in job.episodes] == list(range(1, STEPS + 1))
    assert job.episodes[-1].done
    # Rank 0's trainer writes the checkpoints, one per step, into the store both share.
    assert [c.episode for c in job.checkpoints] == list(range(1, STEPS + 1))
    # The second trainer's share: heartbeats only, and its stream ended OK.
    assert job.share.done.is_set() and job.share.error is None
    assert set(job.share.kinds) <= {"heartbeat"}, job.share.kinds
    # One slot each, both free again.
    for trainer in two_trainers:
        wait_for(lambda t=trainer: t.capabilities().slots_free == 1, "the slot free again")
    print(
        f"two trainers: rendezvous after {job.to_rendezvous_s:.2f} s, first episode after "
        f"{job.to_first_episode_s:.2f} s"
    )


def test_its_rewards_are_those_of_the_same_job_in_one_trainer(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path, placed_job: _PlacedJob
) -> None:
    # Same seed, sampler and global batch: each rank draws its prompt from the same index
    # stream by its rank, and gloo reduces the same tensors in the same order whether its
    # peers are on one trainer or two, so the job computes the same numbers bit for bit.
    with _trainer(grpo_data_root, tmp_path / "checkpoints", slots=2) as trainer:
        request = _request("run-one-trainer", STEPS)
        started = time.monotonic()
        episodes: list[episode_pb2.Episode] = []
        to_first = 0.0
        for response in trainer.stub.Train(request, timeout=JOB_TIMEOUT):
            if response.WhichOneof("event") == "episode":
                to_first = to_first or time.monotonic() - started
                episodes.append(response.episode)
    print(
        f"one trainer: first episode after {to_first:.2f} s; two trainers: "
        f"{placed_job.to_first_episode_s:.2f} s"
    )

    def numbers(stream: list[episode_pb2.Episode]) -> list[tuple[float, float]]:
        return [(e.reward, e.metrics["loss"]) for e in stream]

    print("rewards:", [e.reward for e in episodes], [e.reward for e in placed_job.episodes])
    assert numbers(placed_job.episodes) == numbers(episodes)
    assert [list(e.grpo.sample_completions) for e in placed_job.episodes] == [
        list(e.grpo.sample_completions) for e in episodes
    ]


def test_the_job_resumed_on_both_trainers_continues_bit_for_bit(
    two_trainers: tuple[RunningTrainer, RunningTrainer], placed_job: _PlacedJob
) -> None:
    # Both trainers restore the checkpoint after step 2 from their store: rank 0 its model,
    # optimizer and RNG state, rank 1 its own RNG state; the job then trains steps 3 and 4 as
    # the uninterrupted one did.
    checkpoint = placed_job.checkpoints[1]
    ref = trainer_service_pb2.CheckpointRef(run_id="run-placed", checkpoint=checkpoint)
    resumed = _run_placed(two_trainers, "run-placed", STEPS, resume_from=ref)
    events = [k for k in resumed.kinds if k != "heartbeat"]
    assert events[:3] == ["resumed", "rendezvous", "episode"], events
    assert [k for k in resumed.share.kinds if k != "heartbeat"] == ["resumed"]
    assert resumed.share.error is None

    def numbers(stream: list[episode_pb2.Episode]) -> list[tuple[int, float, float, float]]:
        return [(e.episode, e.reward, e.best_reward, e.metrics["loss"]) for e in stream]

    assert numbers(resumed.episodes) == numbers(placed_job.episodes[2:])


def test_a_dead_share_fails_rank_0s_stream_within_seconds_and_leaves_no_process(
    two_trainers: tuple[RunningTrainer, RunningTrainer],
) -> None:
    first, second = two_trainers
    request = _request("run-killed", 500, _placement(0))
    call = first.stub.Train(request, timeout=JOB_TIMEOUT)
    share = _Share()
    for response in call:
        kind = response.WhichOneof("event")
        if kind == "rendezvous":
            placement = _placement(1, response.rendezvous.address)
            _start_share(second, _request(request.run_id, 500, placement), share)
        elif kind == "episode":
            break
    ranks = {rank_in_title(p): p for p in _ranks(os.getpid())}
    assert sorted(ranks) == [0, 1], ranks
    processes = _job_processes(os.getpid())
    # The second trainer's rank dies as it would with its trainer (its lifeline).
    os.kill(ranks[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    failed = time.monotonic() - killed
    error = error_from_rpc(info.value)
    assert error.reason == "PROCESS_DIED", error
    assert failed < STOPPED_S, failed
    assert share.done.wait(TIMEOUT) and share.error is not None
    assert error_from_rpc(share.error).reason == "PROCESS_DIED"
    gone = _assert_gone(processes, STOPPED_S)
    print(
        f"share killed: rank 0's stream failed after {failed:.2f} s ({error.localized_message}); "
        f"every process gone after {gone:.2f} s"
    )
    for trainer in two_trainers:
        wait_for(lambda t=trainer: t.capabilities().slots_free == 1, "the slot free again")


def test_rank_0s_processes_end_with_the_job_when_the_share_never_comes(
    two_trainers: tuple[RunningTrainer, RunningTrainer],
) -> None:
    first, _ = two_trainers
    call = first.stub.Train(_request("run-alone", 3, _placement(0)), timeout=TIMEOUT)
    for response in call:
        if response.WhichOneof("event") == "rendezvous":
            break
    # Rank 0 waits for the other trainer's rank, which never comes; a cancel ends it.
    wait_for(lambda: _ranks(os.getpid()), "rank 0 started")
    processes = _job_processes(os.getpid())
    first.stub.CancelJob(trainer_service_pb2.CancelJobRequest(run_id="run-alone"), timeout=TIMEOUT)
    _assert_gone(processes)
    call.cancel()
    wait_for(lambda: first.capabilities().slots_free == 1, "the slot free again")
