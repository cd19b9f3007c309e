"""The real trainer server runs grpo tasks on the tiny VLM: streaming, contract, done, cancel."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.grpo_fixtures import grpo_data_root, tiny_grpo_task
from trainer_service.providers.grpo.callback import StreamingCallback
from trainwire.contract import StreamChecker
from trainwire.v1 import (
    episode_pb2,
    trainer_service_pb2,
)

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

RPC_TIMEOUT_S = 120.0


@pytest.fixture
def trainer(grpo_data_root: pathlib.Path) -> Iterator[RunningTrainer]:
    with running_trainer(
        {"grpo": "trainer_service.providers.grpo"},
        warm_up=False,
        wait_idle=False,
        stop_wait=30,
        device="cpu",
        data_root=grpo_data_root,
        heartbeat_s=1.0,
    ) as running:
        yield running
        running.runner.wait_idle(30)


def _request(run_id: str, max_episodes: int, workers: int = 2) -> trainer_service_pb2.TrainRequest:
    return trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=tiny_grpo_task(workers=workers),
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=5),
    )


def test_grpo_run_streams_checked_episodes_to_done(trainer: RunningTrainer) -> None:
    request = _request("run-grpo-stream", max_episodes=3)
    checker = StreamChecker.for_task(request.task, request.config, request.run_id)
    episodes = []
    for response in trainer.stub.Train(request, timeout=RPC_TIMEOUT_S):
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
    assert trainer.runner.wait_idle(30)
    assert trainer.capabilities().slots_free == 1


def test_cancel_mid_run_stops_within_one_step_and_frees_the_slot(
    trainer: RunningTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step end the trainer reaches, and whether the stop had been requested by then.
    step_ends: list[tuple[int, bool]] = []
    real_step_end = StreamingCallback.on_step_end

    def spy(self: StreamingCallback, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        step_ends.append((state.global_step, self.stop_event.is_set()))
        return real_step_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(StreamingCallback, "on_step_end", spy)
    call = trainer.stub.Train(_request("run-grpo-cancel", max_episodes=500), timeout=RPC_TIMEOUT_S)
    first_episode = threading.Event()
    for response in call:
        if response.WhichOneof("event") == "episode":
            first_episode.set()
            break
    assert first_episode.is_set()
    call.cancel()
    assert trainer.runner.wait_idle(60)
    assert trainer.capabilities().slots_free == 1
    stopped_at = [i for i, (_, stop_seen) in enumerate(step_ends) if stop_seen]
    # The first step end after the stop ends training: the step in flight was the last one.
    assert stopped_at == [len(step_ends) - 1]
    assert step_ends[-1][0] < 500
    with pytest.raises(grpc.RpcError) as info:
        next(iter(call))
    assert info.value.code() == grpc.StatusCode.CANCELLED
