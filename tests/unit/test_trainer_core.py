"""The trainer's core alone: slots, episode counter, registry and job runner with fake providers.

Streams are read the way the servicer reads them, with ``JobStream.aevents`` on an event loop.
"""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Sequence
from typing import TypeAlias

import pytest

from tests.fakes.waiting import TIMEOUT
from trainer_service.core import errors as contract_errors
from trainer_service.core.errors import InvalidRequest, NoFreeSlot, ShuttingDown
from trainer_service.core.jobs import Heartbeat, JobRunner, JobStream, RunnerSettings, RunningJob
from trainer_service.core.provider import EpisodeCounter, ProviderError
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.providers import PROVIDER_MODULES
from trainer_service.testing import FakeProvider, imitation_request
from trainwire import contract
from trainwire.v1 import episode_pb2


def make_runner(
    provider: object,
    slots: int = 1,
    heartbeat_s: float = 5.0,
    queue_size: int = 4,
    detach_grace_s: float = 0.0,
    retain: int = 1024,
) -> JobRunner:
    return JobRunner(
        ProviderRegistry({"imitation": provider}),
        SlotPool(slots),
        RunnerSettings(
            heartbeat_s=heartbeat_s,
            queue_size=queue_size,
            detach_grace_s=detach_grace_s,
            retain=retain,
        ),
    )


def episodes_of(events: Sequence[object]) -> list[episode_pb2.Episode]:
    return [e for e in events if isinstance(e, episode_pb2.Episode)]


Event: TypeAlias = episode_pb2.Episode | Heartbeat


async def read_all(stream: JobStream[RunningJob]) -> list[Event]:
    """Every event of ``stream`` to its end (raises what ends it)."""
    return [event async for event in stream.aevents()]


async def take(events: AsyncIterator[Event], count: int) -> list[Event]:
    """The next ``count`` events."""
    return [await anext(events) for _ in range(count)]


async def rest(events: AsyncIterator[Event]) -> list[Event]:
    """Every event left (raises what ends the stream)."""
    return [event async for event in events]


# -- slots -------------------------------------------------------------------------------------


def test_slot_pool_counts_and_refuses_when_full() -> None:
    pool = SlotPool(2)
    assert pool.try_acquire() and pool.try_acquire()
    assert not pool.try_acquire()
    assert pool.free == 0
    pool.release()
    assert pool.free == 1
    pool.release()
    assert pool.wait_all_free(0)
    with pytest.raises(RuntimeError):
        pool.release()
    with pytest.raises(ValueError):
        SlotPool(0)


# -- episode counter ---------------------------------------------------------------------------


def test_episode_counter_numbers_tracks_best_and_marks_done() -> None:
    counter = EpisodeCounter(3)
    checker = contract.StreamChecker("imitation", 3)
    rewards = [0.5, 0.2, 0.7]
    episodes = [counter.make(r, {"loss": 1.0}) for r in rewards]
    for episode in episodes:
        checker.check(episode)
    checker.finish()
    assert [e.best_reward for e in episodes] == [0.5, 0.5, 0.7]
    assert [e.done for e in episodes] == [False, False, True]
    assert episodes[0].produce_time.seconds > 0
    assert counter.finished
    with pytest.raises(RuntimeError):
        counter.make(0.1)


def test_episode_counter_early_done_ends_the_stream() -> None:
    counter = EpisodeCounter(10)
    counter.make(0.1)
    last = counter.make(0.3, done=True, grpo=episode_pb2.GrpoDetail(sample_completions=["x"]))
    assert last.done and last.WhichOneof("detail") == "grpo"
    assert counter.finished


# -- registry ----------------------------------------------------------------------------------


def test_registry_imports_lazily_and_drops_broken_providers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ProviderRegistry(
        {"norun": "trainer_service.testing", "broken": "trainer_service.no_such_module"}
    )
    with caplog.at_level(logging.WARNING):
        assert registry.available() == []  # trainer_service.testing has no module-level run()
    assert "no run()" in registry.unavailable_reason("norun")
    assert registry.get("broken") is None
    assert "ModuleNotFoundError" in registry.unavailable_reason("broken")
    assert any("broken" in r.getMessage() for r in caplog.records)
    assert registry.known() == ["norun", "broken"]


def test_registry_serves_objects_and_builtin_names() -> None:
    fake = FakeProvider()
    registry = ProviderRegistry({"imitation": fake})
    assert registry.get("imitation") is fake
    assert registry.get("grpo") is None
    assert registry.unavailable_reason("grpo") == "not registered"
    assert set(PROVIDER_MODULES) == {"imitation", "grpo"}


def test_registry_loads_a_module_with_run() -> None:
    module = types.ModuleType("fake_provider")
    module.run = FakeProvider().run  # type: ignore[attr-defined]
    registry = ProviderRegistry({"imitation": module})
    assert registry.available() == ["imitation"]


# -- job runner --------------------------------------------------------------------------------


