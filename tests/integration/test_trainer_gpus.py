"""A trainer process reports the GPUs of its slots (``GetCapabilitiesResponse.gpus``), and the
gateway keeps them for people (``GET /v1/trainers``).

No GPU here: the trainer runs with its slots on ``cuda:0`` and ``cuda:1`` of no real device
(``trainer_process(fake_cuda_devices=2)``) and a fake ``nvidia-smi`` first on its ``PATH``, a
script that prints what the real one prints for four GPUs, or hangs when told to. Everything
else is the product: the flags, the probe, the servicer, gRPC, the gateway's probe loop and its
HTTP side. A CPU trainer, which never asks ``nvidia-smi``, and a failing one are covered at the
probe's seam (tests/unit/test_gpus.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import grpc
import pytest

from tests.fakes.gateway_harness import running_gateway, trainer_process
from tests.fakes.nvidia_smi import ANSWER, calls, fake_smi
from tests.fakes.waiting import TIMEOUT, until
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MIB = 1 << 20
#: What the trainer reports under CUDA_VISIBLE_DEVICES=3,1: the machine's GPU 3 as cuda:0,
#: its GPU 1 as cuda:1 (the fake's GPUs 0 and 2 are another trainer's).
EXPECTED = [
    trainer_service_pb2.Gpu(
        index=0,
        name="NVIDIA A10",
        memory_total_bytes=23028 * MIB,
        memory_used_bytes=512 * MIB,
        utilization=0.0,
    ),
    trainer_service_pb2.Gpu(
        index=1,
        name="NVIDIA H100 80GB HBM3",
        memory_total_bytes=81559 * MIB,
        memory_used_bytes=40960 * MIB,
        utilization=0.87,
    ),
]


async def test_a_gpu_trainer_reports_its_slots_gpus_and_none_once_nvidia_smi_hangs(
    tmp_path: Path,
) -> None:
    bin_dir = tmp_path / "bin"
    mode = tmp_path / "mode"
    mode.write_text("answer")
    fake_smi(
        bin_dir,
        f'if [ "$(cat {mode})" = hang ]; then exec sleep 60; fi\n{ANSWER}',
    )
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "3,1"}
    log = tmp_path / "trainer.log"
    with trainer_process(log, slots=2, env=env, fake_cuda_devices=2) as (_, address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)

            async def capabilities() -> trainer_service_pb2.GetCapabilitiesResponse:
                request = trainer_service_pb2.GetCapabilitiesRequest()
                reply: trainer_service_pb2.GetCapabilitiesResponse = await stub.GetCapabilities(
                    request, timeout=TIMEOUT
                )
                return reply

            caps = await capabilities()
            assert list(caps.gpus) == EXPECTED
            assert caps.slots_total == 2
            assert "GPUs of CUDA devices 0, 1 read from nvidia-smi" in log.read_text()

            # The gateway keeps each trainer's answer, GPUs included, and serves it.
            async with (
                running_gateway((address,), http_port=0) as client,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
            ):
                assert client.gateway.http is not None
                url = f"{client.gateway.http.url}/v1/trainers"

                async def listed() -> list[dict] | None:
                    async with session.get(url) as response:
                        assert response.status == 200
                        (trainer,) = (await response.json())["trainers"]
                    return trainer if trainer["reachable"] else None

                trainer = await until(listed, "the trainer listed as reachable")
                assert trainer["address"] == address
                assert trainer["capabilities"]["gpus"] == [
                    {
                        "name": "NVIDIA A10",
                        "memoryTotalBytes": str(23028 * MIB),
                        "memoryUsedBytes": str(512 * MIB),
                    },
                    {
                        "index": 1,
                        "name": "NVIDIA H100 80GB HBM3",
                        "memoryTotalBytes": str(81559 * MIB),
                        "memoryUsedBytes": str(40960 * MIB),
                        "utilization": 0.87,
                    },
                ]

            # nvidia-smi hangs: the trainer answers without GPUs, and says so once.
            mode.write_text("hang")
            asked = len(calls(bin_dir))

            async def without_gpus() -> bool:
                return not (await capabilities()).gpus

            await until(without_gpus, "capabilities without GPUs")
            for _ in range(3):
                caps = await capabilities()
                assert not caps.gpus and caps.slots_total == 2
            assert len(calls(bin_dir)) == asked + 1  # one try, then it waits before the next
            warnings = [line for line in log.read_text().splitlines() if "failed" in line]
            assert len(warnings) == 1, warnings
            assert "reading GPUs from nvidia-smi failed (no answer within 2 s)" in warnings[0]
