"""The trainer core's checkpoints with a checkpointing fake provider over a real directory store
(no grpc, no torch): events after their episode and again on a re-attach, failures reported
while training goes on, resume from the first usable candidate (skips named), and the final
checkpoint of a cancel.

Streams are read the way the servicer reads them, with ``JobStream.aevents`` on an event loop.
"""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Generator

import pytest

from tests.fakes.waiting import TIMEOUT, wait_for
from tests.unit.test_trainer_grants import attach_request, granted
from trainer_service.core.errors import JobCancelled
from trainer_service.core.jobs import Heartbeat, JobRunner, JobStream, RunnerSettings, RunningJob
from trainer_service.core.provider import CheckpointUnusable, EpisodeCounter, TrainJob
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointStore


class Checkpointing:
    """A provider that checkpoints as imitation does (before the yield, and as it stops when a
    final one is wanted) a state of one number: its episode counter. ``commit_late`` commits
    after the yield instead (as a provider whose last checkpoint comes after its done
    episode). A checkpoint whose state file says ``bad`` does not load."""

    DEFAULT_CHECKPOINT_EVERY = 3

    def __init__(self, commit_late: bool = False) -> None:
        self.commit_late = commit_late
        self.jobs: list[TrainJob] = []
        self.lock = threading.Lock()

    def run(self, job: TrainJob) -> Generator[episode_pb2.Episode, None, None]:
        with self.lock:
            self.jobs.append(job)
        counter = EpisodeCounter(job.config.max_episodes, job.resume)
        saved = 0
        if job.resume is not None:
            state = json.loads((job.resume.directory / "state.json").read_text())
            if state == "bad":
                raise CheckpointUnusable("the state says bad")
            assert state == job.resume.episode
            saved = job.resume.episode

        def save() -> None:
            nonlocal saved
            directory = job.checkpoints.scratch(counter.episode)
            (directory / "state.json").write_text(json.dumps(counter.episode))
            job.checkpoints.commit(counter.episode, counter.best_reward or 0.0, directory)
            saved = counter.episode

        try:
            while not counter.finished:
                if job.stop_event.is_set():
                    return
                n = counter.next_episode
                episode = counter.make(min(1.0, 0.1 * n))
                if not self.commit_late and job.checkpoints.due(n):
                    save()
                yield episode
                if self.commit_late and job.checkpoints.due(n):
                    save()
        finally:
            if job.checkpoints.final_wanted() and counter.episode > saved:
                save()


def runner_with(
    provider: object, store: CheckpointStore | None, tmp_path: pathlib.Path
) -> JobRunner:
    return JobRunner(
        ProviderRegistry({"imitation": provider}),
        SlotPool(1),
        RunnerSettings(heartbeat_s=0.05, detach_grace_s=30.0, scratch_dir=tmp_path / "scratch"),
        checkpoint_store=store,
    )


def kinds(events: list[object]) -> list[str]:
    """``e3``, ``c3`` (checkpoint), ``f3`` (failure), ``r3`` (resumed at 3); heartbeats left
    out."""
    out = []
    for event in events:
        if isinstance(event, episode_pb2.Episode):
            out.append(f"e{event.episode}")
        elif isinstance(event, episode_pb2.Checkpoint):
            out.append(f"c{event.episode}")
        elif isinstance(event, trainer_service_pb2.CheckpointFailure):
            out.append(f"f{event.episode}")
        elif isinstance(event, trainer_service_pb2.Resumed):
            out.append(f"r{event.checkpoint.checkpoint.episode}")
    return out


async def read_all(stream: JobStream[RunningJob]) -> list[object]:
    return [event async for event in stream.aevents() if not isinstance(event, Heartbeat)]


async def read_until(stream_events, last: str) -> list[object]:  # type: ignore[no-untyped-def]
    out: list[object] = []
    while not out or kinds(out[-1:]) != [last]:
        event = await anext(stream_events)
        if not isinstance(event, Heartbeat):
            out.append(event)
    return out


def ref(run_id: str, store: CheckpointStore, episode: int) -> trainer_service_pb2.CheckpointRef:
    info = store.info(run_id, episode)
    assert info is not None
    message = trainer_service_pb2.CheckpointRef(run_id=run_id)
    message.checkpoint.episode = episode
    message.checkpoint.sha256 = info.sha256
    message.checkpoint.size_bytes = info.size_bytes
    return message


@pytest.fixture
def store(tmp_path: pathlib.Path) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / "store"))


