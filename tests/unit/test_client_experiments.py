"""Both clients' experiment calls: ``update_run`` (a field mask of exactly the fields given),
``create_run(labels=, fork_from=)`` and ``set_run_hyperparameters`` (only the values given are
present): the request fields sent, the deadline carried, bad labels, fork sources and values
refused before anything is sent, errors typed. The sync client over a
grpc_testing channel; the asyncio client over a real ``grpc.aio`` channel to an in-process
server that records what it received."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc_testing
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2

from tests.fakes.recording_channel import RecordingChannel
from tests.fakes.waiting import TIMEOUT
from trainwire import aio, contract
from trainwire import client as tc
from trainwire.v1 import gateway_service_pb2 as pb

# A client thread that dies before calling leaves take_unary_unary waiting forever: fail fast.
pytestmark = pytest.mark.timeout(30)

_SERVICE = pb.DESCRIPTOR.services_by_name["GatewayService"]
_PREFIX = "/trainwire.v1.GatewayService/"


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


def _serve(
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


def _labelled(run_id: str = "r-1", **labels: str) -> pb.Run:
    return pb.Run(id=run_id, display_name="sweep", labels=labels)


# -- update_run ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "paths", "run"),
    [
        (
            {"labels": {"team": "vision", "lr": ""}},
            ["labels"],
            pb.Run(id="r-1", labels={"team": "vision", "lr": ""}),
        ),
        (
            {"display_name": "best so far"},
            ["display_name"],
            pb.Run(id="r-1", display_name="best so far"),
        ),
        ({"labels": {}}, ["labels"], pb.Run(id="r-1")),  # removes every label
        (
            {"display_name": "", "labels": {"a/b": "c"}},
            ["display_name", "labels"],
            pb.Run(id="r-1", labels={"a/b": "c"}),
        ),
    ],
)
def test_update_run_masks_exactly_the_fields_given(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    kwargs: dict[str, Any],
    paths: list[str],
    run: pb.Run,
) -> None:
    future = pool.submit(lambda: client.update_run("r-1", **kwargs))
    request = _serve(channel, "UpdateRun", pb.UpdateRunResponse(run=_labelled(team="vision")))
    assert future.result(timeout=TIMEOUT) == _labelled(team="vision")
    assert list(request.update_mask.paths) == paths
    assert request.run == run
    assert recorder.calls == [(_PREFIX + "UpdateRun", 4.0)]


def test_update_run_needs_something_to_change(
    client: tc.GatewayClient, recorder: RecordingChannel
) -> None:
    # An empty mask would ask the gateway to set both fields (to empty).
    with pytest.raises(ValueError, match="display_name, labels"):
        client.update_run("r-1")
    assert recorder.calls == []


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"labels": {"-team": "x"}}, "run.labels[-team]", "bad key '-team'"),
        ({"labels": {"team": "a b"}}, "run.labels[team]", "bad value 'a b'"),
        ({"labels": {"Example.com/x": "y"}}, "run.labels[Example.com/x]", "DNS subdomain"),
        ({"labels": {f"k{i}": "" for i in range(65)}}, "run.labels", "at most 64"),
        ({"display_name": "two\nlines"}, "run.display_name", "control characters"),
    ],
)
def test_update_run_refuses_what_the_gateway_would_before_sending(
    client: tc.GatewayClient,
    recorder: RecordingChannel,
    kwargs: dict[str, Any],
    field: str,
    words: str,
) -> None:
    with pytest.raises(tc.InvalidRequest) as caught:
        client.update_run("r-1", **kwargs)
    err = caught.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "INVALID_REQUEST"
    assert err.field_violations[0].field == field
    assert words in err.field_violations[0].description
    assert err.message.startswith(f"cannot update run 'r-1': {field}: ")
    assert recorder.calls == []
    # The same rules as the gateway's: one table, declared in the contract.
    if "labels" in kwargs:
        assert contract.check_labels(kwargs["labels"], "run.labels") == list(err.field_violations)


def test_update_run_names_a_bad_run_id_safely(client: tc.GatewayClient) -> None:
    with pytest.raises(tc.InvalidRequest) as caught:
        client.update_run("x\n" * 40, labels={})
    assert caught.value.field_violations[0].field == "run.id"
    assert "\n" not in caught.value.message and "..." in caught.value.message


def _rich(code: grpc.StatusCode, message: str, *details: Any) -> tuple[tuple[str, bytes], ...]:
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return (("grpc-status-details-bin", status.SerializeToString()),)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, tc.NotFound),
        (grpc.StatusCode.PERMISSION_DENIED, tc.PermissionDenied),
        (grpc.StatusCode.UNAVAILABLE, tc.Unavailable),
        (grpc.StatusCode.UNIMPLEMENTED, tc.Unimplemented),
    ],
)
def test_update_run_errors_are_typed(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    cls: type[tc.TrainwireError],
) -> None:
    future = pool.submit(client.update_run, "r-7", display_name="x")
    _serve(channel, "UpdateRun", None, code, "run 'r-7': no")
    with pytest.raises(cls) as caught:
        future.result(timeout=TIMEOUT)
    assert (caught.value.code, caught.value.message) == (code, "run 'r-7': no")
    assert isinstance(caught.value.__cause__, grpc.RpcError)


def test_a_gateway_refusal_of_a_label_keeps_its_field_violations(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    violations = [contract.FieldViolation("update_mask.paths", "'state'; only display_name")]
    message = "cannot update run 'r-1': update_mask path 'state' is not one of ..."
    trailing = _rich(grpc.StatusCode.INVALID_ARGUMENT, message, contract.bad_request(violations))
    future = pool.submit(client.update_run, "r-1", labels={"ok": "yes"})
    _serve(channel, "UpdateRun", None, grpc.StatusCode.INVALID_ARGUMENT, message, trailing)
    with pytest.raises(tc.InvalidArgument) as caught:
        future.result(timeout=TIMEOUT)
    assert caught.value.field_violations == tuple(violations)


# -- create_run with labels and a fork source ----------------------------------------------------


@pytest.mark.parametrize(
    ("fork_from", "source"),
    [
        (("parent", 120), pb.ForkSource(run_id="parent", episode=120)),
        ("parent", pb.ForkSource(run_id="parent")),
        (pb.ForkSource(run_id="parent", episode=5), pb.ForkSource(run_id="parent", episode=5)),
    ],
)
def test_create_run_sends_labels_and_the_fork_source(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    fork_from: tc.ForkFrom,
    source: pb.ForkSource,
) -> None:
    task = tc.imitation_task(learning_rate=1e-4)
    future = pool.submit(
        lambda: client.create_run(
            task, tc.train_config(400, seed=2), labels={"sweep": "lr"}, fork_from=fork_from
        )
    )
    request = _serve(channel, "CreateRun", pb.CreateRunResponse(run=pb.Run(id="child")))
    assert future.result(timeout=TIMEOUT).id == "child"
    assert request.HasField("fork_from") and request.fork_from == source
    assert dict(request.labels) == {"sweep": "lr"}
    assert (request.task, request.config) == (task, tc.train_config(400, seed=2))
    assert recorder.calls == [(_PREFIX + "CreateRun", 4.0)]


def test_create_run_without_a_fork_source_trains_from_scratch(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    future = pool.submit(client.create_run, tc.imitation_task())
    request = _serve(channel, "CreateRun", pb.CreateRunResponse(run=pb.Run(id="r")))
    future.result(timeout=TIMEOUT)
    assert not request.HasField("fork_from") and not request.labels


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"labels": {"a": "-x"}}, "labels[a]"),
        ({"fork_from": ("parent", -1)}, "fork_from.episode"),
        ({"fork_from": ("", 3)}, "fork_from.run_id"),
        ({"fork_from": "bad id"}, "fork_from.run_id"),
    ],
)
def test_create_run_refuses_bad_labels_and_fork_sources_before_sending(
    client: tc.GatewayClient, recorder: RecordingChannel, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(tc.InvalidRequest) as caught:
        client.create_run(tc.imitation_task(), **kwargs)
    assert [v.field for v in caught.value.field_violations] == [field]
    assert caught.value.message.startswith(f"cannot create the run: {field}: ")
    assert recorder.calls == []


def test_a_refused_fork_is_typed_with_the_gateway_message(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    message = "cannot fork run 'p': it has no checkpoint at episode 7 (it has 50, 100)"
    future = pool.submit(client.create_run, tc.imitation_task(), fork_from=("p", 7))
    _serve(channel, "CreateRun", None, grpc.StatusCode.NOT_FOUND, message)
    with pytest.raises(tc.NotFound) as caught:
        future.result(timeout=TIMEOUT)
    assert caught.value.message == message


# -- set_run_hyperparameters ---------------------------------------------------------------------


_PRESENT = ("learning_rate", "temperature", "beta")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"learning_rate": 3e-4},
        {"temperature": 0.7, "beta": 0.0},  # beta 0 is a value, not "left as it is"
        {"learning_rate": 1.0, "temperature": 10.0, "beta": 10.0},
    ],
)
def test_set_run_hyperparameters_sends_only_the_values_given(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    kwargs: dict[str, float],
) -> None:
    future = pool.submit(lambda: client.set_run_hyperparameters("r-1", **kwargs))
    reply = pb.SetRunHyperparametersResponse(run=pb.Run(id="r-1"))
    request = _serve(channel, "SetRunHyperparameters", reply)
    assert future.result(timeout=TIMEOUT).id == "r-1"
    assert request.run_id == "r-1"
    assert {name: getattr(request, name) for name in _PRESENT if request.HasField(name)} == kwargs
    assert recorder.calls == [(_PREFIX + "SetRunHyperparameters", 4.0)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"temperature": 11.0}, "temperature"),
        ({"beta": -0.1}, "beta"),
        ({"beta": float("inf")}, "beta"),
    ],
)
def test_set_run_hyperparameters_refuses_values_out_of_range_before_sending(
    client: tc.GatewayClient, recorder: RecordingChannel, kwargs: dict[str, float], field: str
) -> None:
    with pytest.raises(tc.InvalidRequest) as caught:
        client.set_run_hyperparameters("r-1", **kwargs)
    assert [v.field for v in caught.value.field_violations] == [field]
    assert caught.value.message.startswith("cannot set the hyperparameters of run 'r-1': ")
    assert recorder.calls == []
    with pytest.raises(ValueError, match="learning_rate, temperature or beta"):
        client.set_run_hyperparameters("r-1")


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, tc.FailedPrecondition),
        (grpc.StatusCode.INVALID_ARGUMENT, tc.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, tc.NotFound),
        (grpc.StatusCode.UNAVAILABLE, tc.Unavailable),
        (grpc.StatusCode.PERMISSION_DENIED, tc.PermissionDenied),
    ],
)
def test_set_run_hyperparameters_errors_are_typed(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    cls: type[tc.TrainwireError],
) -> None:
    future = pool.submit(lambda: client.set_run_hyperparameters("r-7", temperature=0.5))
    _serve(channel, "SetRunHyperparameters", None, code, "run 'r-7' is finished")
    with pytest.raises(cls) as caught:
        future.result(timeout=TIMEOUT)
    assert caught.value.message == "run 'r-7' is finished"
    assert isinstance(caught.value.__cause__, grpc.RpcError)


# -- the asyncio client --------------------------------------------------------------------------


class _Recording:
    """Answers UpdateRun, CreateRun and SetRunHyperparameters with the run they name (or fails
    them), keeping each request and the deadline it arrived with."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.deadlines: list[float | None] = []
        self.fail: grpc.StatusCode | None = None

    def _unary(self, reply: Callable[[Any], Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.requests.append(request)
            self.deadlines.append(context.time_remaining())
            if self.fail is not None:
                await context.abort(self.fail, "refused")
            return reply(request)

        return handle

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, tuple[Any, Callable[[Any], Any]]] = {
            "UpdateRun": (
                pb.UpdateRunRequest,
                lambda r: pb.UpdateRunResponse(run=r.run),
            ),
            "CreateRun": (
                pb.CreateRunRequest,
                lambda r: pb.CreateRunResponse(
                    run=pb.Run(id="child", labels=r.labels, fork_from=r.fork_from)
                ),
            ),
            "SetRunHyperparameters": (
                pb.SetRunHyperparametersRequest,
                lambda r: pb.SetRunHyperparametersResponse(run=pb.Run(id=r.run_id)),
            ),
        }
        return grpc.method_handlers_generic_handler(
            "trainwire.v1.GatewayService",
            {
                name: grpc.unary_unary_rpc_method_handler(
                    self._unary(reply),
                    request_deserializer=request_type.FromString,
                    response_serializer=lambda m: m.SerializeToString(),
                )
                for name, (request_type, reply) in methods.items()
            },
        )


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Recording, str]]:
    servicer = _Recording()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((servicer.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_the_aio_client_sends_the_experiment_requests(
    served: tuple[_Recording, str],
) -> None:
    servicer, target = served
    async with aio.GatewayClient(target, timeout=4.0) as gw:
        relabelled = await gw.update_run("r-1", labels={"team": "vision"})
        renamed = await gw.update_run("r-1", display_name="best", timeout=1.5)
        fork = await gw.create_run(
            tc.imitation_task(), labels={"from": "r-1"}, fork_from=("r-1", 40)
        )
        live = await gw.set_run_hyperparameters("r-1", learning_rate=1e-3)
    assert relabelled == pb.Run(id="r-1", labels={"team": "vision"})
    assert renamed == pb.Run(id="r-1", display_name="best")
    assert (fork.id, dict(fork.labels), fork.fork_from.episode) == ("child", {"from": "r-1"}, 40)
    assert live.id == "r-1"
    update, rename, create, hyper = servicer.requests
    assert (list(update.update_mask.paths), list(rename.update_mask.paths)) == (
        ["labels"],
        ["display_name"],
    )
    assert create.fork_from == pb.ForkSource(run_id="r-1", episode=40)
    assert hyper.HasField("learning_rate") and not hyper.HasField("temperature")
    assert not hyper.HasField("beta")
    # The grpc-timeout header rounds a deadline up a little.
    first, second = servicer.deadlines[:2]
    assert first is not None and 3.0 < first < 4.1
    assert second is not None and 0.5 < second < 1.6


async def test_the_aio_client_refuses_and_types_like_the_sync_one(
    served: tuple[_Recording, str],
) -> None:
    servicer, target = served
    async with aio.GatewayClient(target, timeout=4.0) as gw:
        with pytest.raises(tc.InvalidRequest):
            await gw.update_run("r-1", labels={"bad key": "x"})
        with pytest.raises(ValueError):
            await gw.update_run("r-1")
        with pytest.raises(tc.InvalidRequest):
            await gw.set_run_hyperparameters("r-1", temperature=0.0)
        with pytest.raises(tc.InvalidRequest):
            await gw.create_run(tc.imitation_task(), fork_from=("r-1", -2))
        assert servicer.requests == []
        servicer.fail = grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(tc.FailedPrecondition) as caught:
            await gw.set_run_hyperparameters("r-1", beta=0.1)
    assert caught.value.message == "refused"
    assert isinstance(caught.value.__cause__, grpc.aio.AioRpcError)
