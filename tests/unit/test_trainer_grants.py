"""The trainer core's grants, detach and re-attach, with a fake provider (no grpc, no torch).

Streams are read the way the servicer reads them, with ``JobStream.aevents`` on an event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import pytest

from tests.fakes.waiting import TIMEOUT, wait_for
from trainer_service.core.errors import (
    EpisodesNotHeld,
    InvalidRequest,
    JobCancelled,
    JobExists,
    JobNotFound,
    Reattached,
)
from trainer_service.core.jobs import Heartbeat, JobRunner, JobStream, RunnerSettings, RunningJob
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.testing import FakeProvider, imitation_request
from trainwire.v1 import episode_pb2, trainer_service_pb2


class Recording(FakeProvider):
    """Records each episode number as the provider makes it (before any stream sends it)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.made: list[int] = []
        self.cond = threading.Condition()

    def run(self, job):  # type: ignore[no-untyped-def]
        for episode in super().run(job):
            with self.cond:
                self.made.append(episode.episode)
                self.cond.notify_all()
            yield episode

    def wait_made(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.made) >= count, TIMEOUT), self.made


def runner_for(provider: object, **settings: object) -> JobRunner:
    values: dict[str, object] = {"heartbeat_s": 0.05, "detach_grace_s": 30.0}
    values.update(settings)
    return JobRunner(
        ProviderRegistry({"imitation": provider}),
        SlotPool(1),
        RunnerSettings(**values),  # type: ignore[arg-type]
    )


def granted(run_id: str = "run-1", grant: int = 0, **kwargs: object):  # type: ignore[no-untyped-def]
    request = imitation_request(run_id, **kwargs)  # type: ignore[arg-type]
    request.grant_through_episode = grant
    return request


def attach_request(
    run_id: str = "run-1", after: int = 0, grant: int = 0, **kwargs: object
) -> trainer_service_pb2.TrainRequest:
    request = granted(run_id, grant, **kwargs)
    request.attach_after_episode = after
    return request


async def take_episodes(
    events: AsyncIterator[episode_pb2.Episode | Heartbeat], count: int
) -> list[episode_pb2.Episode]:
    """The next ``count`` episodes (heartbeats skipped)."""
    out: list[episode_pb2.Episode] = []
    while len(out) < count:
        event = await anext(events)
        if isinstance(event, episode_pb2.Episode):
            out.append(event)
    return out


async def all_episodes(stream: JobStream[RunningJob]) -> list[episode_pb2.Episode]:
    """Every episode of ``stream`` to its end (raises what ends it)."""
    return [e async for e in stream.aevents() if isinstance(e, episode_pb2.Episode)]


async def test_the_provider_is_not_pulled_beyond_the_grant() -> None:
    provider = Recording()
    runner = runner_for(provider)
    stream = runner.start(granted(grant=3, max_episodes=20))
    events = stream.aevents()
    assert [e.episode for e in await take_episodes(events, 3)] == [1, 2, 3]
    # Blocked at its grant: heartbeats say "waiting" and the provider made nothing more.
    beats = [await anext(events) for _ in range(3)]
    assert all(isinstance(b, Heartbeat) and b.phase == "waiting" for b in beats)
    assert provider.made == [1, 2, 3]
    assert runner.grant("run-1", 2) == 3  # lower: a no-op
    assert runner.grant("run-1", 6) == 3
    assert [e.episode for e in await take_episodes(events, 3)] == [4, 5, 6]
    provider.wait_made(6)
    assert provider.made == [1, 2, 3, 4, 5, 6]
    runner.cancel_job("run-1")
    assert runner.wait_idle(TIMEOUT)


def test_grant_errors() -> None:
    runner = runner_for(FakeProvider())
    with pytest.raises(JobNotFound):
        runner.grant("nope", 3)
    runner.start(granted(grant=1))
    with pytest.raises(InvalidRequest):
        runner.grant("run-1", -1)
    runner.cancel_job("run-1")
    with pytest.raises(JobNotFound):
        runner.cancel_job("run-1")


def test_a_second_train_for_a_live_job_is_already_exists() -> None:
    runner = runner_for(FakeProvider(), heartbeat_s=5.0)
    runner.start(granted(grant=1))
    with pytest.raises(JobExists):
        runner.start(granted(grant=1))
    runner.cancel_job("run-1")


async def test_a_broken_stream_leaves_the_job_blocked_and_a_reattach_continues_exactly() -> None:
    provider = Recording()
    runner = runner_for(provider)
    stream = runner.start(granted(grant=10, max_episodes=30))
    first = await take_episodes(stream.aevents(), 4)
    runner.detach(stream)  # the gateway died after receiving 1..4
    provider.wait_made(10)  # the job trains on to its grant, then blocks
    assert runner.live_jobs == 1 and runner.slots.free == 0
    again = runner.attach(attach_request(after=2, grant=30, max_episodes=30))
    rest = await all_episodes(again)
    assert [e.episode for e in first] == [1, 2, 3, 4]
    assert [e.episode for e in rest] == list(range(3, 31))
    assert rest[-1].done
    runner.detach(again)
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 1
    assert runner.live_jobs == 1  # its end delivered, kept for a replay (next test)


async def test_reattach_keeps_the_grant_with_zero_and_refuses_other_tasks() -> None:
    runner = runner_for(Recording())
    stream = runner.start(granted(grant=2, max_episodes=30))
    runner.detach(stream)
    with pytest.raises(InvalidRequest):
        runner.attach(attach_request(after=0, max_episodes=31))
    again = runner.attach(attach_request(after=0, grant=0, max_episodes=30))
    assert runner.job("run-1").grant == 2  # type: ignore[union-attr]
    assert [e.episode for e in await take_episodes(again.aevents(), 2)] == [1, 2]
    runner.cancel_job("run-1")