async def test_job_streams_checked_episodes_and_frees_the_slot() -> None:
    fake = FakeProvider()
    runner = make_runner(fake)
    job = runner.start(imitation_request(max_episodes=5))
    events = await read_all(job)
    episodes = episodes_of(events)
    assert [e.episode for e in episodes] == [1, 2, 3, 4, 5]
    assert episodes[-1].done
    assert runner.slots.wait_all_free(TIMEOUT)
    assert runner.wait_idle(TIMEOUT)
    assert fake.jobs[0].run_id == "run-1"
    assert fake.jobs[0].data_root == pathlib.Path("var/data")
    assert fake.jobs[0].image_cache_dir is None


async def test_job_gets_the_runner_settings() -> None:
    fake = FakeProvider()
    runner = JobRunner(
        ProviderRegistry({"imitation": fake}),
        SlotPool(1),
        RunnerSettings(
            device="cuda:0",
            data_roots=(pathlib.Path("/data"), pathlib.Path("/shared")),
            image_cache_dir=pathlib.Path("/cache"),
        ),
    )
    await read_all(runner.start(imitation_request(max_episodes=1)))
    job = fake.jobs[0]
    assert (job.device, job.data_root, job.image_cache_dir) == (
        "cuda:0",
        pathlib.Path("/data"),
        pathlib.Path("/cache"),
    )
    assert job.data_roots == (pathlib.Path("/data"), pathlib.Path("/shared"))


async def test_slot_is_free_as_soon_as_a_successful_stream_ends() -> None:
    runner = make_runner(FakeProvider())
    await read_all(runner.start(imitation_request(max_episodes=2)))
    # The job thread frees the slot before it hands over the end of the stream.
    assert runner.slots.free == 1
    await read_all(runner.start(imitation_request("run-2", max_episodes=2)))


def test_invalid_request_lists_every_bad_field() -> None:
    runner = make_runner(FakeProvider())
    request = imitation_request(max_episodes=0)
    request.run_id = ""
    request.task.imitation.group_size = 1
    with pytest.raises(InvalidRequest) as info:
        runner.start(request)
    fields = {v.field for v in info.value.violations}
    assert fields == {"run_id", "config.max_episodes", "task.imitation.group_size"}
    assert runner.slots.free == 1


def test_provider_validate_violations_are_invalid_request() -> None:
    bad = contract.FieldViolation("task.imitation.rig", "flat")
    runner = make_runner(FakeProvider(violations=[bad]))
    with pytest.raises(InvalidRequest) as info:
        runner.start(imitation_request())
    assert info.value.violations == (bad,)
    assert "run-1" in str(info.value)
    assert runner.slots.free == 1


def test_missing_provider_is_a_provider_error() -> None:
    runner = JobRunner(ProviderRegistry({}), SlotPool(1))
    with pytest.raises(ProviderError) as info:
        runner.start(imitation_request())
    assert info.value.reason == "PROVIDER_UNAVAILABLE"
    assert info.value.code == "FAILED_PRECONDITION"
    assert runner.slots.free == 1


async def test_no_free_slot() -> None:
    fake = FakeProvider(hold_after=0)
    runner = make_runner(fake)
    job = runner.start(imitation_request())
    with pytest.raises(NoFreeSlot) as info:
        runner.start(imitation_request("run-2"))
    assert "run-2" in str(info.value)
    runner.cancel_job("run-1")
    with pytest.raises(contract_errors.JobCancelled):
        await read_all(job)
    assert runner.wait_idle(TIMEOUT)
    assert runner.slots.free == 1


async def test_heartbeats_while_the_provider_is_busy() -> None:
    fake = FakeProvider(hold_after=2, phase="loading")
    runner = make_runner(fake, heartbeat_s=0.02)
    job = runner.start(imitation_request(max_episodes=5))
    events = job.aevents()
    first = await take(events, 2)
    assert [e.episode for e in episodes_of(first)] == [1, 2]
    beats = [b for b in await take(events, 3) if isinstance(b, Heartbeat)]
    assert [b.last_episode for b in beats] == [2, 2, 2]
    assert beats[0].phase == "loading"
    assert beats[0].time_ns > 0
    # The handler stops reading and the RPC ends: no grace, so the job is cancelled.
    await events.aclose()
    runner.detach(job)
    assert fake.stopped.wait(TIMEOUT)
    assert runner.wait_idle(TIMEOUT)
    assert runner.slots.free == 1


async def test_provider_error_is_raised_after_the_episodes_before_it() -> None:
    error = ProviderError("The model could not be loaded.", detail="boom", code="NOT_FOUND")
    runner = make_runner(FakeProvider(fail_at=3, error=error))
    job = runner.start(imitation_request(max_episodes=5))
    seen: list[object] = []
    with pytest.raises(ProviderError) as info:
        async for event in job.aevents():
            seen.append(event)
    assert info.value is error
    assert [e.episode for e in episodes_of(seen)] == [1, 2]
    assert runner.slots.free == 1


