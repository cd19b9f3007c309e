"""Both clients' ``get_run_curve`` and ``watch(view=...)``: the request fields sent, the deadline
carried, errors typed. The sync client over a grpc_testing channel; the asyncio client over a
real ``grpc.aio`` channel to an in-process server that records what it received."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc_testing
import pytest

from tests.fakes.recording_channel import RecordingChannel
from tests.fakes.waiting import TIMEOUT
from trainwire import aio
from trainwire import client as tc
from trainwire.v1 import gateway_service_pb2

# A client thread that dies before calling leaves take_unary_unary waiting forever: fail fast.
pytestmark = pytest.mark.timeout(30)

_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
_CURVE = "/trainwire.v1.GatewayService/GetRunCurve"
_SCALARS = tc.EpisodeView.EPISODE_VIEW_SCALARS


def _curve() -> gateway_service_pb2.GetRunCurveResponse:
    return gateway_service_pb2.GetRunCurveResponse(
        buckets=[
            gateway_service_pb2.CurveBucket(
                first_episode=1,
                last_episode=500,
                reward_min=-1.0,
                reward_max=2.0,
                reward_mean=0.5,
                best_reward=2.0,
                metrics_mean={"loss": 0.25},
            ),
            gateway_service_pb2.CurveBucket(
                first_episode=501,
                last_episode=1000,
                reward_min=0.0,
                reward_max=3.0,
                reward_mean=1.5,
                best_reward=3.0,
            ),
        ],
        last_episode=1000,
    )


@pytest.fixture
def channel() -> grpc_testing.Channel:
    return grpc_testing.channel([_SERVICE], grpc_testing.strict_real_time())


@pytest.fixture
def recorder(channel: grpc_testing.Channel) -> RecordingChannel:
    return RecordingChannel(channel)


@pytest.fixture
def client(recorder: RecordingChannel) -> Iterator[tc.GatewayClient]:
    retry = tc.RetryPolicy(max_retries=2, initial_backoff=0.0, max_backoff=0.0)
    with tc.GatewayClient(channel=recorder, timeout=4.0, retry=retry, idle_timeout=None) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _serve_curve(
    channel: grpc_testing.Channel,
    response: gateway_service_pb2.GetRunCurveResponse | None,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    details: str = "",
) -> gateway_service_pb2.GetRunCurveRequest:
    _, request, rpc = channel.take_unary_unary(_SERVICE.methods_by_name["GetRunCurve"])
    rpc.terminate(response, (), code, details)
    assert isinstance(request, gateway_service_pb2.GetRunCurveRequest)
    return request


# -- the sync client -----------------------------------------------------------------------------


def test_get_run_curve_sends_every_field_and_returns_the_response(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
) -> None:
    future = pool.submit(
        client.get_run_curve,
        "r-1",
        buckets=810,
        metrics=["loss", "kl"],
        first_episode=10,
        last_episode=900,
    )
    request = _serve_curve(channel, _curve())
    assert future.result(timeout=TIMEOUT) == _curve()
    assert request == gateway_service_pb2.GetRunCurveRequest(
        run_id="r-1", buckets=810, metrics=["loss", "kl"], first_episode=10, last_episode=900
    )
    assert recorder.calls == [(_CURVE, 4.0)]


def test_get_run_curve_defaults_leave_the_choices_to_the_gateway(
    channel: grpc_testing.Channel,
    recorder: RecordingChannel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
) -> None:
    future = pool.submit(client.get_run_curve, "r-1", timeout=0.5)
    request = _serve_curve(channel, gateway_service_pb2.GetRunCurveResponse())
    reply = future.result(timeout=TIMEOUT)
    assert (list(reply.buckets), reply.last_episode) == ([], 0)
    assert request == gateway_service_pb2.GetRunCurveRequest(run_id="r-1")
    assert recorder.calls == [(_CURVE, 0.5)]


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, tc.NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, tc.InvalidArgument),
        (grpc.StatusCode.DEADLINE_EXCEEDED, tc.DeadlineExceeded),
        (grpc.StatusCode.UNIMPLEMENTED, tc.Unimplemented),
    ],
)
def test_get_run_curve_errors_are_typed(
    channel: grpc_testing.Channel,
    client: tc.GatewayClient,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    cls: type[tc.TrainwireError],
) -> None:
    future = pool.submit(client.get_run_curve, "r-7", buckets=20_000)
    _serve_curve(channel, None, code, "run r-7: no")
    with pytest.raises(cls) as caught:
        future.result(timeout=TIMEOUT)
    assert (caught.value.code, caught.value.message) == (code, "run r-7: no")
    assert isinstance(caught.value.__cause__, grpc.RpcError)


def test_metrics_must_be_names_not_one_string(client: tc.GatewayClient) -> None:
    with pytest.raises(TypeError, match="sequence of names"):
        client.get_run_curve("r-1", metrics="loss")


def test_watch_sends_its_view_on_every_stream(
    channel: grpc_testing.Channel, client: tc.GatewayClient, pool: ThreadPoolExecutor
) -> None:
    method = _SERVICE.methods_by_name["WatchRun"]
    future = pool.submit(lambda: list(client.watch("r-1", 3, view=_SCALARS)))
    _, first, rpc = channel.take_unary_stream(method)
    rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "dropped")
    _, resumed, rpc = channel.take_unary_stream(method)
    finished = gateway_service_pb2.Run(id="r-1", state=gateway_service_pb2.Run.State.STATE_DONE)
    rpc.send_response(gateway_service_pb2.WatchRunResponse(finished=finished))
    rpc.terminate((), grpc.StatusCode.OK, "")
    assert future.result(timeout=TIMEOUT) == [finished]
    for request in (first, resumed):
        assert (request.run_id, request.after_episode, request.view) == ("r-1", 3, _SCALARS)


def test_watch_asks_for_the_full_view_by_default(
    channel: grpc_testing.Channel, client: tc.GatewayClient
) -> None:
    stream = client.watch("r-1")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(next, stream)
        _, request, rpc = channel.take_unary_stream(_SERVICE.methods_by_name["WatchRun"])
        stream.cancel()
        rpc.terminate((), grpc.StatusCode.CANCELLED, "")
        with pytest.raises(StopIteration):
            future.result(timeout=TIMEOUT)
    assert request.view == tc.EpisodeView.EPISODE_VIEW_UNSPECIFIED


def test_watch_refuses_an_unknown_view(client: tc.GatewayClient) -> None:
    with pytest.raises(ValueError, match="EpisodeView"):
        client.watch("r-1", view=7)  # type: ignore[arg-type]


# -- the asyncio client --------------------------------------------------------------------------


class _Recording:
    """Answers GetRunCurve (or fails it) and WatchRun (one finished event), keeping each
    request and the deadline it arrived with."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.deadlines: list[float | None] = []
        self.fail: grpc.StatusCode | None = None

    def _record(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())

    async def get_run_curve(
        self,
        request: gateway_service_pb2.GetRunCurveRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> gateway_service_pb2.GetRunCurveResponse:
        self._record(request, context)
        if self.fail is not None:
            await context.abort(self.fail, f"run {request.run_id}: refused")
        return _curve()

    async def watch_run(
        self,
        request: gateway_service_pb2.WatchRunRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[gateway_service_pb2.WatchRunResponse]:
        self._record(request, context)
        done = gateway_service_pb2.Run(
            id=request.run_id, state=gateway_service_pb2.Run.State.STATE_DONE
        )
        yield gateway_service_pb2.WatchRunResponse(finished=done)

    def handler(self) -> grpc.GenericRpcHandler:
        """The two methods under the gateway's service name (the others: UNIMPLEMENTED)."""
        pb = gateway_service_pb2
        return grpc.method_handlers_generic_handler(
            "trainwire.v1.GatewayService",
            {
                "GetRunCurve": grpc.unary_unary_rpc_method_handler(
                    self.get_run_curve,
                    request_deserializer=pb.GetRunCurveRequest.FromString,
                    response_serializer=pb.GetRunCurveResponse.SerializeToString,
                ),
                "WatchRun": grpc.unary_stream_rpc_method_handler(
                    self.watch_run,
                    request_deserializer=pb.WatchRunRequest.FromString,
                    response_serializer=pb.WatchRunResponse.SerializeToString,
                ),
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


async def test_the_aio_client_sends_the_curve_request_with_its_deadline(
    served: tuple[_Recording, str],
) -> None:
    servicer, target = served
    async with aio.GatewayClient(target, timeout=4.0) as gw:
        reply = await gw.get_run_curve(
            "r-1", buckets=100, metrics=("loss",), first_episode=2, last_episode=50
        )
        await gw.get_run_curve("r-2", timeout=1.5)
    assert reply == _curve()
    assert servicer.requests == [
        gateway_service_pb2.GetRunCurveRequest(
            run_id="r-1", buckets=100, metrics=["loss"], first_episode=2, last_episode=50
        ),
        gateway_service_pb2.GetRunCurveRequest(run_id="r-2"),
    ]
    # The grpc-timeout header rounds a deadline up a little.
    first, second = servicer.deadlines
    assert first is not None and 3.0 < first < 4.1
    assert second is not None and 0.5 < second < 1.6


async def test_the_aio_client_types_curve_errors(served: tuple[_Recording, str]) -> None:
    servicer, target = served
    servicer.fail = grpc.StatusCode.NOT_FOUND
    async with aio.GatewayClient(target, timeout=4.0) as gw:
        with pytest.raises(tc.NotFound) as caught:
            await gw.get_run_curve("r-9")
        with pytest.raises(TypeError):
            await gw.get_run_curve("r-9", metrics="loss")
    assert caught.value.message == "run r-9: refused"
    assert isinstance(caught.value.__cause__, grpc.aio.AioRpcError)


async def test_the_aio_watch_sends_its_view(served: tuple[_Recording, str]) -> None:
    servicer, target = served
    async with aio.GatewayClient(target, timeout=4.0) as gw:
        async with gw.watch("r-1", view=_SCALARS) as events:
            scalars = [event async for event in events]
        async with gw.watch("r-1", 5) as events:
            full = [event async for event in events]
        with pytest.raises(ValueError, match="EpisodeView"):
            gw.watch("r-1", view=9)  # type: ignore[arg-type]
    assert [type(e) for e in scalars + full] == [gateway_service_pb2.Run] * 2
    assert [(r.after_episode, r.view) for r in servicer.requests] == [
        (0, _SCALARS),
        (5, tc.EpisodeView.EPISODE_VIEW_UNSPECIFIED),
    ]