async def test_attach_errors() -> None:
    runner = runner_for(FakeProvider(), retain=4, queue_size=1)
    with pytest.raises(JobNotFound):
        runner.attach(attach_request(after=0))
    stream = runner.start(granted(grant=12, max_episodes=30))
    await take_episodes(stream.aevents(), 12)
    with pytest.raises(EpisodesNotHeld) as info:
        runner.attach(attach_request(after=3, max_episodes=30))
    assert "holds episodes 9..12" in str(info.value)
    with pytest.raises(InvalidRequest):
        runner.attach(attach_request(after=-1, max_episodes=30))
    runner.cancel_job("run-1")


async def test_a_reattach_replaces_the_attached_stream() -> None:
    runner = runner_for(FakeProvider())
    old = runner.start(granted(grant=5, max_episodes=30))
    old_events = old.aevents()
    await take_episodes(old_events, 2)
    new = runner.attach(attach_request(after=2, max_episodes=30))
    with pytest.raises(Reattached):
        await take_episodes(old_events, 1)
    runner.detach(old)  # the old RPC ends: the new stream stays attached
    assert [e.episode for e in await take_episodes(new.aevents(), 3)] == [3, 4, 5]
    assert runner.live_jobs == 1
    runner.cancel_job("run-1")


async def test_cancel_job_ends_the_attached_stream_and_frees_the_slot() -> None:
    runner = runner_for(FakeProvider())
    stream = runner.start(granted(grant=3, max_episodes=30))
    events = stream.aevents()
    await take_episodes(events, 3)
    assert runner.cancel_job("run-1") == 3
    with pytest.raises(JobCancelled):
        await take_episodes(events, 1)
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 1


async def test_a_detached_job_is_cancelled_after_the_grace() -> None:
    provider = FakeProvider()
    runner = runner_for(provider, detach_grace_s=0.2)
    stream = runner.start(granted(grant=3, max_episodes=30))
    await take_episodes(stream.aevents(), 1)
    runner.detach(stream)
    assert provider.finished.wait(TIMEOUT)
    assert runner.wait_idle(TIMEOUT)
    assert runner.live_jobs == 0 and runner.slots.free == 1


async def test_a_job_that_finished_while_detached_delivers_its_tail_on_reattach() -> None:
    runner = runner_for(FakeProvider())
    stream = runner.start(granted(grant=10, max_episodes=5))
    await take_episodes(stream.aevents(), 1)
    runner.detach(stream)
    assert runner.wait_idle(TIMEOUT)  # finished: its slot is free, its episodes still held
    assert runner.slots.free == 1
    again = runner.attach(attach_request(after=1, max_episodes=5))
    assert [e.episode for e in await all_episodes(again)] == [2, 3, 4, 5]
    runner.detach(again)
    assert runner.live_jobs == 1


async def test_a_delivered_end_can_be_replayed_within_the_grace_then_the_job_leaves() -> None:
    # A gateway receives a paced run's last episodes before their time, so it may restart
    # having stored fewer than it received: the trainer replays them, computing nothing.
    provider = Recording()
    runner = runner_for(provider, detach_grace_s=0.5)
    stream = runner.start(granted(grant=10, max_episodes=5))
    delivered = [e.episode for e in await all_episodes(stream)]
    assert delivered == [1, 2, 3, 4, 5]
    runner.detach(stream)
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 1 and runner.live_jobs == 1
    again = runner.attach(attach_request(after=3, max_episodes=5))
    replayed = await all_episodes(again)
    assert [e.episode for e in replayed] == [4, 5] and replayed[-1].done
    assert provider.made == [1, 2, 3, 4, 5], "a replay computes nothing"
    runner.detach(again)
    wait_for(lambda: runner.live_jobs == 0, "the job gone after the grace")
    with pytest.raises(JobNotFound):
        runner.attach(attach_request(after=3, max_episodes=5))


async def test_a_new_train_replaces_a_finished_job_kept_for_a_replay() -> None:
    runner = runner_for(FakeProvider())
    stream = runner.start(granted(grant=10, max_episodes=3))
    assert len(await all_episodes(stream)) == 3
    runner.detach(stream)
    assert runner.wait_idle(TIMEOUT) and runner.live_jobs == 1
    again = runner.start(granted(grant=10, max_episodes=3))
    assert [e.episode for e in await all_episodes(again)] == [1, 2, 3]
    runner.detach(again)


async def test_without_a_grant_the_job_runs_free_up_to_its_queue() -> None:
    provider = Recording()
    runner = runner_for(provider, queue_size=3)
    stream = runner.start(granted(grant=0, max_episodes=8))
    provider.wait_made(3)
    time.sleep(0.2)
    assert provider.made == [1, 2, 3]
    episodes = await all_episodes(stream)
    assert [e.episode for e in episodes] == list(range(1, 9))


async def test_a_job_without_a_grant_is_cancelled_when_its_stream_ends() -> None:
    """Direct use (grpcurl, a script): nobody will re-attach, so the grace does not apply."""
    provider = FakeProvider()
    runner = runner_for(provider, detach_grace_s=3600.0)
    stream = runner.start(granted(grant=0, max_episodes=5000))
    await take_episodes(stream.aevents(), 2)
    runner.detach(stream)
    assert provider.finished.wait(TIMEOUT)
    assert runner.wait_idle(TIMEOUT)
    assert runner.live_jobs == 0 and runner.slots.free == 1
