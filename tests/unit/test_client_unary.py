"""GatewayClient's unary calls over a grpc_testing channel: deadlines, typed errors, rich
details; and the request builders."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import grpc_testing
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from tests.fakes.recording_channel import RecordingChannel
from tests.fakes.waiting import TIMEOUT
from trainwire import client as tc
from trainwire import contract, motion
from trainwire.v1 import episode_pb2, gateway_service_pb2

# A client thread that dies before calling leaves take_unary_unary waiting forever: fail fast.
pytestmark = pytest.mark.timeout(20)

_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
_STATUS_KEY = "grpc-status-details-bin"


@pytest.fixture
def channel() -> grpc_testing.Channel:
    return grpc_testing.channel([_SERVICE], grpc_testing.strict_real_time())


@pytest.fixture
def recorder(channel: grpc_testing.Channel) -> RecordingChannel:
    return RecordingChannel(channel)


@pytest.fixture
def client(recorder: RecordingChannel) -> Iterator[tc.GatewayClient]:
    with tc.GatewayClient(channel=recorder, timeout=4.0) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _serve_one(
    channel: grpc_testing.Channel,
    method: str,
    response: Any = None,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    details: str = "",
    trailing: tuple[tuple[str, bytes], ...] = (),
) -> Any:
    """Answers the next call of ``method``; returns its request."""
    _, request, rpc = channel.take_unary_unary(_SERVICE.methods_by_name[method])
    rpc.terminate(response, trailing, code, details)
    return request


def _rich(code: grpc.StatusCode, message: str, *details: Any) -> tuple[tuple[str, bytes], ...]:
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return ((_STATUS_KEY, status.SerializeToString()),)


def _run(run_id: str = "r-1", state: int = gateway_service_pb2.Run.State.STATE_RUNNING) -> Any:
    return gateway_service_pb2.Run(id=run_id, state=state)  # type: ignore[arg-type]


_CALLS: list[tuple[str, Callable[[tc.GatewayClient], Any], str, Any]] = [
    ("CreateRun", lambda c: c.create_run(tc.imitation_task()), "CreateRunResponse", None),
    ("GetRun", lambda c: c.get_run("r-1"), "GetRunResponse", "r-1"),
    ("ListRuns", lambda c: c.list_runs(), "ListRunsResponse", None),
    ("PauseRun", lambda c: c.pause_run("r-1"), "PauseRunResponse", "r-1"),
    ("ResumeRun", lambda c: c.resume_run("r-1"), "ResumeRunResponse", "r-1"),
    ("StopRun", lambda c: c.stop_run("r-1"), "StopRunResponse", "r-1"),
    ("SetRunSpeed", lambda c: c.set_run_speed("r-1", 2.0), "SetRunSpeedResponse", "r-1"),
    ("DeleteRun", lambda c: c.delete_run("r-1"), "DeleteRunResponse", "r-1"),
]


@pytest.mark.parametrize(("method", "call", "response", "run_id"), _CALLS)
def test_every_unary_call_carries_the_client_deadline(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    method: str,
    call: Callable[[tc.GatewayClient], Any],
    response: str,
    run_id: str | None,
) -> None:
    future = pool.submit(call, client)
    message = getattr(gateway_service_pb2, response)()
    if response == "ListRunsResponse":
        message.runs.append(_run())
    else:
        message.run.CopyFrom(_run())
    request = _serve_one(channel, method, message)
    result = future.result(timeout=TIMEOUT)
    assert recorder.calls == [(f"/trainwire.v1.GatewayService/{method}", 4.0)]
    if run_id is not None:
        assert request.run_id == run_id
    assert (result[0] if isinstance(result, list) else result).id == "r-1"


def test_a_per_call_timeout_overrides_the_default(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
) -> None:
    future = pool.submit(lambda: client.get_run("r-1", timeout=0.5))
    _serve_one(channel, "GetRun", gateway_service_pb2.GetRunResponse(run=_run()))
    future.result(timeout=TIMEOUT)
    assert recorder.calls[0][1] == 0.5


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, tc.NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, tc.InvalidArgument),
        (grpc.StatusCode.FAILED_PRECONDITION, tc.FailedPrecondition),
        (grpc.StatusCode.UNAVAILABLE, tc.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, tc.DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, tc.Internal),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, tc.ResourceExhausted),
        (grpc.StatusCode.ALREADY_EXISTS, tc.AlreadyExists),
        (grpc.StatusCode.UNIMPLEMENTED, tc.Unimplemented),
    ],
)
def test_status_codes_map_to_typed_errors_raised_from_the_rpc_error(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    cls: type[tc.TrainwireError],
) -> None:
    future = pool.submit(client.pause_run, "r-7")
    _serve_one(channel, "PauseRun", code=code, details=f"run r-7: {code.name.lower()}")
    with pytest.raises(cls) as caught:
        future.result(timeout=TIMEOUT)
    err = caught.value
    assert isinstance(err, tc.TrainwireError)
    assert err.code == code
    assert err.message == f"run r-7: {code.name.lower()}"
    assert str(err) == f"{code.name}: run r-7: {code.name.lower()}"
    assert isinstance(err.__cause__, grpc.RpcError)
    assert err.field_violations == ()


def test_bad_request_details_become_field_violations(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    violations = [
        contract.FieldViolation("task.imitation.group_size", "1; need 2..1024"),
        contract.FieldViolation("config.max_episodes", "0; need 1..10000000"),
    ]
    message = "invalid run: " + contract.describe_violations(violations)
    trailing = _rich(
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        contract.bad_request(violations),
        error_details_pb2.ErrorInfo(reason="BAD_TASK", domain="trainwire", metadata={"a": "b"}),
        error_details_pb2.LocalizedMessage(locale="en-US", message="Fix the task."),
    )
    future = pool.submit(client.create_run, tc.imitation_task(), tc.train_config(0))
    _serve_one(channel, "CreateRun", None, grpc.StatusCode.INVALID_ARGUMENT, message, trailing)
    with pytest.raises(tc.InvalidArgument) as caught:
        future.result(timeout=TIMEOUT)
    err = caught.value
    assert err.field_violations == tuple(violations)
    assert err.reason == "BAD_TASK"
    assert err.metadata == {"a": "b"}
    assert err.localized_message == "Fix the task."


def test_details_that_contradict_the_call_are_ignored(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    trailing = _rich(
        grpc.StatusCode.INVALID_ARGUMENT,
        "another message",
        contract.bad_request([contract.FieldViolation("x", "y")]),
    )
    future = pool.submit(client.get_run, "r-1")
    _serve_one(channel, "GetRun", None, grpc.StatusCode.NOT_FOUND, "run r-1 not found", trailing)
    with pytest.raises(tc.NotFound) as caught:
        future.result(timeout=TIMEOUT)
    assert caught.value.field_violations == ()
    assert caught.value.message == "run r-1 not found"


def test_list_runs_follows_page_tokens_until_the_limit(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
) -> None:
    done = gateway_service_pb2.Run.State.STATE_DONE
    future: Future[list[Any]] = pool.submit(client.list_runs, state=done, limit=3, page_size=2)
    first = _serve_one(
        channel,
        "ListRuns",
        gateway_service_pb2.ListRunsResponse(runs=[_run("r-9"), _run("r-8")], next_page_token="t2"),
    )
    second = _serve_one(
        channel,
        "ListRuns",
        gateway_service_pb2.ListRunsResponse(runs=[_run("r-7"), _run("r-6")], next_page_token="t3"),
    )
    assert [r.id for r in future.result(timeout=TIMEOUT)] == ["r-9", "r-8", "r-7"]
    assert (first.page_token, first.state, first.page_size) == ("", done, 2)
    assert second.page_token == "t2"
    assert len(recorder.calls) == 2 and all(t == 4.0 for _, t in recorder.calls)


def test_a_client_needs_a_target_or_a_channel() -> None:
    with pytest.raises(ValueError, match="target"):
        tc.GatewayClient()
    with pytest.raises(ValueError, match="timeout"):
        tc.GatewayClient("localhost:1", timeout=0)


def test_an_unreachable_gateway_is_unavailable() -> None:
    with tc.GatewayClient("127.0.0.1:1", timeout=2) as c, pytest.raises(tc.Unavailable) as caught:
        c.get_run("r-1")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


# -- builders ------------------------------------------------------------------------------------


def test_imitation_task_from_names() -> None:
    task = tc.imitation_task(clip="walk", group_size=8, learning_rate=0.01, avatar_id="a1")
    assert task.WhichOneof("kind") == "imitation"
    imitation = task.imitation
    assert (imitation.rig_name, imitation.clip_name) == ("stickman", "walk")
    assert (imitation.group_size, imitation.learning_rate, imitation.avatar_id) == (8, 0.01, "a1")
    assert contract.check_task(task, tc.train_config(10)) == []


def test_imitation_task_from_specs_and_messages() -> None:
    clip = motion.builtin_clip("jump")
    task = tc.imitation_task(clip=clip, rig=motion.STICKMAN)
    assert task.imitation.WhichOneof("rig_source") == "rig"
    assert task.imitation.WhichOneof("clip_source") == "clip"
    assert motion.clip_from_task(task.imitation).frame_count == clip.frame_count
    assert motion.rig_from_task(task.imitation) == motion.STICKMAN
    again = tc.imitation_task(clip=task.imitation.clip, rig=task.imitation.rig)
    assert again == task
    assert contract.check_task(task, tc.train_config(10)) == []


def test_grpo_task_sets_optional_fields_only_when_given() -> None:
    plain = tc.grpo_task(model="models/tiny", dataset="data/rows.jsonl").grpo
    assert not plain.HasField("beta")
    assert not plain.HasField("dataloader_num_workers")
    assert not plain.HasField("dataloader_prefetch_factor")
    full = tc.grpo_task(
        model="m",
        dataset="d.jsonl",
        reward_functions=["exact_match", "length"],
        num_generations=4,
        batch_size=8,
        max_completion_length=64,
        learning_rate=1e-5,
        beta=0.0,
        temperature=0.7,
        gradient_accumulation_steps=2,
        dataloader_num_workers=0,
        dataloader_prefetch_factor=None,
        num_processes=2,
    )
    grpo = full.grpo
    assert grpo.num_processes == 2
    assert list(grpo.reward_functions) == ["exact_match", "length"]
    assert grpo.HasField("beta") and grpo.beta == 0.0
    assert grpo.HasField("dataloader_num_workers") and grpo.dataloader_num_workers == 0
    assert (grpo.num_generations, grpo.batch_size, grpo.max_completion_length) == (4, 8, 64)
    assert contract.check_task(full, tc.train_config(3)) == []
    too_many = tc.grpo_task(model="m", dataset="d.jsonl", num_processes=65)
    assert [v.field for v in contract.check_task(too_many, tc.train_config(3))] == [
        "task.grpo.num_processes"
    ]


def test_state_names_round_trip() -> None:
    for value in gateway_service_pb2.Run.State.values():
        if value:
            assert tc.parse_state(tc.state_name(value)) == value
    assert tc.parse_state("STATE_DONE") == gateway_service_pb2.Run.State.STATE_DONE
    with pytest.raises(ValueError, match="running"):
        tc.parse_state("sleeping")


def test_retry_policy_backoff_grows_to_its_cap_within_jitter() -> None:
    policy = tc.RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.1)
    for attempt, base in ((1, 0.1), (2, 0.2), (3, 0.4), (5, 1.0), (9, 1.0)):
        delay = policy.delay(attempt)
        assert base * 0.9 - 1e-9 <= delay <= base * 1.1 + 1e-9
    for bad in (
        {"max_retries": -1},
        {"initial_backoff": 2.0, "max_backoff": 1.0},
        {"multiplier": 0.5},
        {"jitter": 1.0},
    ):
        with pytest.raises(ValueError):
            tc.RetryPolicy(**bad)  # type: ignore[arg-type]


def test_train_config() -> None:
    config = tc.train_config(50, seed=7)
    assert (config.max_episodes, config.seed) == (50, 7)
    assert isinstance(config, episode_pb2.TrainConfig)
