"""GPU checks: the providers on a CUDA device (skipped where torch sees no CUDA GPU)."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from trainer_service.core.provider import TrainJob
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _job(task: episode_pb2.TrainTask, episodes: int, root: pathlib.Path) -> TrainJob:
    return TrainJob(
        run_id="gpu-run",
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=episodes, seed=0),
        device="cuda:0",
        data_root=root,
        image_cache_dir=None,
        stop_event=threading.Event(),
    )


def test_imitation_learns_on_cuda(tmp_path: pathlib.Path) -> None:
    from trainer_service.providers import imitation

    task = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(clip_name="wave"))
    checker = StreamChecker.for_task(task, episode_pb2.TrainConfig(max_episodes=300), "gpu-run")
    episodes = []
    for episode in imitation.run(_job(task, 300, tmp_path)):
        checker.check(episode)
        episodes.append(episode)
    checker.finish()
    assert sum(e.reward for e in episodes[-20:]) / 20 >= 0.8
