"""GRPO checkpoints on the real trainer, in the processes the trainer runs a job in
(``process.run``): a resumed job continues the uninterrupted one, skips what was trained without
decoding it, and a checkpoint that does not fit is refused before the first episode. (That the
saved model loads without trainwire and answers held-out images is tested through the services
in ``test_grpo_learning``; a two-process job resuming with each rank's RNG state, on the wire,
in ``test_grpo_processes``.)

The ranks are the real worker around the real trainer, traced (``tests.fakes.grpo_traced_rank``:
the rows of each step and every image decode, from the rank and its DataLoader workers). One
uninterrupted job writes the checkpoints every test here reads (a module fixture): each rank
start costs seconds of imports on a small box.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.fakes.grpo_traced_rank import MODULE, TRACE_ENV, read_trace
from tests.fakes.local_checkpoints import LocalCheckpoints
from tests.grpo_fixtures import DATASET_FILE, DATASET_ROWS, MODEL_DIR, grpo_data_root, make_job
from tests.grpo_fixtures import tiny_grpo_task as _task
from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint
from trainer_service.providers.grpo import launch, process
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

#: 8 rows, one prompt per step: an epoch is 8 steps. The job resumes in its second epoch, so
#: the resumed job must both skip within an epoch and give that epoch its own order.
STEPS = 13
EVERY = 5
RESUME_AT = 10
SEED = 11
TASK = _task(
    dataset_path=DATASET_FILE,
    workers=2,
    num_generations=2,
    batch_size=2,
    max_completion_length=4,
    reward_functions=("exact_match", "length"),
)


@dataclass
class Job:
    """What one traced job streamed and read."""

    episodes: list[episode_pb2.Episode]
    steps: dict[int, list[int]]  #: the rows of each step (one entry per completion)
    decodes: list[int]  #: the row of every image decoded
    checkpoints: LocalCheckpoints


def _traced_job(
    root: pathlib.Path,
    where: pathlib.Path,
    *,
    resume: RestoredCheckpoint | None = None,
) -> Job:
    where.mkdir(parents=True)
    trace = where / "trace.jsonl"
    os.environ[TRACE_ENV] = str(trace)
    checkpoints = LocalCheckpoints(where / "store", EVERY, STEPS)
    job = make_job(
        root, TASK, max_episodes=STEPS, seed=SEED, checkpoints=checkpoints, resume=resume
    )
    episodes = list(process.run(job))
    steps, decodes = read_trace(trace)
    return Job(episodes, steps, decodes, checkpoints)


@pytest.fixture(scope="module")
def jobs(
    grpo_data_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Job, Job]]:
    """The uninterrupted job (checkpointed every EVERY steps) and one resumed at RESUME_AT."""
    where = tmp_path_factory.mktemp("grpo-checkpoints")
    saved = launch.WORKER_MODULE, os.environ.get(TRACE_ENV)
    launch.WORKER_MODULE = MODULE
    try:
        whole = _traced_job(grpo_data_root, where / "whole")
        resumed = _traced_job(
            grpo_data_root,
            where / "resumed",
            resume=whole.checkpoints.restored(RESUME_AT),
        )
        yield whole, resumed
    finally:
        launch.WORKER_MODULE = saved[0]
        if saved[1] is None:
            os.environ.pop(TRACE_ENV, None)
        else:
            os.environ[TRACE_ENV] = saved[1]


def _rows(job: Job, step: int) -> list[int]:
    return sorted(set(job.steps[step]))


def test_a_resumed_job_continues_the_uninterrupted_one(jobs: tuple[Job, Job]) -> None:
    whole, resumed = jobs
    checker = StreamChecker.for_task(TASK, episode_pb2.TrainConfig(max_episodes=STEPS), "run")
    for episode in whole.episodes:
        checker.check(episode)
    checker.finish()
    # Due every EVERY steps and at the last; each committed with its episode's best reward.
    best = {e.episode: e.best_reward for e in whole.episodes}
    assert [(c.episode, c.best_reward) for c in whole.checkpoints.committed] == [
        (n, best[n]) for n in (5, 10, 13)
    ]
    # The resumed job: steps RESUME_AT+1.. only, numbered on, best reward carried on.
    assert [e.episode for e in resumed.episodes] == list(range(RESUME_AT + 1, STEPS + 1))
    assert sorted(resumed.steps) == list(range(RESUME_AT + 1, STEPS + 1))
    assert resumed.episodes[-1].done
    after = whole.episodes[RESUME_AT:]
    for mine, theirs in zip(resumed.episodes, after, strict=True):
        step = mine.episode
        # The same rows, in the same order (no row of steps 1..RESUME_AT is trained again)...
        assert resumed.steps[step] == whole.steps[step], f"rows differ at step {step}"
        # ...and the same weights, optimizer and RNG: the same sampled completions, so the same
        # rewards; the loss within float noise (it was bit-equal on the CPU this was written on).
        assert list(mine.grpo.sample_completions) == list(theirs.grpo.sample_completions)
        assert (mine.reward, mine.best_reward) == (theirs.reward, theirs.best_reward)
        assert mine.metrics["loss"] == pytest.approx(theirs.metrics["loss"], rel=1e-5, abs=1e-7)
    # The second epoch's order is its own: the test would catch a resumed job that restarted
    # the epoch order (TRL's sampler, rebuilt on resume, gives its first draw).
    first_epoch = [_rows(whole, n) for n in range(1, 9)]
    second_epoch = [_rows(whole, n) for n in range(9, 17) if n in whole.steps]
    assert first_epoch[2 : 2 + len(after)] != second_epoch[2 : 2 + len(after)]
    # Checkpoint layout: the model, the trainer's state and trainwire's record.
    directory = whole.checkpoints.restored(RESUME_AT).directory
    record = json.loads((directory / "trainwire.json").read_text())
    assert record["step"] == RESUME_AT and record["world_size"] == 1
    assert record["data_position"] == {"epoch": 1, "batches_done": 2}
    assert record["best_reward"] == best[RESUME_AT]
    names = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert {
        "model/config.json",
        "model/model.safetensors",
        "trainer/optimizer.pt",
        "trainer/scheduler.pt",
        "trainer/rng_state.pth",
        "trainer/trainer_state.json",
        "trainwire.json",
    } <= names
    state = json.loads((directory / "trainer" / "trainer_state.json").read_text())
    assert state["global_step"] == RESUME_AT and state["log_history"] == []


def test_skipped_steps_decode_no_image(jobs: tuple[Job, Job]) -> None:
    whole, resumed = jobs
    # The uninterrupted job decoded each step's row (one image per row, once per step: the
    # workers' memo serves the row's second completion).
    assert len(whole.decodes) >= STEPS
    # The resumed job skipped the first epoch and two steps of the second by index: it decoded
    # only rows of the second epoch from its third step on (what it trained on, and what the
    # workers prefetched before the epoch's end), never a row of a skipped step.
    # (An epoch is a permutation of the rows: the skipped steps' rows come nowhere else in it.)
    skipped = {row for n in (9, 10) for row in whole.steps[n]}
    assert len(skipped) == 2
    assert resumed.decodes, "the resumed job decoded nothing: is the trace on?"
    assert not skipped & set(resumed.decodes), resumed.decodes
    assert len(resumed.decodes) <= DATASET_ROWS - 2, resumed.decodes


def test_a_checkpoint_that_does_not_fit_is_refused_before_the_first_episode(
    jobs: tuple[Job, Job], grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    whole, _ = jobs
    good = whole.checkpoints.restored(RESUME_AT)

    def resume_from(directory: pathlib.Path, model: str = MODEL_DIR) -> str:
        task = episode_pb2.TrainTask()
        task.CopyFrom(TASK)
        task.grpo.model_path = model
        restored = RestoredCheckpoint(directory, good.episode, good.best_reward)
        job = make_job(grpo_data_root, task, max_episodes=STEPS, seed=SEED, resume=restored)
        episodes = process.run(job)
        started = time.monotonic()
        with pytest.raises(CheckpointUnusable) as info:
            next(episodes)
        return f"{info.value} ({time.monotonic() - started:.1f} s)"

    def broken(name: str) -> pathlib.Path:
        copy = tmp_path / name
        shutil.copytree(good.directory, copy)
        return copy

    # Found by the trainer before any process starts.
    missing = broken("missing")
    (missing / "trainer" / "optimizer.pt").unlink()
    assert "trainer/optimizer.pt" in resume_from(missing)
    other = grpo_data_root / "models" / "other-vlm"
    shutil.copytree(grpo_data_root / MODEL_DIR, other, dirs_exist_ok=True)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    assert "another model" in resume_from(good.directory, model="models/other-vlm")
    # Found by the rank as it loads the weights: reported before any episode.
    truncated = broken("truncated")
    weights = truncated / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "its model does not load" in resume_from(truncated)
