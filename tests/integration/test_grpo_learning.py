"""GRPO learns: a shortened ``bench/grpo_learning.py`` run as the trainer runs GRPO, in a process
of its own (``process.run``, one CPU thread).

The offline tiny VLM starts with random weights, so its ``exact_match`` reward on the four-colour
demo dataset starts at or below chance (0.25). With the provider's defaults (the task sets only
model, dataset, reward and steps) 60 optimizer steps lift it well above chance. The same run on
uniform gray images cannot get above chance, which the benchmark checks at full length; here the
gray run is left out to keep the suite fast.
"""

from __future__ import annotations

import pathlib
import threading

from trainer_service.core.provider import TrainJob
from trainer_service.providers.grpo import process
from trainer_service.tools import make_demo_dataset, make_tiny_vlm
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

STEPS = 60
CHANCE = 1 / len(make_demo_dataset.DEFAULT_ANSWERS["colour"])


def test_reward_rises_well_above_chance_in_60_steps(tmp_path: pathlib.Path) -> None:
    make_tiny_vlm.build(tmp_path / "models" / "tiny-vlm")
    make_demo_dataset.build(tmp_path / "datasets" / "colours")
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="models/tiny-vlm",
            dataset_path="datasets/colours/train.jsonl",
            reward_functions=["exact_match"],
            # Inline decoding: worker start-up would cost more than the 64 small images.
            dataloader_num_workers=0,
        )
    )
    job = TrainJob(
        run_id="run-grpo-learns",
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=STEPS, seed=0),
        device="cpu",
        data_root=tmp_path,
        image_cache_dir=None,
        stop_event=threading.Event(),
    )
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    rewards = []
    for episode in process.run(job):
        checker.check(episode)
        rewards.append(episode.reward)
        assert episode.metrics["rewards/exact_match/mean"] == episode.reward
    checker.finish()
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == STEPS
    assert first <= CHANCE + 0.1, rewards[:10]  # it does not know the answers to begin with
    assert last >= CHANCE + 0.4, rewards  # ...and has learned to read the colour by the end
