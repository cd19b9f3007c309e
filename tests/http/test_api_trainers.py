"""``GET /v1/trainers``: each configured trainer as the gateway last probed it, its GPUs
included (``GetCapabilitiesResponse`` in the JSON mapping), against a real gateway over fake
trainers; and the conversions of a trainer's answer both ways."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.convert import capabilities_from_proto, capabilities_to_proto
from gateway.core.trainers import Capabilities, Gpu
from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import running_gateway
from tests.fakes.waiting import TIMEOUT, until
from tests.http.conftest import Http
from trainer_service.providers.defaults import grpo_proto, imitation_proto
from trainwire.v1 import trainer_service_pb2

GIB = 1 << 30


def test_a_trainer_s_answer_converts_both_ways_with_its_gpus() -> None:
    caps = Capabilities(
        ("imitation", "grpo"),
        4,
        3,
        device="4 x NVIDIA H200 (cuda:0..3, one slot per GPU)",
        torch_version="2.14.1",
        trl_version="1.0",
        server_version="0.4",
        gpus=(
            Gpu(0, "NVIDIA H200", 141 * GIB, 20 * GIB, 0.5),
            Gpu(3, "NVIDIA H200", 141 * GIB, 0, 0.0),
        ),
        provider_defaults={"imitation": imitation_proto(), "grpo": grpo_proto()},
    )
    message = capabilities_to_proto(caps)
    assert message.provider_defaults["grpo"].grpo.num_generations == 8
    assert [g.index for g in message.gpus] == [0, 3]
    assert message.gpus[0].memory_used_bytes == 20 * GIB
    assert capabilities_from_proto(message) == caps
    older = capabilities_from_proto(trainer_service_pb2.GetCapabilitiesResponse())
    assert (older.gpus, dict(older.provider_defaults)) == ((), {})


async def test_the_trainers_are_listed_with_their_gpus_and_why_one_does_not_answer(
    make_fake: Callable[..., FakeTrainer],
) -> None:
    gpu = trainer_service_pb2.Gpu(
        index=1, name="NVIDIA H100", memory_total_bytes=80 * GIB, memory_used_bytes=GIB,
        utilization=0.25,
    )  # fmt: skip
    with_gpu = make_fake(slots=2, gpus=(gpu,))
    cpu = make_fake(slots=1, provider_defaults=False)  # a trainer older than provider_defaults
    trainers = (with_gpu.address, cpu.address, "127.0.0.1:9")
    async with (
        running_gateway(trainers, http_port=0) as client,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
    ):
        assert client.gateway.http is not None
        h = Http(client, session, client.gateway.http.url)

        async def answered() -> list[dict[str, Any]] | None:
            listed: list[dict[str, Any]] = (await h.ok("GET", "/v1/trainers"))["trainers"]
            asked = all(t["reachable"] or t["error"] != "not asked yet" for t in listed)
            return listed if asked else None

        first, second, gone = await until(answered, "every trainer asked")
    # What each provider's 0 fields mean on that trainer, as it advertised them.
    defaults = first["capabilities"].pop("providerDefaults")
    assert defaults["imitation"] == {
        "checkpointEvery": 500,
        "imitation": {"groupSize": 16, "learningRate": 0.03},
    }
    assert defaults["grpo"]["checkpointEvery"] == 50
    assert defaults["grpo"]["grpo"]["numGenerations"] == 8
    assert defaults["grpo"]["grpo"]["lora"] == {
        "rank": 16,
        "alphaPerRank": 2.0,
        "learningRate": 0.01,
        "beta": 0.04,
    }
    assert "providerDefaults" not in second["capabilities"]
    assert first == {
        "address": with_gpu.address,
        "reachable": True,
        "error": "",
        "capabilities": {
            "providers": ["imitation", "grpo"],
            "device": "cpu",
            "slotsTotal": 2,
            "slotsFree": 2,
            "serverVersion": "fake",
            "gpus": [
                {
                    "index": 1,
                    "name": "NVIDIA H100",
                    "memoryTotalBytes": str(80 * GIB),
                    "memoryUsedBytes": str(GIB),
                    "utilization": 0.25,
                }
            ],
        },
    }
    assert second["reachable"] and "gpus" not in second["capabilities"]
    assert gone == {"address": "127.0.0.1:9", "reachable": False, "error": "connection refused"}
