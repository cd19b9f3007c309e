"""The TrainerService servicer (``grpc.aio``) on a real in-process server (port 0), with fake
providers behind a real job runner. (grpc_testing cannot host an aio servicer: the trainer's
surface is aio so that idle streams hold no thread.)"""

from __future__ import annotations

import asyncio
import pathlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.fakes.trainer_harness import running_trainer
from tests.fakes.waiting import TIMEOUT, until
from tests.grpo_fixtures import tiny_grpo_task
from trainer_service.core.provider import ProviderError
from trainer_service.providers import grpo
from trainer_service.servicer import TrainerServicer
from trainer_service.testing import FakeProvider, imitation_request
from trainwire import contract
from trainwire.v1 import episode_pb2, trainer_service_pb2

GRANT = "Grant"
CANCEL = "CancelJob"
_HARNESSES: list[Harness] = []


class Call:
    """A Train call read the way the tests want it: one response at a time, then the end."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._responses = iter(call)

    def take_response(self) -> trainer_service_pb2.TrainResponse:
        """The next response; ValueError once the RPC has ended."""
        try:
            return next(self._responses)
        except (StopIteration, grpc.RpcError):
            raise ValueError("the RPC ended") from None

    def termination(self) -> tuple[Any, grpc.StatusCode, str]:
        return self._call.trailing_metadata(), self._call.code(), self._call.details()

    def cancel(self) -> None:
        self._call.cancel()


class Harness:
    """A trainer server on port 0 with a fake provider (``running_trainer``), and a stub."""

    def __init__(
        self,
        provider: object,
        slots: int = 1,
        heartbeat_s: float = 5.0,
        detach_grace_s: float = 0.0,
    ) -> None:
        self._context = running_trainer(
            {"imitation": provider},
            slots=slots,
            warm_up=False,
            wait_idle=False,
            heartbeat_s=heartbeat_s,
            detach_grace_s=detach_grace_s,
        )
        running = self._context.__enter__()
        self.runner = running.runner
        self.server = running.server
        self.stub = running.stub
        self.channel = running.channel
        _HARNESSES.append(self)

    def train(self, request: trainer_service_pb2.TrainRequest) -> Call:
        return Call(self.stub.Train(request, timeout=TIMEOUT))

    def close(self) -> None:
        self._context.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _close_harnesses() -> Iterator[None]:
    yield
    while _HARNESSES:
        _HARNESSES.pop().close()


def take_all(rpc) -> tuple[list[trainer_service_pb2.TrainResponse], tuple]:  # type: ignore[no-untyped-def]
    """Reads responses until the RPC terminates; returns them and the termination."""
    responses = []
    while True:
        try:
            responses.append(rpc.take_response())
        except ValueError:  # grpc_testing: no more responses, the RPC terminated
            return responses, rpc.termination()


def rich_status(trailing_metadata) -> status_pb2.Status:  # type: ignore[no-untyped-def]
    values = [v for k, v in trailing_metadata if k == "grpc-status-details-bin"]
    assert len(values) == 1
    return status_pb2.Status.FromString(values[0])


def unpack(status: status_pb2.Status, message_type):  # type: ignore[no-untyped-def]
    found = []
    for detail in status.details:
        if detail.Is(message_type.DESCRIPTOR):
            message = message_type()
            detail.Unpack(message)
            found.append(message)
    return found


def test_full_stream_ends_ok_and_is_contract_clean() -> None:
    harness = Harness(FakeProvider())
    responses, (_, code, _) = take_all(harness.train(imitation_request(max_episodes=4)))
    checker = contract.StreamChecker("imitation", 4)
    for response in responses:
        checker.check(response.episode)
    checker.finish()
    assert code is grpc.StatusCode.OK
    assert harness.runner.slots.free == 1


def test_invalid_request_is_invalid_argument_with_bad_request() -> None:
    harness = Harness(FakeProvider())
    request = imitation_request("run-7", max_episodes=10_000_001)
    request.task.imitation.clip_name = "moonwalk"
    responses, (metadata, code, details) = take_all(harness.train(request))
    assert responses == []
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "run-7" in details and "config.max_episodes" in details
    status = rich_status(metadata)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    (bad,) = unpack(status, error_details_pb2.BadRequest)
    assert {v.field for v in bad.field_violations} == {
        "config.max_episodes",
        "task.imitation.clip_name",
    }


def test_second_job_with_one_slot_is_resource_exhausted() -> None:
    fake = FakeProvider(hold_after=1)
    harness = Harness(fake)
    first = harness.train(imitation_request("run-1"))
    assert first.take_response().episode.episode == 1
    responses, (metadata, code, details) = take_all(harness.train(imitation_request("run-2")))
    assert responses == []
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "run-2" in details
    (info,) = unpack(rich_status(metadata), error_details_pb2.ErrorInfo)
    assert (info.domain, info.reason) == ("trainwire", "SLOTS_BUSY")
    first.cancel()
    assert harness.runner.wait_idle(TIMEOUT)
    assert harness.runner.slots.free == 1


def test_heartbeats_carry_last_episode_and_phase() -> None:
    harness = Harness(FakeProvider(hold_after=1, phase="training"), heartbeat_s=0.05)
    rpc = harness.train(imitation_request(max_episodes=3))
    assert rpc.take_response().episode.episode == 1
    beats = [rpc.take_response() for _ in range(2)]
    for beat in beats:
        assert beat.WhichOneof("event") == "heartbeat"
        assert beat.heartbeat.last_episode == 1
        assert beat.heartbeat.phase == "training"
        assert beat.heartbeat.time.seconds > 0
    rpc.cancel()
    assert harness.runner.wait_idle(TIMEOUT)


def test_heartbeat_before_the_first_episode() -> None:
    harness = Harness(FakeProvider(hold_after=0, phase="loading"), heartbeat_s=0.05)
    rpc = harness.train(imitation_request())
    beat = rpc.take_response().heartbeat
    assert (beat.last_episode, beat.phase) == (0, "loading")
    rpc.cancel()
    assert harness.runner.wait_idle(TIMEOUT)


@pytest.mark.parametrize("code_name", ["FAILED_PRECONDITION", "NOT_FOUND"])
def test_provider_error_has_code_localized_message_and_error_info(code_name: str) -> None:
    error = ProviderError(
        "The dataset file is missing.",
        detail="/secret/path/data.jsonl: ENOENT",
        code=code_name,
        reason="DATASET_MISSING",
    )
    harness = Harness(FakeProvider(fail_at=2, error=error))
    responses, (metadata, code, details) = take_all(harness.train(imitation_request("run-9")))
    assert [r.episode.episode for r in responses] == [1]
    assert code is getattr(grpc.StatusCode, code_name)
    assert "run-9" in details and "The dataset file is missing." in details
    assert "/secret/path" not in details
    status = rich_status(metadata)
    (localized,) = unpack(status, error_details_pb2.LocalizedMessage)
    assert (localized.locale, localized.message) == ("en-US", "The dataset file is missing.")
    (info,) = unpack(status, error_details_pb2.ErrorInfo)
    assert (info.domain, info.reason) == ("trainwire", "DATASET_MISSING")
    assert info.metadata["run_id"] == "run-9"
    assert harness.runner.slots.free == 1


def test_unexpected_exception_is_internal_with_a_generic_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = Harness(FakeProvider(fail_at=1, error=KeyError("secret internals")))
    responses, (metadata, code, details) = take_all(harness.train(imitation_request("run-3")))
    assert responses == []
    assert code is grpc.StatusCode.INTERNAL
    assert details == "run run-3: Training stopped unexpectedly."
    (localized,) = unpack(rich_status(metadata), error_details_pb2.LocalizedMessage)
    assert localized.message == "Training stopped unexpectedly."
    logged = [r for r in caplog.records if r.exc_info and "run-3" in r.getMessage()]
    assert len(logged) == 1 and "secret internals" in str(logged[0].exc_info[1])
    assert harness.runner.slots.free == 1


def test_contract_violation_is_internal(caplog: pytest.LogCaptureFixture) -> None:
    def no_best(episode: episode_pb2.Episode) -> episode_pb2.Episode:
        episode.best_reward = 0.0
        return episode

    harness = Harness(FakeProvider(tamper=no_best))
    responses, (metadata, code, details) = take_all(harness.train(imitation_request("run-c")))
    assert responses == []  # the bad episode never goes out
    assert code is grpc.StatusCode.INTERNAL
    assert "run-c" in details
    (info,) = unpack(rich_status(metadata), error_details_pb2.ErrorInfo)
    assert info.reason == "CONTRACT_VIOLATION" and info.metadata["rule"] == "best_reward"
    assert any(
        r.getMessage().startswith("CONTRACT VIOLATION run run-c rule best_reward")
        for r in caplog.records
    )


def test_cancellation_stops_the_provider_and_frees_the_slot() -> None:
    fake = FakeProvider()
    harness = Harness(fake)
    rpc = harness.train(imitation_request(max_episodes=5000))
    assert rpc.take_response().episode.episode == 1
    rpc.cancel()
    assert fake.finished.wait(TIMEOUT)
    assert harness.runner.wait_idle(TIMEOUT)
    assert harness.runner.slots.free == 1
    assert fake.jobs[0].stop_event.is_set()


def unary(harness: Harness, method: str, request: Any) -> tuple[Any, Any, grpc.StatusCode, str]:
    """(response, trailing metadata, code, details) of a unary call."""
    try:
        response, call = getattr(harness.stub, method).with_call(request, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return None, exc.trailing_metadata(), exc.code(), exc.details()  # type: ignore[attr-defined]
    return response, call.trailing_metadata(), call.code(), call.details()


def test_a_broken_stream_keeps_its_job_for_a_reattach_and_cancel_job_ends_it() -> None:
    fake = FakeProvider()
    harness = Harness(fake, detach_grace_s=30.0)
    request = imitation_request(max_episodes=100)
    request.grant_through_episode = 2
    rpc = harness.train(request)
    assert rpc.take_response().episode.episode == 1
    rpc.cancel()  # the gateway went away
    assert not fake.finished.wait(0.2)
    assert harness.runner.live_jobs == 1
    response, _, code, _ = unary(harness, GRANT, trainer_service_pb2.GrantRequest(run_id="run-1"))
    assert code is grpc.StatusCode.OK and response.last_episode == 2
    again = imitation_request(max_episodes=100)
    again.attach_after_episode = 1
    again.grant_through_episode = 3
    rpc = harness.train(again)
    assert [rpc.take_response().episode.episode for _ in range(2)] == [2, 3]
    response, _, code, _ = unary(
        harness, CANCEL, trainer_service_pb2.CancelJobRequest(run_id="run-1")
    )
    assert code is grpc.StatusCode.OK and response.last_episode == 3
    _, (metadata, code, _) = take_all(rpc)
    assert code is grpc.StatusCode.CANCELLED
    (info,) = unpack(rich_status(metadata), error_details_pb2.ErrorInfo)
    assert info.reason == "JOB_CANCELLED"
    assert fake.finished.wait(TIMEOUT) and harness.runner.wait_idle(TIMEOUT)
    assert harness.runner.slots.free == 1


class _GatedOpen(FakeProvider):
    """A fake provider whose first ``validate`` (part of the runner's ``open``) waits for
    ``release``: a call can be cancelled while its job is still being opened."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validating = threading.Event()
        self.release = threading.Event()

    def validate(
        self,
        task: episode_pb2.TrainTask,
        data_roots: Sequence[pathlib.Path],
        reward_modules: Sequence[str] = (),
    ) -> list[contract.FieldViolation]:
        self.validating.set()
        assert self.release.wait(TIMEOUT), "the test never released open"
        return super().validate(task, data_roots, reward_modules)


class _NoContext:
    """A servicer context nobody should use: a cancelled call sets no status."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the cancelled call used its context ({name})")


async def _train_cancelled_during_open(
    harness: Harness, fake: _GatedOpen, request: trainer_service_pb2.TrainRequest
) -> None:
    """Runs a ``Train`` handler (on the harness's runner) and cancels it the way ``grpc.aio``
    does when the client goes away, while ``runner.open`` is blocked in its worker thread; then
    lets ``open`` finish and waits until the job it opened is no longer attached."""

    async def drain() -> None:
        async for _ in TrainerServicer(harness.runner).Train(request, _NoContext()):  # type: ignore[arg-type]
            raise AssertionError("a cancelled call sent a response")

    call = asyncio.ensure_future(drain())
    assert await asyncio.to_thread(fake.validating.wait, TIMEOUT)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    fake.release.set()  # open goes on: it starts the job of a call that is gone
    assert await asyncio.to_thread(fake.started.wait, TIMEOUT)

    def detached() -> bool:
        job = harness.runner.job(request.run_id)
        return job is None or not job.attached

    await until(detached, "the job of the cancelled call to be detached")


def test_a_job_opened_for_a_call_cancelled_meanwhile_is_dropped_without_a_grace() -> None:
    fake = _GatedOpen(hold_after=1)
    harness = Harness(fake)  # no detach grace: a detached job ends at once
    request = imitation_request(max_episodes=100)
    request.grant_through_episode = 2
    asyncio.run(_train_cancelled_during_open(harness, fake, request))
    assert fake.finished.wait(TIMEOUT) and harness.runner.wait_idle(TIMEOUT)
    assert harness.runner.live_jobs == 0 and harness.runner.slots.free == 1
    rpc = harness.train(request)  # the run trains again, not ALREADY_EXISTS
    assert rpc.take_response().episode.episode == 1
    rpc.cancel()
    assert harness.runner.wait_idle(TIMEOUT)


def test_a_job_opened_for_a_call_cancelled_meanwhile_is_kept_for_a_reattach() -> None:
    fake = _GatedOpen(hold_after=1)
    harness = Harness(fake, detach_grace_s=30.0)
    request = imitation_request(max_episodes=100)
    request.grant_through_episode = 2
    asyncio.run(_train_cancelled_during_open(harness, fake, request))
    assert harness.runner.live_jobs == 1 and not fake.finished.is_set()
    again = imitation_request(max_episodes=100)
    again.attach_after_episode = 0
    rpc = harness.train(again)
    assert rpc.take_response().episode.episode == 1
    response, _, code, _ = unary(
        harness, CANCEL, trainer_service_pb2.CancelJobRequest(run_id="run-1")
    )
    assert code is grpc.StatusCode.OK and response.last_episode == 1
    _, (_, code, _) = take_all(rpc)
    assert code is grpc.StatusCode.CANCELLED
    assert fake.finished.wait(TIMEOUT) and harness.runner.wait_idle(TIMEOUT)
    assert harness.runner.slots.free == 1


@pytest.mark.parametrize(
    ("method", "request_", "code", "reason"),
    [
        (GRANT, trainer_service_pb2.GrantRequest(run_id="ghost"), "NOT_FOUND", "JOB_NOT_FOUND"),
        (CANCEL, trainer_service_pb2.CancelJobRequest(run_id="ghost"), "NOT_FOUND", None),
    ],
)
def test_grant_and_cancel_of_an_unknown_run(method, request_, code, reason) -> None:  # type: ignore[no-untyped-def]
    _, metadata, status_code, details = unary(Harness(FakeProvider()), method, request_)
    assert status_code.name == code
    assert "ghost" in details
    (info,) = unpack(rich_status(metadata), error_details_pb2.ErrorInfo)
    assert info.reason == (reason or "JOB_NOT_FOUND")


def test_attach_statuses() -> None:
    harness = Harness(FakeProvider(hold_after=1), detach_grace_s=30.0)
    missing = imitation_request("run-9")
    missing.attach_after_episode = 0
    _, (metadata, code, _) = take_all(harness.train(missing))
    assert code is grpc.StatusCode.NOT_FOUND
    first = harness.train(imitation_request())
    assert first.take_response().episode.episode == 1
    _, (metadata, code, _) = take_all(harness.train(imitation_request()))
    assert code is grpc.StatusCode.ALREADY_EXISTS
    (info,) = unpack(rich_status(metadata), error_details_pb2.ErrorInfo)
    assert info.reason == "JOB_EXISTS"
    ahead = imitation_request()
    ahead.attach_after_episode = 7
    _, (metadata, code, details) = take_all(harness.train(ahead))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "episode 7" in details
    second = imitation_request()
    second.attach_after_episode = 1
    attached = harness.train(second)
    _, (_, code, _) = take_all(first)
    assert code is grpc.StatusCode.ABORTED  # replaced by the re-attach
    unary(harness, CANCEL, trainer_service_pb2.CancelJobRequest(run_id="run-1"))
    _, (_, code, _) = take_all(attached)
    assert code is grpc.StatusCode.CANCELLED
    assert harness.runner.wait_idle(TIMEOUT)


def test_get_capabilities() -> None:
    harness = Harness(FakeProvider(), slots=2)
    response, _, code, _ = unary(
        harness, "GetCapabilities", trainer_service_pb2.GetCapabilitiesRequest()
    )
    assert code is grpc.StatusCode.OK
    assert list(response.providers) == ["imitation"]
    assert (response.slots_total, response.slots_free) == (2, 2)
    assert response.device == "cpu"
    assert response.torch_version and response.trl_version


def test_requests_that_do_not_parse_and_bad_run_ids_are_invalid_argument() -> None:
    harness = Harness(FakeProvider())
    raw = harness.channel.unary_unary("/trainwire.v1.TrainerService/Grant")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff garbage", timeout=TIMEOUT)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert info.value.details() == "the request is not a valid trainwire.v1.GrantRequest"  # type: ignore[attr-defined]
    stream = harness.channel.unary_stream("/trainwire.v1.TrainerService/Train")
    with pytest.raises(grpc.RpcError) as info:
        list(stream(b"\x0a\xff", timeout=TIMEOUT))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    for bad in ("x" * 3000, "run\nERROR forged"):
        _, metadata, code, details = unary(
            harness, GRANT, trainer_service_pb2.GrantRequest(run_id=bad, through_episode=1)
        )
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert len(details) < 200 and "\n" not in details
        responses, (metadata, code, details) = take_all(harness.train(imitation_request(bad)))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and responses == []
        assert len(details) < 200 and "\n" not in details
        (bad_request,) = unpack(rich_status(metadata), error_details_pb2.BadRequest)
        assert [v.field for v in bad_request.field_violations] == ["run_id"]


def test_an_invalid_task_carries_a_message_for_users() -> None:
    flat = contract.FieldViolation("task.imitation.clip", "the rig lies flat in frame 0")
    harness = Harness(FakeProvider(violations=[flat]))
    responses, (metadata, code, _) = take_all(harness.train(imitation_request("run-flat")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and responses == []
    (localized,) = unpack(rich_status(metadata), error_details_pb2.LocalizedMessage)
    assert localized.message == (
        "The trainer refused this task: task.imitation.clip: the rig lies flat in frame 0"
    )


class _GrpoPaths(FakeProvider):
    """A grpo provider that checks its tasks as the real one does and then trains nothing."""

    validate = staticmethod(grpo.validate)  # type: ignore[assignment]


def _grpo_request(dataset: str) -> trainer_service_pb2.TrainRequest:
    return trainer_service_pb2.TrainRequest(
        run_id="run-roots",
        task=tiny_grpo_task("models/m", dataset),
        config=episode_pb2.TrainConfig(max_episodes=3),
    )


@pytest.fixture
def two_roots(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A first data root and a shared one; the first links into the shared one and elsewhere."""
    first, shared = tmp_path / "data", tmp_path / "lustre"
    (first / "models" / "m").mkdir(parents=True)
    (shared / "sets").mkdir(parents=True)
    (shared / "sets" / "big.jsonl").write_text("{}\n")
    (tmp_path / "elsewhere.jsonl").write_text("{}\n")
    (first / "big.jsonl").symlink_to(shared / "sets" / "big.jsonl")
    (first / "elsewhere.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    return first, shared


def _admits(roots: tuple[pathlib.Path, ...], dataset: str) -> grpc.StatusCode | list[str]:
    """Whether a trainer with ``roots`` admits a GRPO task reading ``dataset``: the fields a
    refusal names, or the code of an admitted job's stream once cancelled."""
    provider = _GrpoPaths(hold_after=0)
    with running_trainer(
        {"grpo": provider}, warm_up=False, data_roots=roots, heartbeat_s=0.05
    ) as trainer:
        call = trainer.stub.Train(_grpo_request(dataset), timeout=TIMEOUT)
        try:
            assert next(call).WhichOneof("event") == "heartbeat"  # admitted: the job runs
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
            (bad,) = unpack(rich_status(exc.trailing_metadata()), error_details_pb2.BadRequest)
            assert provider.runs == 0
            return [v.field for v in bad.field_violations]
        assert provider.jobs[0].data_roots == roots
        call.cancel()
        assert trainer.runner.wait_idle(TIMEOUT)
        return call.code()


def test_grpo_paths_are_checked_against_every_data_root(
    two_roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    # A path in the first root that leads into the shared root trains only when that root is
    # the trainer's too; one that leads outside every root never does.
    assert _admits(two_roots, "big.jsonl") is grpc.StatusCode.CANCELLED
    assert _admits(two_roots[:1], "big.jsonl") == ["task.grpo.dataset_path"]
    assert _admits(two_roots, "elsewhere.jsonl") == ["task.grpo.dataset_path"]


def test_an_absolute_dataset_path_inside_any_data_root_is_admitted_and_outside_refused(
    two_roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    dataset = str(two_roots[1] / "sets" / "big.jsonl")
    assert _admits(two_roots, dataset) is grpc.StatusCode.CANCELLED
    assert _admits(two_roots[:1], dataset) == ["task.grpo.dataset_path"]
    outside = str(two_roots[1].parent / "elsewhere.jsonl")
    assert _admits(two_roots, outside) == ["task.grpo.dataset_path"]
