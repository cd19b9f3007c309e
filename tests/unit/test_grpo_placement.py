"""A job whose ranks span trainers, in the trainer's core: which placements a ``Train`` request
may carry (every bad field named, ``INVALID_ARGUMENT`` with the run id), the slots a share
takes, and how a job runs its share: rank 0's stream sends the rendezvous after ``resumed`` and
before any episode; another trainer's share produces no episode and ends OK, restores exactly
the checkpoint it is given or fails, and never trains from scratch beside a resumed rank 0.

A fake provider registered as ``grpo`` stands for the real one (whose ranks the integration
tests run); the core is driven through its runner and streams, no server."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.fakes.waiting import TIMEOUT
from tests.grpo_fixtures import tiny_grpo_task
from trainer_service.__main__ import parse_args
from trainer_service.core.admission import check_request
from trainer_service.core.checkpointing import checkpoint_message
from trainer_service.core.errors import InvalidRequest, NoFreeSlot
from trainer_service.core.jobs import Heartbeat, JobRunner, RunnerSettings
from trainer_service.core.observe import JobOutcome
from trainer_service.core.placement import Placement, placement_of, split_host_port
from trainer_service.core.provider import (
    CheckpointUnusable,
    EpisodeCounter,
    ProviderError,
    TrainJob,
)
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.providers.grpo import launch
from trainer_service.status import to_status
from trainer_service.testing import imitation_request
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointStore

ADDRESS = "10.1.2.3:29400"


def _request(
    run_id: str = "run-p",
    *,
    num_processes: int = 2,
    steps: int = 3,
    **placement: Any,
) -> trainer_service_pb2.TrainRequest:
    request = trainer_service_pb2.TrainRequest(
        run_id=run_id,
        task=tiny_grpo_task(num_processes=num_processes),
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=3),
    )
    if placement:
        request.placement.CopyFrom(trainer_service_pb2.JobPlacement(**placement))
    return request


def _fields(request: trainer_service_pb2.TrainRequest) -> list[str]:
    return [v.field for v in check_request(request)]


# -- the request's rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "placement",
    [
        {"world_size": 2, "first_rank": 0, "processes": 1},
        {"world_size": 2, "first_rank": 0, "processes": 2},  # a whole job placed on one trainer
        {"world_size": 2, "first_rank": 1, "processes": 1, "rendezvous": ADDRESS},
        {"world_size": 4, "first_rank": 1, "processes": 3, "rendezvous": "[fd00::7]:29400"},
        {"world_size": 4, "first_rank": 2, "processes": 2, "rendezvous": "trainer-0.lan:1"},
    ],
)
def test_placements_that_fit_the_task_pass(placement: dict[str, Any]) -> None:
    request = _request(num_processes=placement["world_size"], **placement)
    assert _fields(request) == []
    assert placement_of(request) == Placement(
        placement["world_size"],
        placement["first_rank"],
        placement["processes"],
        placement.get("rendezvous", ""),
    )


@pytest.mark.parametrize(
    ("placement", "fields"),
    [
        ({"world_size": 3, "first_rank": 0, "processes": 1}, ["placement.world_size"]),
        ({"world_size": 2, "first_rank": 0, "processes": 0}, ["placement.processes"]),
        (
            {"world_size": 2, "first_rank": -1, "processes": 1, "rendezvous": ADDRESS},
            ["placement.first_rank"],
        ),
        (
            {"world_size": 2, "first_rank": 1, "processes": 2, "rendezvous": ADDRESS},
            ["placement.processes"],
        ),
        (
            {"world_size": 2, "first_rank": 0, "processes": 1, "rendezvous": ADDRESS},
            ["placement.rendezvous"],
        ),
        ({"world_size": 2, "first_rank": 1, "processes": 1}, ["placement.rendezvous"]),
        (
            {"world_size": 2, "first_rank": 1, "processes": 1, "rendezvous": "10.1.2.3"},
            ["placement.rendezvous"],
        ),
        (
            {"world_size": 2, "first_rank": 1, "processes": 1, "rendezvous": "10.1.2.3:0"},
            ["placement.rendezvous"],
        ),
        (
            {"world_size": 2, "first_rank": 1, "processes": 1, "rendezvous": "fd00::7:29400"},
            ["placement.rendezvous"],
        ),
        (
            {"world_size": 5, "first_rank": 4, "processes": 2, "rendezvous": "x"},
            ["placement.world_size", "placement.processes", "placement.rendezvous"],
        ),
    ],
)
def test_each_bad_placement_field_is_named(placement: dict[str, Any], fields: list[str]) -> None:
    assert _fields(_request(**placement)) == fields


def test_an_unplaced_request_and_a_task_of_one_process_keep_their_rules() -> None:
    assert _fields(_request()) == []
    # num_processes 0 is one process: a placement of world 1 fits it.
    assert _fields(_request(num_processes=0, world_size=1, first_rank=0, processes=1)) == []
    assert _fields(_request(num_processes=0, world_size=0, first_rank=0, processes=1)) == [
        "placement.world_size",
        "placement.processes",
    ]


def test_only_a_grpo_job_spans_trainers() -> None:
    request = imitation_request("run-i")
    request.placement.CopyFrom(
        trainer_service_pb2.JobPlacement(world_size=1, first_rank=0, processes=1)
    )
    assert _fields(request) == ["placement"]


def test_host_port_parsing() -> None:
    assert split_host_port("127.0.0.1:29400") == ("127.0.0.1", 29400)
    assert split_host_port("[::1]:5") == ("::1", 5)
    assert split_host_port("trainer-0:65535") == ("trainer-0", 65535)
    for bad in ("", ":5", "host", "host:", "host:65536", "::1:5", "a b:5", "[::1]"):
        assert split_host_port(bad) is None, bad


def test_the_rendezvous_host_flag_names_one_address_of_this_machine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_args([], environ={}).rendezvous_host == "127.0.0.1"
    assert parse_args(["--rendezvous-host", "10.0.0.5"], environ={}).rendezvous_host == "10.0.0.5"
    environ = {"TRAINWIRE_TRAINER_RENDEZVOUS_HOST": "10.0.0.6"}
    assert parse_args([], environ=environ).rendezvous_host == "10.0.0.6"
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(SystemExit):
            parse_args(["--rendezvous-host", wildcard], environ={})
        assert "rendezvous host" in capsys.readouterr().err
    # The ranks' collectives use the interface that owns it; one that no interface owns
    # cannot take part in such a job.
    assert launch.interface_of("127.0.0.1") is not None
    assert launch.interface_of("192.0.2.1") is None  # TEST-NET-1: nobody's
    job = TrainJob(
        "run-h",
        episode_pb2.TrainTask(),
        episode_pb2.TrainConfig(),
        "cpu",
        pathlib.Path("."),
        None,
        threading.Event(),
        rendezvous_host="192.0.2.1",
    )
    with pytest.raises(ProviderError, match=r"--rendezvous-host 192\.0\.2\.1 is not an address"):
        launch.meeting_env(job, "192.0.2.1:29400", "gloo")
    loopback = dataclasses.replace(job, rendezvous_host="127.0.0.1")
    assert launch.meeting_env(loopback, "127.0.0.1:29400", "nccl") == {
        "GLOO_SOCKET_IFNAME": launch.interface_of("127.0.0.1"),
        "NCCL_SOCKET_IFNAME": launch.interface_of("127.0.0.1"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }


# -- through the runner -----------------------------------------------------------------------


class PlacedProvider:
    """A ``grpo`` provider for placed jobs: rank 0's share announces a rendezvous and yields
    its episodes; another share yields nothing and returns once released (or stopped)."""

    def __init__(self, fail: BaseException | None = None, announce: bool = True) -> None:
        self.jobs: list[TrainJob] = []
        self.release = threading.Event()
        self.share_started = threading.Event()
        self.fail = fail  #: raised by rank 0's share before its first episode
        self.announce = announce  #: ... after announcing its rendezvous, or before

    def run(self, job: TrainJob) -> Iterator[episode_pb2.Episode]:
        self.jobs.append(job)
        placement = job.placement
        if placement is not None and not placement.hosts_rendezvous:
            self.share_started.set()
            while not (self.release.wait(0.01) or job.stop_event.is_set()):
                pass
            return
        if placement is not None and self.announce:
            job.announce_rendezvous(ADDRESS)
        if self.fail is not None:
            raise self.fail
        counter = EpisodeCounter(job.config.max_episodes, job.resume)
        while not counter.finished and not job.stop_event.is_set():
            yield counter.make(0.5)


def _runner(
    provider: object, tmp_path: pathlib.Path, slots: int = 2
) -> tuple[JobRunner, CheckpointStore]:
    store = CheckpointStore(str(tmp_path / "store"))
    runner = JobRunner(
        ProviderRegistry({"grpo": provider}),
        SlotPool(slots),
        RunnerSettings(heartbeat_s=0.05, scratch_dir=tmp_path / "scratch"),
        checkpoint_store=store,
    )
    return runner, store


def _events(runner: JobRunner, request: trainer_service_pb2.TrainRequest) -> list[Any]:
    """Every event of a new job's stream, heartbeats as ``"heartbeat"``; raises its failure."""
    stream = runner.start(request)

    async def read() -> list[Any]:
        out: list[Any] = []
        async for event in stream.aevents():
            out.append("heartbeat" if isinstance(event, Heartbeat) else event)
        return out

    try:
        return asyncio.run(asyncio.wait_for(read(), TIMEOUT))
    finally:
        runner.detach(stream)


