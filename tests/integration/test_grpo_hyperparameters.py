"""Live hyperparameters of a GRPO job on the real GRPOTrainer (the offline tiny VLM, CPU), in a
rank process as the trainer runs it: a change sent between two steps is the next step's
learning rate (the peak of TRL's linear decay, which goes on from it), temperature and beta, and
the episodes say so from that step exactly."""

from __future__ import annotations

import pathlib

import pytest

from tests.grpo_fixtures import grpo_data_root, make_job, tiny_grpo_task
from trainer_service.providers.grpo import process
from trainwire.contract import StreamChecker
from trainwire.hyperparameters import Hyperparameters

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

STEPS = 5


def test_a_change_between_steps_is_the_next_steps_rate_temperature_and_beta(
    grpo_data_root: pathlib.Path,
) -> None:
    task = tiny_grpo_task(workers=0, learning_rate=0.01, beta=0.04)
    job = make_job(grpo_data_root, task, max_episodes=STEPS)
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    episodes = process.run(job)
    first = [next(episodes), next(episodes)]
    job.hyperparameters.request(Hyperparameters(learning_rate=0.001, temperature=0.5, beta=0.0))
    rest = list(episodes)
    for episode in first + rest:
        checker.check(episode)
    checker.finish()

    def decayed(peak: float, step: int) -> float:  # TRL's linear schedule, no warm-up
        return peak * (STEPS - (step - 1)) / STEPS

    for episode in first + rest:
        step, metrics = episode.episode, episode.metrics
        changed = step > 2
        assert metrics["learning_rate"] == pytest.approx(
            decayed(0.001 if changed else 0.01, step), rel=1e-6
        ), step
        assert (metrics["temperature"], metrics["beta"]) == ((0.5, 0.0) if changed else (1.0, 0.04))
        assert ("kl" in metrics) is not changed  # TRL measures the KL only while beta > 0
