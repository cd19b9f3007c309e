"""The parts of GRPO checkpoints that need no model: each epoch's data order, the trainer's check
of a checkpoint to resume from, and when a job's checkpoints are written and committed, with
real rank processes whose training is scripted (``tests.fakes.grpo_rank``)."""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time
from typing import Any

import pytest
import torch

from tests.fakes.grpo_rank import scripted_ranks
from tests.fakes.local_checkpoints import LocalCheckpoints
from tests.fakes.waiting import TIMEOUT
from tests.grpo_fixtures import make_job, tiny_grpo_task
from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint
from trainer_service.providers.grpo import checkpoint_files, process

__all__ = ["scripted_ranks"]  # the fixture, re-exported for pytest


# -- each epoch's order ------------------------------------------------------------------------


def _repeat_sampler(seed: int = 11) -> Any:
    # Imported here: TRL's import (~1.5 s of CPU) would be paid by every worker collecting this.
    from trl.trainer.utils import RepeatSampler

    return RepeatSampler(range(8), mini_repeat_count=2, batch_size=1, repeat_count=1, seed=seed)


def test_each_epoch_has_the_order_of_an_uninterrupted_run_whatever_came_before() -> None:
    from trainer_service.providers.grpo.sampler import EpochSampler

    torch.set_num_threads(1)
    running = _repeat_sampler()
    passes = [list(running) for _ in range(4)]  # TRL's order: one draw per pass
    assert passes[0] != passes[1]  # so an order restarted on resume would be another one
    fresh = EpochSampler(_repeat_sampler())
    for epoch in (2, 0, 3, 1):  # in any order, as a resumed job reaches them
        fresh.set_epoch(epoch)
        assert list(fresh) == passes[epoch]
        assert list(fresh) == passes[epoch]  # again: the epoch alone decides
    assert len(fresh) == len(running) == 16


# -- the trainer's check of a checkpoint ---------------------------------------------------------


def _checkpoint(
    directory: pathlib.Path, model: pathlib.Path, *, step: int = 6, world: int = 1
) -> RestoredCheckpoint:
    """A checkpoint directory with every file a resume needs (their content is not read here)."""
    (directory / "model").mkdir(parents=True)
    (directory / "trainer").mkdir()
    (directory / "model" / "config.json").write_text((model / "config.json").read_text())
    for name in ("model/model.safetensors", "trainer/optimizer.pt", "trainer/scheduler.pt"):
        (directory / name).write_bytes(b"x")
    for rank in range(world):
        (directory / "trainer" / checkpoint_files.rng_file(rank, world)).write_bytes(b"x")
    (directory / "trainer" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    record = checkpoint_files.record(
        step=step,
        best_reward=0.5,
        last_reward=0.25,
        world_size=world,
        seed=1,
        epoch=0,
        batches_done=step,
        model_fingerprint=checkpoint_files.model_fingerprint(model),
    )
    (directory / "trainwire.json").write_text(json.dumps(record))
    return RestoredCheckpoint(directory, step, 0.5)


def test_a_checkpoint_that_does_not_fit_the_job_is_refused_with_its_reason(
    tmp_path: pathlib.Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "hidden": 64}))
    good = _checkpoint(tmp_path / "good", model)
    record = checkpoint_files.check_resume(good, model, processes=1)
    assert record["last_reward"] == 0.25 and record["data_position"]["batches_done"] == 6
    # A re-indented config is the same model.
    (model / "config.json").write_text(json.dumps({"hidden": 64, "model_type": "llava"}, indent=4))
    checkpoint_files.check_resume(good, model, processes=1)

    def refused(resume: RestoredCheckpoint, processes: int = 1) -> str:
        with pytest.raises(CheckpointUnusable) as info:
            checkpoint_files.check_resume(resume, model, processes)
        return str(info.value)

    assert "written by 1 processes; this job has 2" in refused(good, processes=2)
    assert "taken after step 6, not 7" in refused(RestoredCheckpoint(good.directory, 7, 0.5))
    two = _checkpoint(tmp_path / "two", model, world=2)
    (two.directory / "trainer" / "rng_state_1.pth").unlink()
    assert refused(two, processes=2) == "files are missing: trainer/rng_state_1.pth"
    (good.directory / "model" / "model.safetensors").unlink()
    assert refused(good) == "files are missing: model/model.safetensors"
    other = _checkpoint(tmp_path / "other", model)
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "hidden": 96}))
    assert refused(other) == "it was trained from another model than this task's"
    (other.directory / "trainwire.json").write_text("{")
    assert "trainwire.json is missing or unreadable" in refused(other)


