"""The trainer service over real gRPC: in-process servers on port 0, and the CLI in a subprocess."""

from __future__ import annotations

import pathlib
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from tests.fakes.gateway_harness import trainer_process
from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.server import SERVICE_NAME, build_server
from trainer_service.testing import FakeProvider, imitation_request
from trainwire import contract
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture
def imitation_server() -> Iterator[RunningTrainer]:
    with running_trainer({"imitation": "trainer_service.providers.imitation"}) as running:
        yield running


def job_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trainwire-job-")]


def test_full_imitation_run_is_streamed_and_contract_clean(
    imitation_server: RunningTrainer,
) -> None:
    request = imitation_request("run-full", max_episodes=60, seed=3)
    checker = contract.StreamChecker.for_task(request.task, request.config, request.run_id)
    episodes = []
    for response in imitation_server.stub.Train(request, timeout=JOB_TIMEOUT):
        if response.WhichOneof("event") == "episode":
            checker.check(response.episode)
            episodes.append(response.episode)
    checker.finish()
    assert len(episodes) == 60 and episodes[-1].done
    with_detail = [e.episode for e in episodes if e.WhichOneof("detail") == "imitation"]
    assert with_detail == [10, 20, 30, 40, 50, 60]
    detail = episodes[-1].imitation
    assert (detail.frame_count, detail.joint_count) == (60, 11)
    assert len(detail.angles) == 60 * 11
    for name in ("reward_std", "greedy_reward", "pose_error", "policy_std", "loss"):
        assert name in episodes[-1].metrics
    assert episodes[-1].reward > episodes[0].reward
    assert imitation_server.capabilities().slots_free == 1


def test_cancel_mid_run_frees_the_slot(imitation_server: RunningTrainer) -> None:
    call = imitation_server.stub.Train(
        imitation_request("run-cancel", max_episodes=5000), timeout=JOB_TIMEOUT
    )
    received = [next(call) for _ in range(5)]
    assert received[-1].episode.episode == 5
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() is grpc.StatusCode.CANCELLED
    assert imitation_server.runner.wait_idle(TIMEOUT)
    caps = imitation_server.capabilities()
    assert (caps.slots_total, caps.slots_free) == (1, 1)
    # The freed slot takes the next job.
    done = list(
        imitation_server.stub.Train(
            imitation_request("run-next", max_episodes=3), timeout=JOB_TIMEOUT
        )
    )
    assert done[-1].episode.done


def test_two_concurrent_jobs_with_one_slot(imitation_server: RunningTrainer) -> None:
    first = imitation_server.stub.Train(
        imitation_request("run-a", max_episodes=5000), timeout=JOB_TIMEOUT
    )
    assert next(first).episode.episode == 1
    second = imitation_server.stub.Train(imitation_request("run-b"), timeout=JOB_TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        next(second)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "run-b" in info.value.details()
    assert rpc_status.from_call(info.value) is not None
    assert imitation_server.capabilities().slots_free == 0
    first.cancel()
    assert imitation_server.runner.wait_idle(TIMEOUT)


def test_provider_error_details_reach_the_client() -> None:
    from trainer_service.core.provider import ProviderError

    error = ProviderError("Model not found.", detail="x", code="NOT_FOUND", reason="NO_MODEL")
    with running_trainer({"imitation": FakeProvider(fail_at=1, error=error)}) as running:
        call = running.stub.Train(imitation_request("run-e"), timeout=JOB_TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        status = rpc_status.from_call(info.value)
        assert status is not None and status.message == "run run-e: Model not found."
        assert len(status.details) == 2


def test_200_start_cancel_cycles_leave_no_slot_or_thread_behind() -> None:
    fake = FakeProvider(hold_after=1)
    with running_trainer({"imitation": fake}, slots=2) as running:
        for i in range(200):
            call = running.stub.Train(imitation_request(f"run-{i}"), timeout=JOB_TIMEOUT)
            assert next(call).episode.episode == 1
            call.cancel()
            # Wait for the job thread to stop before the next cycle: the client's cancel
            # returns before the server has seen it.
            assert running.runner.wait_idle(TIMEOUT)
        assert fake.runs == 200
        caps = running.capabilities()
        assert (caps.slots_total, caps.slots_free) == (2, 2)
        assert job_threads() == []
        assert running.runner.active_jobs == 0


def test_health_and_reflection() -> None:
    with running_trainer({"imitation": FakeProvider()}) as running:
        health = health_pb2_grpc.HealthStub(running.channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(running.channel)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
        running.server.stop(None).wait(TIMEOUT)
        # After stop the port is closed; health is NOT_SERVING in the servicer.
        assert running.server.health_status("") == health_pb2.HealthCheckResponse.NOT_SERVING


def test_cli_prints_its_address_serves_and_exits_on_sigterm(tmp_path: pathlib.Path) -> None:
    flags = ("--heartbeat", "0.5", "--data-root", str(tmp_path))
    with trainer_process(tmp_path / "t.log", *flags, slots=2) as (proc, address):
        with grpc.insecure_channel(address) as channel:
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            caps = stub.GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
            )
            assert "imitation" in caps.providers
            assert (caps.device, caps.slots_total) == ("cpu", 2)
            call = stub.Train(imitation_request("run-cli", max_episodes=5000), timeout=JOB_TIMEOUT)
            first = next(r for r in call if r.WhichOneof("event") == "episode")
            assert first.episode.episode == 1
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        # Generous: interpreter teardown with torch takes seconds on a loaded machine.
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 30


def test_health_is_not_serving_until_the_providers_are_ready() -> None:
    config = TrainerConfig(host="127.0.0.1", port=0)
    runner = JobRunner(ProviderRegistry({"imitation": FakeProvider()}), SlotPool(1))
    server, port = build_server(config, runner)
    assert port > 0
    assert server.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
    server.start()
    try:
        assert server.ready.wait(TIMEOUT)
        assert server.health_status() == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None).wait(TIMEOUT)


def test_a_hundred_idle_streams_do_not_starve_the_trainer() -> None:
    """Health watches and reflection streams that stay open hold no thread (grpc.aio)."""
    with running_trainer({"imitation": FakeProvider()}, slots=1) as running:
        health = health_pb2_grpc.HealthStub(running.channel)
        reflect = reflection_pb2_grpc.ServerReflectionStub(running.channel)
        blocker = threading.Event()

        def idle_requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            blocker.wait()

        watches = [
            health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120) for _ in range(80)
        ]
        reflections = [
            reflect.ServerReflectionInfo(idle_requests(), timeout=120) for _ in range(20)
        ]
        try:
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            for stream in reflections:
                assert next(stream).list_services_response.service
            started = time.monotonic()
            caps = running.capabilities()
            assert caps.slots_free == 1
            call = running.stub.Train(
                imitation_request("run-busy", max_episodes=20), timeout=JOB_TIMEOUT
            )
            episodes = [r.episode for r in call if r.WhichOneof("event") == "episode"]
            assert [e.episode for e in episodes] == list(range(1, 21))
            # Generous: what matters is that the calls were served at all (the old fixed pool of
            # slots + 8 threads hung after nine idle streams).
            assert time.monotonic() - started < 20
        finally:
            blocker.set()
            for watch in watches:
                watch.cancel()
            for stream in reflections:
                stream.cancel()