async def test_crash_in_the_provider_is_raised_and_frees_the_slot() -> None:
    runner = make_runner(FakeProvider(fail_at=1, error=ZeroDivisionError("x")))
    with pytest.raises(ZeroDivisionError):
        await read_all(runner.start(imitation_request()))
    assert runner.slots.free == 1
    assert runner.wait_idle(TIMEOUT)


def _skip_episode_two(episode: episode_pb2.Episode) -> episode_pb2.Episode:
    if episode.episode >= 2:
        episode.episode += 1
    return episode


async def test_contract_violation_is_logged_and_raised(caplog: pytest.LogCaptureFixture) -> None:
    runner = make_runner(FakeProvider(tamper=_skip_episode_two))
    job = runner.start(imitation_request("run-bad", max_episodes=5))
    with caplog.at_level(logging.ERROR), pytest.raises(contract.ContractViolation) as info:
        await read_all(job)
    assert info.value.rule == "sequence"
    lines = [r.getMessage() for r in caplog.records if "CONTRACT VIOLATION" in r.getMessage()]
    assert lines and lines[0].startswith("CONTRACT VIOLATION run run-bad rule sequence")
    assert runner.wait_idle(TIMEOUT)
    assert runner.slots.free == 1


async def test_stream_that_ends_without_done_is_a_violation() -> None:
    class Short(FakeProvider):
        def run(self, job):  # type: ignore[no-untyped-def]
            yield EpisodeCounter(job.config.max_episodes).make(0.5)

    runner = make_runner(Short())
    with pytest.raises(contract.ContractViolation) as info:
        await read_all(runner.start(imitation_request(max_episodes=3)))
    assert info.value.rule == "done"


async def test_full_channel_blocks_the_provider_until_read() -> None:
    """Flow control: a handler that does not read keeps the provider from running ahead."""
    produced: list[int] = []
    blocked = threading.Event()

    class Counting(FakeProvider):
        def run(self, job):  # type: ignore[no-untyped-def]
            for episode in super().run(job):
                produced.append(episode.episode)
                if len(produced) == 2:
                    blocked.set()
                yield episode

    runner = make_runner(Counting(), queue_size=2)
    job = runner.start(imitation_request(max_episodes=50))
    assert blocked.wait(TIMEOUT)
    # Without a grant, a job runs at most queue_size episodes ahead of its stream: the third
    # is made only once the handler has read.
    time.sleep(0.2)
    assert produced == [1, 2]
    assert runner.active_jobs == 1
    episodes = episodes_of(await read_all(job))
    assert len(episodes) == 50 and produced == list(range(1, 51))


async def test_cancel_stops_the_provider_within_one_episode() -> None:
    fake = FakeProvider()
    runner = make_runner(fake, queue_size=1)
    job = runner.start(imitation_request(max_episodes=5000))
    events = job.aevents()
    await anext(events)
    assert runner.cancel_job("run-1") <= 2
    assert fake.finished.wait(TIMEOUT)
    assert runner.wait_idle(TIMEOUT)
    assert fake.jobs[0].stop_event.is_set()
    # What is left is at most the one episode made ahead; the stream then ends cancelled.
    left: list[object] = []
    with pytest.raises(contract_errors.JobCancelled):
        async for event in events:
            left.append(event)
    assert len(episodes_of(left)) <= 1
    assert runner.live_jobs == 0


async def test_shutdown_ends_streams_with_shutting_down_and_refuses_new_jobs() -> None:
    fake = FakeProvider(hold_after=1)
    runner = make_runner(fake, slots=2, heartbeat_s=0.05)
    job = runner.start(imitation_request(max_episodes=10))
    events = job.aevents()
    first = await anext(events)
    assert isinstance(first, episode_pb2.Episode)
    runner.shutdown()
    with pytest.raises(ShuttingDown):
        await rest(events)
    with pytest.raises(ShuttingDown):
        runner.start(imitation_request("run-2"))
    assert runner.wait_idle(TIMEOUT)
    assert runner.slots.free == 2


def test_capabilities_report_slots_and_versions() -> None:
    runner = JobRunner(
        ProviderRegistry({"imitation": FakeProvider()}),
        SlotPool(3),
        RunnerSettings(device="cuda:0", device_description="cuda:0 Fake GPU"),
        server_version="9.9",
    )
    caps = runner.capabilities()
    assert caps.providers == ("imitation",)
    assert caps.device == "cuda:0 Fake GPU"
    assert (caps.slots_total, caps.slots_free) == (3, 3)
    assert caps.torch_version  # installed in the dev environment
    assert caps.trl_version
    assert caps.server_version == "9.9"


def test_core_imports_neither_grpc_nor_torch() -> None:
    code = (
        "import sys\n"
        "import trainer_service.core.jobs, trainer_service.core.errors, trainer_service.providers\n"
        "print(sorted(m for m in ('grpc', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
