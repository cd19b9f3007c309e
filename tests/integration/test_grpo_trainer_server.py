"""The real trainer server runs grpo tasks on the tiny VLM: streaming, contract, done, cancel,
and a provider error from the job's process."""

from __future__ import annotations

import logging
import pathlib
import re
import threading
from collections.abc import Iterator

import grpc
import pytest

from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.grpo_fixtures import grpo_data_root, tiny_grpo_task
from trainwire.contract import StreamChecker
from trainwire.errors import error_from_rpc
from trainwire.v1 import (
    episode_pb2,
    trainer_service_pb2,
)

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest


@pytest.fixture
def trainer(grpo_data_root: pathlib.Path) -> Iterator[RunningTrainer]:
    with running_trainer(
        {"grpo": "trainer_service.providers.grpo"},
        warm_up=False,
        wait_idle=False,
        stop_wait=TIMEOUT,
        device="cpu",
        data_root=grpo_data_root,
        heartbeat_s=1.0,
    ) as running:
        yield running
        running.runner.wait_idle(TIMEOUT)


def _request(run_id: str, max_episodes: int) -> trainer_service_pb2.TrainRequest:
    # Rows decoded in the rank: DataLoader workers (a fork server of their own per job, ~2 CPU-s)
    # are test_grpo_provider.py's subject, and test_end_to_end.py streams a run with them.
    return trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=tiny_grpo_task(workers=0),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=5),
    )


def test_grpo_run_streams_checked_episodes_to_done(trainer: RunningTrainer) -> None:
    request = _request("run-grpo-stream", max_episodes=3)
    checker = StreamChecker.for_task(request.task, request.config, request.run_id)
    episodes = []
    for response in trainer.stub.Train(request, timeout=JOB_TIMEOUT):
        if response.WhichOneof("event") == "episode":
            checker.check(response.episode)
            episodes.append(response.episode)
    checker.finish()
    assert [e.episode for e in episodes] == [1, 2, 3]
    assert episodes[-1].done and not any(e.done for e in episodes[:-1])
    for episode in episodes:
        assert {"loss", "reward", "reward_std", "reward_carried"} <= set(episode.metrics)
        assert 1 <= len(episode.grpo.sample_completions) <= 4
        assert episode.produce_time.seconds > 0
    assert trainer.runner.wait_idle(TIMEOUT)
    assert trainer.capabilities().slots_free == 1


def test_a_broken_stream_stops_the_job_process_within_one_step_and_frees_the_slot(
    trainer: RunningTrainer, caplog: pytest.LogCaptureFixture
) -> None:
    # The job trains in a process of its own; its rank reports the last step it finished.
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    call = trainer.stub.Train(_request("run-grpo-cancel", max_episodes=500), timeout=JOB_TIMEOUT)
    first_episode = threading.Event()
    for response in call:
        if response.WhichOneof("event") == "episode":
            first_episode.set()
            break
    assert first_episode.is_set()
    job = trainer.runner.job("run-grpo-cancel")
    assert job is not None
    call.cancel()  # a job without a grant (direct use) is cancelled when its stream ends
    assert trainer.runner.wait_idle(TIMEOUT)
    assert trainer.capabilities().slots_free == 1
    ended = [r.getMessage() for r in caplog.records if "last step of each rank" in r.getMessage()]
    line = ended[0]
    last = int(re.findall(r"\{0: (\d+)\}", line)[0])
    # The step in flight when the stop came was the last one.
    assert job.produced <= last <= job.produced + 1 < 500, (line, job.produced)
    with pytest.raises(grpc.RpcError) as info:
        next(iter(call))
    assert info.value.code() == grpc.StatusCode.CANCELLED


def test_a_provider_error_in_the_job_process_reaches_the_client_as_it_is(
    trainer: RunningTrainer,
) -> None:
    request = _request("run-grpo-no-model", max_episodes=3)
    request.task.grpo.model_path = "models/absent"
    with pytest.raises(grpc.RpcError) as info:
        list(trainer.stub.Train(request, timeout=JOB_TIMEOUT))
    error = error_from_rpc(info.value)
    assert (
        error.localized_message
        == "The model directory 'models/absent' was not found on the trainer."
    )
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "MODEL_NOT_FOUND")
    assert trainer.runner.wait_idle(TIMEOUT)
    assert trainer.capabilities().slots_free == 1
