"""``SetHyperparameters`` on a real trainer server (port 0) running the real imitation provider:
the job's next optimizer step takes the new learning rate (the ``learning_rate`` metric changes
exactly at the episode after the one the job was held at), a re-attach carrying the changed task
is the same job, and the statuses: an unknown job, bad fields (named in ``BadRequest``), a job
that produced its last episode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2

from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import TIMEOUT, wait_for
from trainer_service.testing import imitation_request
from trainwire.contract import StreamChecker
from trainwire.v1 import trainer_service_pb2

torch.set_num_threads(1)


@pytest.fixture
def trainer() -> Iterator[RunningTrainer]:
    with running_trainer(
        {"imitation": "trainer_service.providers.imitation"}, detach_grace_s=30.0
    ) as running:
        yield running


def set_hyperparameters(
    trainer: RunningTrainer, **fields: Any
) -> tuple[trainer_service_pb2.SetHyperparametersResponse | None, grpc.StatusCode, str, Any]:
    """(response, code, details, trailing metadata) of one call."""
    request = trainer_service_pb2.SetHyperparametersRequest(**fields)
    try:
        response, call = trainer.stub.SetHyperparameters.with_call(request, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return None, exc.code(), exc.details(), exc.trailing_metadata()  # type: ignore[attr-defined]
    return response, call.code(), call.details(), call.trailing_metadata()


def details_of(metadata: Any, kind: Any) -> list[Any]:
    [value] = [v for k, v in metadata if k == "grpc-status-details-bin"]
    found = []
    for detail in status_pb2.Status.FromString(value).details:
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            found.append(message)
    return found


def test_the_step_after_the_change_trains_with_the_new_learning_rate(
    trainer: RunningTrainer,
) -> None:
    request = imitation_request(max_episodes=12)
    request.grant_through_episode = 4
    stream = trainer.stub.Train(request, timeout=TIMEOUT)
    first = [next(stream).episode for _ in range(4)]
    # Held at its grant: the job has produced episode 4 and waits before the step of 5.
    wait_for(lambda: trainer.runner.job("run-1").phase == "waiting", "the job waits")

    response, code, _, _ = set_hyperparameters(trainer, run_id="run-1", learning_rate=0.004)
    assert code is grpc.StatusCode.OK and response is not None
    assert (response.learning_rate, response.last_episode) == (0.004, 4)
    assert not response.HasField("temperature") and not response.HasField("beta")

    trainer.stub.Grant(
        trainer_service_pb2.GrantRequest(run_id="run-1", through_episode=12), timeout=TIMEOUT
    )
    rest = [m.episode for m in stream if m.HasField("episode")]
    checker = StreamChecker.for_task(request.task, request.config, "run-1")
    for episode in first + rest:
        checker.check(episode)
    checker.finish()
    assert [e.metrics["learning_rate"] for e in first + rest] == [0.03] * 4 + [0.004] * 8


def test_a_reattach_with_the_changed_task_is_the_same_job(trainer: RunningTrainer) -> None:
    request = imitation_request(max_episodes=6)
    request.grant_through_episode = 2
    stream = trainer.stub.Train(request, timeout=TIMEOUT)
    assert next(stream).episode.episode == 1
    set_hyperparameters(trainer, run_id="run-1", learning_rate=0.01)
    stream.cancel()  # the gateway restarted; it re-attaches with the run's task as it is now
    again = imitation_request(max_episodes=6)
    again.task.imitation.learning_rate = 0.01
    again.attach_after_episode = 1
    again.grant_through_episode = 6
    episodes = [
        m.episode for m in trainer.stub.Train(again, timeout=TIMEOUT) if m.HasField("episode")
    ]
    assert [e.episode for e in episodes] == [2, 3, 4, 5, 6]
    assert episodes[-1].metrics["learning_rate"] == 0.01


def test_statuses(trainer: RunningTrainer) -> None:
    _, code, details, metadata = set_hyperparameters(trainer, run_id="ghost", learning_rate=0.1)
    assert code is grpc.StatusCode.NOT_FOUND and "ghost" in details
    [info] = details_of(metadata, error_details_pb2.ErrorInfo)
    assert info.reason == "JOB_NOT_FOUND"

    request = imitation_request(max_episodes=3)
    request.grant_through_episode = 1
    stream = trainer.stub.Train(request, timeout=TIMEOUT)
    assert next(stream).episode.episode == 1
    for fields, field in (
        ({}, "(request)"),
        ({"learning_rate": 1.5}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"temperature": 0.5}, "temperature"),  # imitation has no temperature
        ({"beta": 0.0}, "beta"),
    ):
        _, code, details, metadata = set_hyperparameters(trainer, run_id="run-1", **fields)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "run-1" in details, fields
        [bad] = details_of(metadata, error_details_pb2.BadRequest)
        assert [v.field for v in bad.field_violations] == [field]
        [message] = details_of(metadata, error_details_pb2.LocalizedMessage)
        assert field in message.message

    trainer.stub.Grant(
        trainer_service_pb2.GrantRequest(run_id="run-1", through_episode=3), timeout=TIMEOUT
    )
    assert [m.episode.episode for m in stream if m.HasField("episode")] == [2, 3]
    # Its end went out; the job is kept for the detach grace, with no step left to change.
    _, code, details, metadata = set_hyperparameters(trainer, run_id="run-1", learning_rate=0.1)
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "episode 3" in details
    [info] = details_of(metadata, error_details_pb2.ErrorInfo)
    assert info.reason == "JOB_FINISHED"
