"""What another service writes against the client package; `mypy --strict` must pass on it
(tests/unit/test_typed_consumer.py). It is type-checked, never run."""

from __future__ import annotations

import grpc

from trainwire import aio
from trainwire.client import (
    GatewayClient,
    InvalidArgument,
    NotFound,
    RunNotFound,
    TrainwireError,
    imitation_task,
    state_name,
    train_config,
)
from trainwire.reasons import ErrorReason
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from trainwire.watch import WatchEvent


def create_and_follow(target: str) -> list[float]:
    rewards: list[float] = []
    with GatewayClient(target, timeout=5.0) as gw:
        try:
            run: gateway_service_pb2.Run = gw.create_run(
                imitation_task(clip="wave"), train_config(max_episodes=10)
            )
        except InvalidArgument as exc:
            fields: list[str] = [v.field for v in exc.field_violations]
            raise SystemExit(", ".join(fields)) from exc
        for event in gw.watch(run.id):
            if isinstance(event, episode_pb2.Episode):
                rewards.append(event.reward)
            elif isinstance(event, gateway_service_pb2.Run):
                print(state_name(event.state))
        try:
            gw.get_run("missing")
        except RunNotFound as exc:
            assert exc.reason == ErrorReason.RUN_NOT_FOUND
        except NotFound:
            pass
    return rewards


def raw_stub(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        reply: gateway_service_pb2.GetRunResponse = stub.GetRun(
            gateway_service_pb2.GetRunRequest(run_id="r1"), timeout=5.0
        )
        state: gateway_service_pb2.Run.State.ValueType = reply.run.state
        page = stub.ListRuns(gateway_service_pb2.ListRunsRequest(page_size=10), timeout=5.0)
        names = [r.display_name for r in page.runs]
        return f"{gateway_service_pb2.Run.State.Name(state)} {names}"


async def raw_aio_stub(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        reply = await stub.GetRun(gateway_service_pb2.GetRunRequest(run_id="r1"), timeout=5.0)
        episodes = 0
        async for message in stub.WatchRun(
            gateway_service_pb2.WatchRunRequest(run_id=reply.run.id), timeout=5.0
        ):
            if message.WhichOneof("event") == "batch":
                episodes += len(message.batch.episodes)
        return episodes


async def aio_client(target: str) -> int:
    async with aio.GatewayClient(target, timeout=5.0) as gw:
        run = await gw.create_run(imitation_task(), train_config(max_episodes=5))
        seen = 0
        event: WatchEvent
        async for event in gw.watch(run.id):
            if isinstance(event, episode_pb2.Episode):
                seen = event.episode
        try:
            await gw.pause_run(run.id)
        except TrainwireError as exc:
            code: grpc.StatusCode | None = exc.code
            print(code)
        return seen
