"""What only the server shows of placement: the core's health verdict (``on_health``) reaches
the gRPC health service. Placement itself (FIFO per kind, busy trainers, kinds nobody offers,
dead and hung trainers, several trainers) is tested at its seam in ``tests/core/test_placement.py``.
The gateway runs in-process against a scripted fake trainer on a real socket."""

from __future__ import annotations

from collections.abc import Callable

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import running_gateway
from tests.fakes.waiting import TIMEOUT, until
from trainwire.v1 import gateway_service_pb2

State = gateway_service_pb2.Run.State
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_is_not_serving_while_no_trainer_answers(
    make_fake: Callable[..., FakeTrainer],
) -> None:
    # No free slot: the run below waits, so the trainer is probed every schedule_poll_s.
    fake = make_fake(slots=0)
    async with running_gateway((fake.address,), trainer_call_timeout_s=0.5) as client:
        health = health_pb2_grpc.HealthStub(client.channel)

        async def status_is(wanted: int) -> bool:
            """Whether the whole server and the gateway service both report ``wanted``."""
            replies = [
                await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
                for name in ("", "trainwire.v1.GatewayService")
            ]
            return all(reply.status == wanted for reply in replies)

        assert await status_is(SERVING)
        run = await client.create(max_episodes=3)
        fake.hang_capabilities.set()  # its probes time out: no trainer answers
        await until(lambda: status_is(NOT_SERVING), "NOT_SERVING")
        fake.hang_capabilities.clear()
        await until(lambda: status_is(SERVING), "SERVING again")
        assert (await client.get(run.id)).state == State.STATE_PENDING
