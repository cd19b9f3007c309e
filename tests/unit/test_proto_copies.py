"""Guards for the hand-kept copies of the contract: the servicers' method tables and the HTTP
routes must list every RPC of the proto with its exact request and response types, so a new RPC
or a changed type cannot be missed silently (a missing one would answer UNIMPLEMENTED)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from gateway import servicer as gateway_servicer
from gateway.http import api as http_api
from gateway.http import app as http_app
from trainer_service import servicer as trainer_servicer
from trainwire.v1 import gateway_service_pb2, trainer_service_pb2

GATEWAY: ServiceDescriptor = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
TRAINER: ServiceDescriptor = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"]


def _types(method: MethodDescriptor) -> tuple[str, str]:
    return method.input_type.full_name, method.output_type.full_name


def test_no_rpc_streams_requests() -> None:
    # The tables below only know unary and server-streaming handlers.
    for service in (GATEWAY, TRAINER):
        assert not any(m.client_streaming for m in service.methods), service.full_name


def test_the_gateway_method_table_is_the_proto_service() -> None:
    table = gateway_servicer.UNARY_METHODS
    streaming = {m.name for m in GATEWAY.methods if m.server_streaming}
    assert streaming == {"WatchRun", "DownloadCheckpoint"}, (
        "add_to_server registers the streams apart; a new stream too?"
    )
    assert set(table) == {m.name for m in GATEWAY.methods} - streaming
    for name, (request, response) in table.items():
        method = GATEWAY.methods_by_name[name]
        assert (request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name) == _types(method)
        assert callable(getattr(gateway_servicer.GatewayServicer, name)), name
    watch = GATEWAY.methods_by_name["WatchRun"]
    assert _types(watch) == ("trainwire.v1.WatchRunRequest", "trainwire.v1.WatchRunResponse")
    download = GATEWAY.methods_by_name["DownloadCheckpoint"]
    assert _types(download) == (
        "trainwire.v1.DownloadCheckpointRequest",
        "trainwire.v1.DownloadCheckpointResponse",
    )
    # add_to_server deserializes the streams' requests as the proto says.
    source = inspect.getsource(gateway_servicer.add_to_server)
    assert "_deserializer(pb.WatchRunRequest)" in source
    assert "_deserializer(pb.DownloadCheckpointRequest)" in source


def test_the_trainer_method_table_is_the_proto_service() -> None:
    table = trainer_servicer.METHODS
    assert set(table) == {m.name for m in TRAINER.methods}
    for name, (request, response, streaming) in table.items():
        method = TRAINER.methods_by_name[name]
        assert (request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name) == _types(method)
        assert streaming == method.server_streaming, name
        servicer_class: Any = trainer_servicer.TrainerServicer
        assert callable(getattr(servicer_class, name)), name


def test_every_gateway_rpc_has_an_http_route() -> None:
    """The JSON API mirrors GatewayService: each unary RPC is reached by a route whose handler
    calls it, and WatchRun by the event stream."""
    api = http_api.JsonApi(object())  # type: ignore[arg-type]  (routes only bind handlers)
    called: set[str] = set()
    for route in api.routes():
        source = inspect.getsource(route.handler)
        called.update(re.findall(r"self\._servicer\.(\w+)\b", source))
    unary = {m.name for m in GATEWAY.methods if not m.server_streaming}
    assert unary <= called, f"RPCs without an HTTP route: {sorted(unary - called)}"
    assert called <= {m.name for m in GATEWAY.methods}, "a route calls an RPC the proto lacks"
    assert "/v1/runs/{run_id:[^/:]+}/events" in inspect.getsource(http_app)
