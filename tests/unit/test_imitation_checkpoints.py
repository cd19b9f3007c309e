"""The imitation provider's checkpoints: what one holds, an exact resume (the episodes after the
checkpoint are those of the uninterrupted run, bit for bit), the final checkpoint as the job
stops, a checkpoint of another shape refused, and failed writes that do not stop training."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import threading

import pytest
import safetensors.torch
import torch

from tests.unit.test_imitation_provider import arm_clip, arm_rig, make_job, wave_task
from trainer_service.core.checkpointing import JobCheckpoints
from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint, TrainJob
from trainer_service.providers import imitation
from trainwire.v1 import episode_pb2
from trainwire_ops.checkpoints import CheckpointStore

torch.set_num_threads(1)


def with_checkpoints(
    job: TrainJob, store: CheckpointStore, tmp_path: pathlib.Path, every: int
) -> tuple[TrainJob, JobCheckpoints]:
    checkpoints = JobCheckpoints(
        store,
        job.run_id,
        "imitation",
        every=every,
        max_episodes=job.config.max_episodes,
        scratch_root=tmp_path / "scratch",
    )
    return dataclasses.replace(job, checkpoints=checkpoints), checkpoints


def restored(
    store: CheckpointStore, run_id: str, episode: int, dest: pathlib.Path
) -> RestoredCheckpoint:
    info = store.fetch(run_id, episode, dest)
    assert info.best_reward is not None
    return RestoredCheckpoint(dest, episode, info.best_reward)


def signature(episode: episode_pb2.Episode) -> tuple[object, ...]:
    return (
        episode.episode,
        episode.reward,
        episode.best_reward,
        episode.done,
        tuple(sorted(episode.metrics.items())),
        tuple(episode.imitation.angles),
    )


def test_resume_continues_exactly(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    job, checkpoints = with_checkpoints(make_job(wave_task(), 30, seed=3), store, tmp_path, 10)
    whole = list(imitation.run(job))
    assert store.episodes(job.run_id) == [10, 20, 30]
    assert [checkpoints.of_episode(n) is not None for n in (10, 20, 30)] == [True] * 3

    resumed_job, _ = with_checkpoints(
        make_job(wave_task(), 30, seed=3), store, tmp_path / "second", 0
    )
    resumed_job = dataclasses.replace(
        resumed_job, run_id="run-resumed", resume=restored(store, job.run_id, 10, tmp_path / "r")
    )
    again = list(imitation.run(resumed_job))
    assert [e.episode for e in again] == list(range(11, 31))
    # Bit for bit: rewards, running maximum, metrics and the motion itself.
    assert [signature(e) for e in again] == [signature(e) for e in whole[10:]]


def test_checkpoint_files_load_without_trainwire(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    job, _ = with_checkpoints(make_job(wave_task(), 5, seed=1), store, tmp_path, 0)
    episodes = list(imitation.run(job))
    assert store.episodes(job.run_id) == [5]  # the last episode is always checkpointed
    store.fetch(job.run_id, 5, tmp_path / "out")
    tensors = safetensors.torch.load_file(str(tmp_path / "out" / imitation.MODEL_FILE))
    record = json.loads((tmp_path / "out" / imitation.INFO_FILE).read_text())
    assert tensors["mean"].shape == tensors["log_std"].shape == (record["frames"], record["joints"])
    assert record["clip"] == "wave" and record["rig"] == "stickman"
    assert record["episode"] == 5 and record["best_reward"] == episodes[-1].best_reward
    assert record["config"]["maxEpisodes"] == 5
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [imitation.MODEL_FILE, imitation.STATE_FILE, imitation.INFO_FILE]
    )
    info = store.info(job.run_id, 5)
    assert info is not None and info.best_reward == episodes[-1].best_reward


def test_final_checkpoint_when_stopping(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    job, checkpoints = with_checkpoints(make_job(wave_task(), 100), store, tmp_path, 50)
    episodes = imitation.run(job)
    for _ in range(7):
        next(episodes)
    checkpoints.request_final()
    episodes.close()
    assert store.episodes(job.run_id) == [7]

    # Not twice: a stop right after a periodic checkpoint writes no other.
    job, checkpoints = with_checkpoints(
        make_job(wave_task(), 100, seed=2), store, tmp_path / "b", 4
    )
    episodes = imitation.run(job)
    for _ in range(4):
        next(episodes)
    checkpoints.request_final()
    episodes.close()
    assert store.episodes(job.run_id) == [4]
    assert checkpoints.event(1) is None


def test_checkpoint_of_another_shape_does_not_load(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    job, _ = with_checkpoints(make_job(wave_task(), 3), store, tmp_path, 0)
    list(imitation.run(job))
    arm = episode_pb2.ImitationTask(rig=arm_rig(), clip=arm_clip())
    other = dataclasses.replace(
        make_job(arm, 10), resume=restored(store, job.run_id, 3, tmp_path / "r")
    )
    with pytest.raises(CheckpointUnusable, match="frames x joints"):
        next(imitation.run(other))

    (tmp_path / "r" / imitation.STATE_FILE).write_bytes(b"not a torch file")
    same_shape = dataclasses.replace(make_job(wave_task(), 10), resume=other.resume)
    with pytest.raises(CheckpointUnusable):
        next(imitation.run(same_shape))


def test_failed_writes_do_not_stop_training(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the store cannot be a directory here")
    store = CheckpointStore(str(blocker / "store"))  # every upload fails
    job, checkpoints = with_checkpoints(make_job(wave_task(), 6), store, tmp_path, 2)
    assert [e.episode for e in imitation.run(job)] == [1, 2, 3, 4, 5, 6]
    failures = [checkpoints.event(i) for i in range(3)]
    assert [(f.episode, f.info) for f in failures if f is not None] == [
        (2, None),
        (4, None),
        (6, None),
    ]
    assert all(f is not None and "episode" in f.error for f in failures)
    assert not any((tmp_path / "scratch").iterdir())  # nothing left behind

    # A scratch directory that cannot be written (a full disk) is reported the same way.
    class FullDisk(JobCheckpoints):
        def scratch(self, episode: int) -> pathlib.Path:
            raise OSError(28, "No space left on device")

    full = FullDisk(store, "run-full", "imitation", 3, 4, tmp_path / "scratch-full")
    job = dataclasses.replace(make_job(wave_task(), 4), checkpoints=full)
    assert len(list(imitation.run(job))) == 4
    event = full.event(0)
    assert event is not None and event.episode == 3 and "No space left" in event.error


def test_stop_event_still_stops_between_episodes(tmp_path: pathlib.Path) -> None:
    stop = threading.Event()
    store = CheckpointStore(str(tmp_path / "store"))
    job, _ = with_checkpoints(make_job(wave_task(), 50, stop_event=stop), store, tmp_path, 0)
    episodes = imitation.run(job)
    next(episodes)
    stop.set()
    assert list(episodes) == []
    assert store.episodes(job.run_id) == []