def _kinds(events: list[Any]) -> list[str]:
    kinds = []
    for event in events:
        if event == "heartbeat":
            continue
        kind = type(event).__name__
        kinds.append(f"{kind} {event.episode}" if kind == "Episode" else kind)
    return kinds


def _checkpoint(
    store: CheckpointStore, tmp_path: pathlib.Path, run_id: str, episode: int
) -> trainer_service_pb2.CheckpointRef:
    files = tmp_path / f"files-{episode}"
    files.mkdir()
    (files / "state.json").write_text("{}")
    info = store.put(run_id, episode, files, {"best_reward": 0.25})
    return trainer_service_pb2.CheckpointRef(run_id=run_id, checkpoint=checkpoint_message(info))


def test_a_bad_placement_is_invalid_argument_naming_the_run_and_each_field(
    tmp_path: pathlib.Path,
) -> None:
    runner, _ = _runner(PlacedProvider(), tmp_path)
    request = _request("run-bad", world_size=3, first_rank=2, processes=2, rendezvous="nowhere")
    with pytest.raises(InvalidRequest) as info:
        runner.start(request)
    status = to_status(info.value, request.run_id)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "run-bad" in status.details
    (details,) = [v for k, v in status.trailing_metadata if k == "grpc-status-details-bin"]
    bad = error_details_pb2.BadRequest()
    [detail] = [d for d in status_pb2.Status.FromString(details).details if d.Is(bad.DESCRIPTOR)]
    detail.Unpack(bad)
    assert [v.field for v in bad.field_violations] == [
        "placement.world_size",
        "placement.processes",
        "placement.rendezvous",
    ]
    assert runner.slots.free == 2