async def test_checkpoint_events_follow_their_episode(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    events = await read_all(runner.start(granted(max_episodes=7)))
    assert kinds(events) == ["e1", "e2", "e3", "c3", "e4", "e5", "e6", "c6", "e7", "c7"]
    assert store.episodes("run-1") == [3, 6, 7]
    info = store.info("run-1", 6)
    last = events[7]
    assert isinstance(last, episode_pb2.Checkpoint)
    assert (last.sha256, last.size_bytes) == (info.sha256, info.size_bytes)  # type: ignore[union-attr]
    assert store.meta("run-1", 6)["config"]["maxEpisodes"] == 7  # type: ignore[index]
    assert runner.wait_idle(TIMEOUT)
    assert not any((tmp_path / "scratch").iterdir())  # the job's scratch is gone


async def test_a_late_final_checkpoint_reaches_the_stream(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(commit_late=True), store, tmp_path)
    events = await read_all(runner.start(granted(max_episodes=4)))
    assert kinds(events) == ["e1", "e2", "e3", "c3", "e4", "c4"]


async def test_a_re_attach_sends_the_checkpoints_again(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    stream = runner.start(granted(grant=7, max_episodes=10))
    assert kinds(await read_until(stream.aevents(), "c6")) == [
        *("e1", "e2", "e3", "c3", "e4", "e5", "e6", "c6"),
    ]
    runner.detach(stream)  # the stream broke
    again = runner.attach(attach_request(after=5, max_episodes=10))
    events = again.aevents()
    assert kinds(await read_until(events, "e7")) == ["c3", "e6", "c6", "e7"]
    runner.cancel_job("run-1")
    with pytest.raises(JobCancelled):
        await read_all(again)


async def test_failed_writes_are_reported_and_training_goes_on(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    runner = runner_with(Checkpointing(), CheckpointStore(str(blocker)), tmp_path)
    events = await read_all(runner.start(granted(max_episodes=4)))
    assert kinds(events) == ["e1", "e2", "e3", "f3", "e4", "f4"]
    failure = events[3]
    assert isinstance(failure, trainer_service_pb2.CheckpointFailure)
    assert "run 'run-1' at episode 3" in failure.message


async def test_resume_from_the_newest_usable_candidate(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    provider = Checkpointing()
    runner = runner_with(provider, store, tmp_path)
    await read_all(runner.start(granted(max_episodes=10)))  # checkpoints 3, 6, 9, 10
    assert runner.wait_idle(TIMEOUT)
    candidates = [ref("run-1", store, n) for n in (10, 9, 6, 3)]
    candidates[0].checkpoint.sha256 = "0" * 64  # the gateway's record disagrees: damaged
    (tmp_path / "store" / "run-1" / f"{9:012d}.json").unlink()  # gone
    # Does not load, though its digest matches its (rewritten) record.
    scratch = tmp_path / "bad"
    scratch.mkdir()
    (scratch / "state.json").write_text(json.dumps("bad"))
    store.put("run-1", 6, scratch, {"best_reward": 0.6})
    candidates[2] = ref("run-1", store, 6)

    request = granted("run-2", max_episodes=12)
    request.resume_from.extend(candidates)
    events = await read_all(runner.start(request))
    assert kinds(events)[:3] == ["r3", "e4", "e5"]
    resumed = events[0]
    assert isinstance(resumed, trainer_service_pb2.Resumed)
    assert resumed.checkpoint.run_id == "run-1"
    assert resumed.best_reward == pytest.approx(0.3)
    assert [(s.episode, s.reason.split(":")[0]) for s in resumed.skipped] == [
        (10, "digest mismatch"),
        (9, "missing"),
        (6, "does not load"),
    ]
    episodes = [e for e in events if isinstance(e, episode_pb2.Episode)]
    assert [e.episode for e in episodes] == list(range(4, 13))
    assert episodes[-1].done
    job = provider.jobs[-1]
    assert job.resume is not None and job.resume.episode == 3
    # The new run checkpoints under its own id, from where it continued.
    assert store.episodes("run-2") == [6, 9, 12]


async def test_no_usable_candidate_starts_from_scratch(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    request = granted(max_episodes=3)
    missing = request.resume_from.add(run_id="run-0")
    missing.checkpoint.episode = 5
    events = await read_all(runner.start(request))
    assert kinds(events) == ["r0", "e1", "e2", "e3", "c3"]
    resumed = events[0]
    assert isinstance(resumed, trainer_service_pb2.Resumed)
    assert not resumed.HasField("checkpoint")
    assert [s.episode for s in resumed.skipped] == [5]


async def test_without_a_store_candidates_are_skipped(tmp_path: pathlib.Path) -> None:
    runner = runner_with(Checkpointing(), None, tmp_path)
    request = granted(max_episodes=2)
    request.resume_from.add(run_id="run-0").checkpoint.episode = 1
    events = await read_all(runner.start(request))
    assert kinds(events) == ["r0", "e1", "e2"]
    assert "no checkpoint store" in events[0].skipped[0].reason  # type: ignore[attr-defined]


async def test_cancel_with_checkpoint_at_the_grant(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    stream = runner.start(granted(grant=5, max_episodes=20))
    events = stream.aevents()
    assert kinds(await read_until(events, "e5"))[-1] == "e5"
    job = runner.job("run-1")
    assert job is not None
    wait_for(lambda: job.phase == "waiting", "the job blocked at its grant")
    final = runner.cancel_with_checkpoint("run-1", TIMEOUT)
    assert final.last_episode == 5
    assert final.checkpoint is not None and final.checkpoint.episode == 5
    assert final.error == ""
    assert store.episodes("run-1") == [3, 5]
    assert store.info("run-1", 5) == final.checkpoint
    # The open stream gets the checkpoint event, then the cancellation.
    rest: list[object] = []
    with pytest.raises(JobCancelled):
        async for event in events:
            rest.append(event)
    assert kinds(rest) == ["c5"]


async def test_cancel_with_checkpoint_right_after_a_periodic_one(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    stream = runner.start(granted(grant=3, max_episodes=20))
    await read_until(stream.aevents(), "c3")
    final = runner.cancel_with_checkpoint("run-1", TIMEOUT)
    assert final.checkpoint is not None and final.checkpoint.episode == 3
    assert store.episodes("run-1") == [3]


async def test_cancel_with_checkpoint_before_the_first_episode(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    class Loading(Checkpointing):
        """Loads until the job is stopped."""

        def run(self, job: TrainJob) -> Generator[episode_pb2.Episode, None, None]:
            job.set_phase("loading")
            job.stop_event.wait()
            yield from super().run(job)

    runner = runner_with(Loading(), store, tmp_path)
    runner.start(granted(grant=5, max_episodes=5))
    final = runner.cancel_with_checkpoint("run-1", TIMEOUT)  # stops it at once
    assert (final.last_episode, final.checkpoint) == (0, None)
    assert "had not trained" in final.error
    assert runner.wait_idle(TIMEOUT)
    assert store.episodes("run-1") == []


async def test_cancel_with_checkpoint_of_a_resumed_job_that_trained_nothing(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    runner = runner_with(Checkpointing(), store, tmp_path)
    first = runner.start(granted(max_episodes=6))
    await read_all(first)
    runner.detach(first)
    assert runner.wait_idle(TIMEOUT)
    # The grant stops it right at the checkpoint: it restored, and waits for credit before
    # its first episode (``resumed`` goes out with that episode, once the restore loaded).
    request = granted(grant=3, max_episodes=9)
    request.resume_from.append(ref("run-1", store, 3))
    runner.start(request)
    job = runner.job("run-1")
    assert job is not None
    wait_for(lambda: job.phase == "waiting", "the restored job at its grant")
    final = runner.cancel_with_checkpoint("run-1", TIMEOUT)
    assert (final.last_episode, final.checkpoint) == (3, store.info("run-1", 3))


async def test_a_fork_continues_another_runs_checkpoint_of_the_same_task_only(
    store: CheckpointStore, tmp_path: pathlib.Path
) -> None:
    provider = Checkpointing()
    runner = runner_with(provider, store, tmp_path)
    await read_all(runner.start(granted(max_episodes=6)))  # run-1: checkpoints 3, 6
    assert runner.wait_idle(TIMEOUT)

    # Another learning rate, group size, seed and length: it continues from run-1's state.
    request = granted("fork-1", max_episodes=9)
    request.task.imitation.learning_rate = 0.001
    request.task.imitation.group_size = 4
    request.config.seed = 99
    request.resume_from.append(ref("run-1", store, 3))
    events = await read_all(runner.start(request))
    assert kinds(events)[:3] == ["r3", "e4", "e5"]
    assert provider.jobs[-1].resume is not None
    assert runner.wait_idle(TIMEOUT)

    # Another clip, or a length that ends at the checkpoint: skipped, saying why.
    other = granted("fork-2", max_episodes=9)
    other.task.imitation.clip_name = "walk"
    other.resume_from.append(ref("run-1", store, 3))
    events = await read_all(runner.start(other))
    resumed = events[0]
    assert isinstance(resumed, trainer_service_pb2.Resumed)
    assert not resumed.HasField("checkpoint")
    [skipped] = resumed.skipped
    assert skipped.reason == (
        "does not fit: it is of another task than this fork's (task.imitation.clip_name: "
        "'walk'; the checkpoint's task has 'wave'); a fork may change only its "
        "hyperparameters, seed and max_episodes"
    )
    assert runner.wait_idle(TIMEOUT)
    short = granted("fork-3", max_episodes=6)
    short.resume_from.append(ref("run-1", store, 6))
    events = await read_all(runner.start(short))
    assert events[0].skipped[0].reason == (  # type: ignore[attr-defined]
        "does not fit: it was taken after episode 6, and this job ends at episode 6"
    )
