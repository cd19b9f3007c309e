"""A GRPO job resumed from its checkpoint on the GPU goes on at the step after the checkpoint, on
the rows the uninterrupted job trained on, at the reward level that job had reached.

Both jobs run in the processes the trainer runs a job in (``process.run``), with traced ranks
(``tests.fakes.grpo_traced_rank``: the rows of each step). The task is the colour demo at the
provider's defaults (16 prompts x 8 completions a step, ``exact_match``): the tiny VLM learns it
in a few dozen steps, so a resume that lost the weights or the optimizer would show as a reward
back at chance. Sampling on CUDA is not bit-reproducible (bf16 kernels, atomics), so the rewards
are compared as levels, while the rows, which come from the seeded sampler, must be equal.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
from collections.abc import Callable

import pytest

from tests.fakes.grpo_traced_rank import read_trace, traced_ranks
from tests.fakes.local_checkpoints import LocalCheckpoints
from tests.gpu.harness import COLOURS_FILE, MODEL_DIR
from tests.grpo_fixtures import make_job, tiny_grpo_task
from trainer_service.core.provider import RestoredCheckpoint
from trainer_service.providers.grpo import process
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

__all__ = ["traced_ranks"]  # the fixture, re-exported for pytest

STEPS = 70
EVERY = 10
RESUME_AT = 50
SEED = 4
#: Only model, dataset and reward set: the defaults that learn (docs/guides/own-model.md).
TASK = tiny_grpo_task(
    MODEL_DIR,
    COLOURS_FILE,
    workers=None,
    num_generations=0,
    batch_size=0,
    max_completion_length=0,
    reward_functions=("exact_match",),
)


def _mean(episodes: list[episode_pb2.Episode], first: int, last: int) -> float:
    return statistics.fmean(e.reward for e in episodes if first <= e.episode <= last)


def _run(
    root: pathlib.Path,
    device: str,
    where: pathlib.Path,
    trace: Callable[[pathlib.Path], None],
    resume: RestoredCheckpoint | None = None,
) -> tuple[list[episode_pb2.Episode], dict[int, list[int]], LocalCheckpoints]:
    where.mkdir(parents=True)
    trace(where / "trace.jsonl")
    checkpoints = LocalCheckpoints(where / "store", EVERY, STEPS)
    job = make_job(root, TASK, max_episodes=STEPS, seed=SEED, checkpoints=checkpoints)
    job = dataclasses.replace(job, device=device, resume=resume)
    checker = StreamChecker.for_task(TASK, job.config, job.run_id)
    if resume is not None:
        checker.resume(resume.episode, resume.best_reward)
    episodes = []
    for episode in process.run(job):
        checker.check(episode)
        episodes.append(episode)
    checker.finish()
    steps, _ = read_trace(where / "trace.jsonl")
    return episodes, steps, checkpoints


def test_a_job_resumed_on_the_gpu_goes_on_with_the_same_rows_and_reward_level(
    device: str,
    gpu_data_root: pathlib.Path,
    tmp_path: pathlib.Path,
    traced_ranks: Callable[[pathlib.Path], None],
) -> None:
    whole, whole_rows, saved = _run(gpu_data_root, device, tmp_path / "whole", traced_ranks)
    assert [e.episode for e in whole] == list(range(1, STEPS + 1))
    learned = _mean(whole, RESUME_AT - 9, RESUME_AT)
    assert learned >= _mean(whole, 1, 10) + 0.25, "the job did not learn: nothing to keep"

    resumed, resumed_rows, _ = _run(
        gpu_data_root, device, tmp_path / "resumed", traced_ranks, saved.restored(RESUME_AT)
    )
    # The same step: the episodes go on after the checkpoint's, the best reward carried.
    assert [e.episode for e in resumed] == list(range(RESUME_AT + 1, STEPS + 1))
    assert resumed[-1].done
    assert resumed[0].best_reward >= whole[RESUME_AT - 1].best_reward
    # The same data order: every step trains on the rows the uninterrupted job's step did.
    assert sorted(resumed_rows) == list(range(RESUME_AT + 1, STEPS + 1))
    for step in resumed_rows:
        assert resumed_rows[step] == whole_rows[step], f"rows differ at step {step}"
    # The reward level kept: the resumed policy is the trained one, not a fresh one.
    kept = _mean(resumed, RESUME_AT + 1, RESUME_AT + 10)
    after = _mean(whole, RESUME_AT + 1, RESUME_AT + 10)
    print(f"reward: steps 1-10 {_mean(whole, 1, 10):.3f}, before the checkpoint {learned:.3f}")
    print(f"after it: uninterrupted {after:.3f}, resumed {kept:.3f}")
    assert kept >= learned - 0.15, (learned, kept)