# -- when checkpoints are written: scripted ranks -------------------------------------------------


def _scripted_job(steps: int, script: str = "", **job: Any) -> Any:
    task = tiny_grpo_task(model_path=f"scripted{script}", **job.pop("task", {}))
    return make_job(pathlib.Path("/nonexistent"), task, max_episodes=steps, **job)


class _Recording(LocalCheckpoints):
    """LocalCheckpoints that notes each commit in a shared event list."""

    def __init__(self, events: list[str], *args: Any) -> None:
        super().__init__(*args)
        self.events = events

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        self.events.append(f"commit {episode}")
        super().commit(episode, best_reward, directory)


def test_the_provider_names_its_default_interval() -> None:
    from trainer_service.providers import grpo

    assert grpo.DEFAULT_CHECKPOINT_EVERY == 50  # measured: see its comment


def test_due_checkpoints_are_committed_after_their_episode_and_the_last_always(
    scripted_ranks: str, tmp_path: pathlib.Path
) -> None:
    events: list[str] = []
    checkpoints = _Recording(events, tmp_path, 2, 5)
    job = _scripted_job(5, task={"num_processes": 2}, checkpoints=checkpoints)
    for episode in process.run(job):
        events.append(f"episode {episode.episode}")
    assert events == [
        *("episode 1", "episode 2", "commit 2", "episode 3", "episode 4", "commit 4"),
        *("episode 5", "commit 5"),
    ]
    committed = [(c.episode, c.best_reward) for c in checkpoints.committed]
    assert committed == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4)), (5, 0.5)]
    record = json.loads((checkpoints.committed[1].directory / "scripted.json").read_text())
    assert record == {"step": 4, "best_reward": pytest.approx(0.4), "last_reward": 0.4}
    assert not list(tmp_path.glob("scratch-*"))  # every scratch directory was committed


def test_a_job_closed_at_its_grant_boundary_checkpoints_its_last_episode_when_asked(
    scripted_ranks: str, tmp_path: pathlib.Path
) -> None:
    # Parked: paused after episode 3, then ended with a final checkpoint.
    parked = LocalCheckpoints(tmp_path / "parked", 0, 10)
    episodes = process.run(_scripted_job(10, checkpoints=parked))
    assert [next(episodes).episode for _ in range(3)] == [1, 2, 3]
    parked.final.set()
    episodes.close()  # type: ignore[attr-defined]
    assert [c.episode for c in parked.committed] == [3]
    # Cancelled without one: nothing is written, and the job was asked.
    cancelled = LocalCheckpoints(tmp_path / "cancelled", 0, 10)
    episodes = process.run(_scripted_job(10, checkpoints=cancelled))
    next(episodes)
    episodes.close()  # type: ignore[attr-defined]
    assert cancelled.committed == [] and cancelled.asked_final == 1


def test_a_stop_during_a_step_finishes_it_for_a_final_checkpoint_else_not(
    scripted_ranks: str, tmp_path: pathlib.Path
) -> None:
    def stop_during_step_3(final: bool) -> tuple[list[int], list[int]]:
        checkpoints = LocalCheckpoints(tmp_path / str(final), 0, 10)
        stop = threading.Event()
        job = _scripted_job(10, ":step-s=1.0", checkpoints=checkpoints, stop_event=stop)
        seen: list[int] = []
        episodes = process.run(job)
        seen += [next(episodes).episode, next(episodes).episode]
        if final:
            checkpoints.final.set()
        threading.Timer(0.3, stop.set).start()  # while step 3 runs
        started = time.monotonic()
        seen += [e.episode for e in episodes]
        assert time.monotonic() - started < TIMEOUT
        return seen, [c.episode for c in checkpoints.committed]

    # The step in flight is finished and yielded: only its end can be checkpointed.
    assert stop_during_step_3(final=True) == ([1, 2, 3], [3])
    assert stop_during_step_3(final=False) == ([1, 2], [])


def test_a_checkpoint_that_cannot_be_written_is_logged_and_training_goes_on(
    scripted_ranks: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    checkpoints = LocalCheckpoints(tmp_path, 1, 3)
    episodes = list(process.run(_scripted_job(3, ":save-fails", checkpoints=checkpoints)))
    assert [e.episode for e in episodes] == [1, 2, 3] and episodes[-1].done
    assert checkpoints.committed == [] and not list(tmp_path.iterdir())
    assert [n for n, _ in checkpoints.failed] == [1, 2, 3]
    assert "No space left on device" in checkpoints.failed[0][1]
    failures = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(failures) == 3 and "No space left on device" in failures[0]