def test_a_share_takes_its_own_processes_slots_and_a_full_trainer_is_busy(
    tmp_path: pathlib.Path,
) -> None:
    provider = PlacedProvider()
    runner, _ = _runner(provider, tmp_path, slots=3)
    # A job of 4 processes, 2 of them here: 2 slots, not 4.
    share = runner.start(
        _request(
            "run-s", num_processes=4, world_size=4, first_rank=2, processes=2, rendezvous=ADDRESS
        )
    )
    assert provider.share_started.wait(TIMEOUT)
    assert runner.slots.free == 1
    with pytest.raises(NoFreeSlot) as busy:
        runner.start(
            _request(
                "run-t",
                num_processes=4,
                world_size=4,
                first_rank=1,
                processes=2,
                rendezvous=ADDRESS,
            )
        )
    status = to_status(busy.value, "run-t")
    assert status.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "SLOTS_BUSY" in repr(
        status.trailing_metadata
    )
    # More processes than the trainer has slots could never start: a bad request.
    with pytest.raises(InvalidRequest) as too_many:
        runner.start(_request("run-u", num_processes=4, world_size=4, first_rank=0, processes=4))
    assert [v.field for v in too_many.value.violations] == ["placement.processes"]
    runner.cancel_job("run-s")
    runner.detach(share)
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 3


def test_rank_0s_stream_sends_the_rendezvous_before_any_episode(tmp_path: pathlib.Path) -> None:
    runner, _ = _runner(PlacedProvider(), tmp_path)
    events = _events(runner, _request("run-0", world_size=2, first_rank=0, processes=1))
    assert _kinds(events) == ["Rendezvous", "Episode 1", "Episode 2", "Episode 3"]
    assert events[0].address == ADDRESS


