"""Checkpoints through the trainer's gRPC surface, on a real in-process server (port 0) with the
real imitation provider and a directory store: checkpoint events on the wire, a park
(CancelJob with checkpoint on a job blocked at its grant), and a resume on a new job whose
episodes are those the uninterrupted run trains."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, wait_for
from trainer_service.testing import imitation_request
from trainwire.v1 import trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointStore

torch.set_num_threads(1)


@pytest.fixture
def trainer(tmp_path: pathlib.Path) -> Iterator[tuple[RunningTrainer, CheckpointStore]]:
    store = CheckpointStore(str(tmp_path / "store"))
    with running_trainer(
        {"imitation": "trainer_service.providers.imitation"},
        heartbeat_s=0.2,
        scratch_dir=tmp_path / "scratch",
    ) as running:
        running.runner.checkpoint_store = store
        yield running, store


def request(
    run_id: str, max_episodes: int, every: int, grant: int = 0
) -> trainer_service_pb2.TrainRequest:
    message = imitation_request(run_id, max_episodes=max_episodes, seed=7)
    message.config.checkpoint_every = every
    message.grant_through_episode = grant
    return message


def events_of(responses: object) -> list[tuple[str, Any]]:
    out = []
    for response in responses:  # type: ignore[attr-defined]
        kind = response.WhichOneof("event")
        if kind != "heartbeat":
            out.append((kind, getattr(response, kind)))
    return out


def test_checkpoint_events_on_the_wire(
    trainer: tuple[RunningTrainer, CheckpointStore],
) -> None:
    running, store = trainer
    events = events_of(running.stub.Train(request("run-a", 5, 2), timeout=JOB_TIMEOUT))
    assert [(k, v.episode) for k, v in events] == [
        ("episode", 1),
        ("episode", 2),
        ("checkpoint", 2),
        ("episode", 3),
        ("episode", 4),
        ("checkpoint", 4),
        ("episode", 5),
        ("checkpoint", 5),
    ]
    assert store.episodes("run-a") == [2, 4, 5]
    assert running.value("trainwire_trainer_checkpoints_written_total", kind="imitation") == 3


def test_park_then_resume_continues_the_run(
    trainer: tuple[RunningTrainer, CheckpointStore],
) -> None:
    running, store = trainer
    whole = [
        v
        for k, v in events_of(running.stub.Train(request("run-w", 12, 0), timeout=JOB_TIMEOUT))
        if k == "episode"
    ]

    call = running.stub.Train(request("run-p", 12, 0, grant=5), timeout=JOB_TIMEOUT)
    seen = []
    for response in call:
        if response.WhichOneof("event") == "episode":
            seen.append(response.episode)
        if len(seen) == 5:
            break
    job = running.runner.job("run-p")
    assert job is not None
    wait_for(lambda: job.phase == "waiting", "the job blocked at its grant")
    call.cancel()  # the gateway drops the stream first, then parks the job
    reply = running.stub.CancelJob(
        trainer_service_pb2.CancelJobRequest(run_id="run-p", checkpoint=True), timeout=TIMEOUT
    )
    assert reply.last_episode == 5
    assert reply.checkpoint.episode == 5 and not reply.checkpoint_error
    info = store.info("run-p", 5)
    assert info is not None and reply.checkpoint.sha256 == info.sha256

    resume = request("run-p", 12, 0)
    resume.resume_from.add(run_id="run-p", checkpoint=reply.checkpoint)
    events = events_of(running.stub.Train(resume, timeout=JOB_TIMEOUT))
    kind, resumed = events[0]
    assert kind == "resumed"
    assert resumed.checkpoint.checkpoint.episode == 5
    assert resumed.best_reward == seen[-1].best_reward
    after = [v for k, v in events if k == "episode"]
    assert [e.episode for e in after] == list(range(6, 13))
    # The same episodes as the run that was never parked (the episodes carry their time).
    for got, want in zip(after, whole[5:], strict=True):
        assert (got.reward, got.best_reward, dict(got.metrics)) == (
            want.reward,
            want.best_reward,
            dict(want.metrics),
        )


def test_cancel_without_checkpoint_stays_fast_and_unknown_jobs(
    trainer: tuple[RunningTrainer, CheckpointStore],
) -> None:
    running, store = trainer
    with pytest.raises(grpc.RpcError) as caught:
        running.stub.CancelJob(
            trainer_service_pb2.CancelJobRequest(run_id="nobody", checkpoint=True),
            timeout=TIMEOUT,
        )
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    call = running.stub.Train(request("run-c", 50, 0, grant=3), timeout=JOB_TIMEOUT)
    next(iter(call))
    reply = running.stub.CancelJob(
        trainer_service_pb2.CancelJobRequest(run_id="run-c"), timeout=TIMEOUT
    )
    assert not reply.HasField("checkpoint") and not reply.checkpoint_error
    call.cancel()
    assert running.runner.wait_idle(TIMEOUT)
    assert store.episodes("run-c") == []
