"""The parts of a trainer job alone (``trainer_service.core.job_state``, ``job_reader``,
``job_resume``) and the runner's one table of job records."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator

import pytest

from tests.fakes.waiting import TIMEOUT, wait_for
from trainer_service.core.errors import EpisodesNotHeld, JobExists, Reattached
from trainer_service.core.job_reader import JobReader
from trainer_service.core.job_resume import ResumeChoice
from trainer_service.core.job_state import JobState
from trainer_service.core.job_stream import JobStream
from trainer_service.core.job_window import EpisodeWindow
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.observe import NullJobObserver
from trainer_service.core.provider import TrainJob
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.testing import FakeProvider, imitation_request
from trainwire import contract
from trainwire.v1 import episode_pb2, trainer_service_pb2


def _state(resume_from: tuple[trainer_service_pb2.CheckpointRef, ...] = ()) -> JobState:
    request = imitation_request(max_episodes=5)
    checker = contract.StreamChecker.for_task(request.task, request.config, request.run_id)
    return JobState(request.run_id, checker, EpisodeWindow(2, 4, 0), resume_from)


def _ref(episode: int) -> trainer_service_pb2.CheckpointRef:
    ref = trainer_service_pb2.CheckpointRef(run_id="run-1")
    ref.checkpoint.episode = episode
    return ref


# -- the shared state --------------------------------------------------------------------------


def test_the_phase_reads_waiting_while_the_producer_waits_for_credit() -> None:
    state = _state()
    assert state.wait_credit(2)  # queue_size 2 ahead of cursor 0
    credit: list[bool] = []
    waiter = threading.Thread(target=lambda: credit.append(state.wait_credit(3)))
    waiter.start()
    wait_for(lambda: state.phase == "waiting", "the producer waits")
    with state.cond:
        state.window.cursor = 1
        state.notify()
    waiter.join(TIMEOUT)
    assert credit == [True] and state.phase == "loading"


def test_a_stop_ends_the_wait_for_credit_without_credit() -> None:
    state = _state()
    credit: list[bool] = []
    waiter = threading.Thread(target=lambda: credit.append(state.wait_credit(3)))
    waiter.start()
    wait_for(lambda: state.waiting, "the producer waits")
    with state.cond:
        state.stop_reason = "cancelled"
        state.notify()
    waiter.join(TIMEOUT)
    assert credit == [False]
    assert not state.wait_credit(1)  # a stopped job gets no more credit


def test_start_at_numbers_the_episodes_after_the_restored_one() -> None:
    state = _state()
    with state.cond:
        state.start_at(7)
    assert (state.start_episode, state.window.produced, state.window.first) == (7, 7, 8)


# -- the read side -----------------------------------------------------------------------------


class _Source:
    """The smallest ``StreamSource``: a reader's stream needs only a job to name."""

    heartbeat_s = 1.0


def test_a_stream_that_attaches_replaces_the_one_before() -> None:
    state = _state()
    reader = JobReader(state, "imitation", None, NullJobObserver())
    first: JobStream[_Source] = reader.attach(_Source(), 0, 0)  # type: ignore[type-var]
    second = reader.attach(_Source(), 0, 0)  # type: ignore[type-var]
    assert first.replaced and reader.attached
    with pytest.raises(Reattached):
        reader.next_event(first)
    assert reader.detach(first) is None  # not attached any more
    assert reader.next_event(second) is None  # nothing produced yet
    assert reader.detach(second) is True  # undelivered: the job had not ended
    assert not reader.attached


def test_a_stream_reads_resumed_before_the_episodes_and_only_heartbeats_before_it() -> None:
    state = _state(resume_from=(_ref(3),))
    reader = JobReader(state, "imitation", None, NullJobObserver())
    with pytest.raises(EpisodesNotHeld):
        reader.attach(_Source(), 4, 0)  # type: ignore[type-var]
    stream: JobStream[_Source] = reader.attach(_Source(), 0, 0)  # type: ignore[type-var]
    assert reader.next_event(stream) is None  # still restoring
    resumed = trainer_service_pb2.Resumed(checkpoint=_ref(3))
    with state.cond:
        state.start_at(3)
        state.resumed = resumed
        state.window.hold(episode_pb2.Episode(episode=4))
    assert reader.next_event(stream) is resumed
    assert stream.cursor == 3
    event = reader.next_event(stream)
    assert isinstance(event, episode_pb2.Episode) and event.episode == 4


# -- the resume choice -------------------------------------------------------------------------


def test_without_a_checkpoint_store_every_candidate_is_skipped_and_the_job_starts_over(
    tmp_path: pathlib.Path,
) -> None:
    state = _state(resume_from=(_ref(4), _ref(2)))
    request = imitation_request(max_episodes=5)
    job = TrainJob(
        run_id=request.run_id,
        task=request.task,
        config=request.config,
        device="cpu",
        data_root=tmp_path,
        image_cache_dir=None,
        stop_event=threading.Event(),
    )
    provider = FakeProvider()
    episodes, first = ResumeChoice(state, job, provider, None).open()
    assert episodes is not None and first is None
    assert state.resumed is not None and not state.resumed.HasField("checkpoint")
    assert [s.episode for s in state.resumed.skipped] == [4, 2]
    assert all("no checkpoint store" in s.reason for s in state.resumed.skipped)
    assert state.start_episode == 0


# -- the runner's table of jobs ----------------------------------------------------------------


class _Lingering(FakeProvider):
    """Holds before its first episode and, once stopped, lingers until released."""

    def __init__(self) -> None:
        super().__init__(hold_after=0)
        self.release = threading.Event()

    def run(self, job: TrainJob) -> Iterator[episode_pb2.Episode]:
        yield from super().run(job)
        self.release.wait(TIMEOUT)


def test_a_cancelled_job_still_running_is_not_live_and_a_new_job_of_its_run_starts() -> None:
    provider = _Lingering()
    runner = JobRunner(ProviderRegistry({"imitation": provider}), SlotPool(2), RunnerSettings())
    runner.start(imitation_request(max_episodes=5))
    with pytest.raises(JobExists):
        runner.start(imitation_request(max_episodes=5))
    old = runner.job("run-1")
    runner.cancel_job("run-1")
    assert runner.job("run-1") is None and runner.live_jobs == 0 and runner.active_jobs == 1
    runner.start(imitation_request(max_episodes=5))  # beside the old one, still lingering
    new = runner.job("run-1")
    assert new is not None and new is not old
    assert (runner.live_jobs, runner.active_jobs, runner.slots.free) == (1, 2, 0)
    provider.release.set()
    assert old is not None and old.join(TIMEOUT)
    wait_for(lambda: runner.active_jobs == 1, "the old job's thread exited")
    assert runner.job("run-1") is new and runner.slots.free == 1
    runner.cancel_job("run-1")
    assert runner.wait_idle(TIMEOUT)
    assert (runner.live_jobs, runner.active_jobs, runner.slots.free) == (0, 0, 2)