def test_a_resumed_rank_0_sends_resumed_then_the_rendezvous_then_its_episodes(
    tmp_path: pathlib.Path,
) -> None:
    provider = PlacedProvider()
    runner, store = _runner(provider, tmp_path)
    request = _request("run-r", steps=4, world_size=2, first_rank=0, processes=1)
    request.resume_from.append(_checkpoint(store, tmp_path, "run-r", 2))
    events = _events(runner, request)
    assert _kinds(events) == ["Resumed", "Rendezvous", "Episode 3", "Episode 4"]
    assert events[0].checkpoint.checkpoint.episode == 2
    assert store.episodes("run-r") == [2]


def test_a_rank_0_whose_checkpoint_fails_after_the_rendezvous_fails_instead_of_skipping_it(
    tmp_path: pathlib.Path,
) -> None:
    # The other trainers joined on that checkpoint: trying the next one would split the job.
    provider = PlacedProvider(fail=CheckpointUnusable("its optimizer state does not load"))
    runner, store = _runner(provider, tmp_path)
    request = _request("run-ru", steps=4, world_size=2, first_rank=0, processes=1)
    request.resume_from.append(_checkpoint(store, tmp_path, "run-ru", 2))
    request.resume_from.append(_checkpoint(store, tmp_path, "run-ru", 1))
    stream = runner.start(request)
    events: list[Any] = []

    async def read() -> None:
        async for event in stream.aevents():
            events.append(event)

    with pytest.raises(ProviderError) as info:
        asyncio.run(asyncio.wait_for(read(), TIMEOUT))
    runner.detach(stream)
    assert "episode 2" in info.value.user_message and "optimizer" in info.value.user_message
    assert _kinds(events) == ["Resumed", "Rendezvous"]
    assert len(provider.jobs) == 1


def test_a_resumed_job_that_fails_before_it_decided_ends_its_stream_with_the_failure(
    tmp_path: pathlib.Path,
) -> None:
    provider = PlacedProvider(fail=ProviderError("The model was not found."), announce=False)
    runner, store = _runner(provider, tmp_path)
    request = _request("run-rf", steps=4, world_size=2, first_rank=0, processes=1)
    request.resume_from.append(_checkpoint(store, tmp_path, "run-rf", 2))
    with pytest.raises(ProviderError, match="model was not found"):
        _events(runner, request)


def test_a_share_produces_no_episode_and_ends_ok(tmp_path: pathlib.Path) -> None:
    provider = PlacedProvider()
    provider.release.set()
    runner, store = _runner(provider, tmp_path)
    request = _request("run-share", world_size=2, first_rank=1, processes=1, rendezvous=ADDRESS)
    assert _kinds(_events(runner, request)) == []
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 2
    job = runner.job("run-share")
    assert job is None or job.outcome is JobOutcome.OK
    [ran] = provider.jobs
    assert ran.placement == Placement(2, 1, 1, ADDRESS) and ran.resume is None
    assert store.episodes("run-share") == []


def test_a_resumed_share_restores_exactly_the_checkpoint_it_is_given(
    tmp_path: pathlib.Path,
) -> None:
    provider = PlacedProvider()
    provider.release.set()
    runner, store = _runner(provider, tmp_path)
    request = _request(
        "run-rs", steps=5, world_size=2, first_rank=1, processes=1, rendezvous=ADDRESS
    )
    request.resume_from.append(_checkpoint(store, tmp_path, "run-rs", 3))
    request.resume_from.append(_checkpoint(store, tmp_path, "run-rs", 1))
    events = _events(runner, request)
    assert _kinds(events) == ["Resumed"]
    [ran] = provider.jobs
    assert ran.resume is not None and ran.resume.episode == 3
    assert store.episodes("run-rs") == [1, 3]  # neither written nor deleted by the share


def test_a_share_that_cannot_restore_its_checkpoint_fails_and_never_trains_from_scratch(
    tmp_path: pathlib.Path,
) -> None:
    provider = PlacedProvider()
    runner, store = _runner(provider, tmp_path)
    request = _request(
        "run-rm", steps=5, world_size=2, first_rank=1, processes=1, rendezvous=ADDRESS
    )
    missing = _checkpoint(store, tmp_path, "run-rm", 3)
    store.delete("run-rm", 3)
    request.resume_from.append(missing)
    request.resume_from.append(_checkpoint(store, tmp_path, "run-rm", 1))
    with pytest.raises(ProviderError) as info:
        _events(runner, request)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "episode 3" in info.value.user_message
    assert provider.jobs == []  # no rank started, from scratch or from another checkpoint
    assert runner.wait_idle(TIMEOUT) and runner.slots.free == 2
