"""The shipped path on the GPU: a trainer process on ``cuda:0`` reports its GPU, trains GRPO jobs
in bf16 in its job processes (episodes with their GPU memory peak) and trains LoRA adapters.

One trainer process serves the module (its rank launcher imports the training stack once);
``test_the_provider_trains_in_bf16_on_cuda`` builds the job's trainer in this process, the way
every rank builds it, to read the precision it trains in.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.gpu.harness import (
    COLOURS_FILE,
    MODEL_DIR,
    gpu_memory_used_mib,
    gpu_trainer,
)
from tests.grpo_fixtures import make_job, tiny_grpo_task
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GIB = 1 << 30
#: What a CUDA context and the tiny model's job take at least (a context alone is ~500 MiB).
JOB_MIB = 200


@dataclasses.dataclass
class Trainer:
    """The module's trainer process."""

    pid: int
    stub: trainer_service_pb2_grpc.TrainerServiceStub
    store: pathlib.Path


@pytest.fixture(scope="module")
def trainer(
    gpu_data_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Trainer]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    where = tmp_path_factory.mktemp("gpu-trainer")
    store = where / "checkpoints"
    with (
        gpu_trainer(where / "trainer.log", "cuda:0", gpu_data_root, store) as (proc, address),
        grpc.insecure_channel(address) as channel,
    ):
        yield Trainer(proc.pid, trainer_service_pb2_grpc.TrainerServiceStub(channel), store)


def _train(
    trainer: Trainer, run_id: str, task: episode_pb2.TrainTask, steps: int
) -> tuple[list[episode_pb2.Episode], int]:
    """Trains ``task`` to its end on the trainer (no gateway); returns the checked episodes and
    the most GPU memory in use, in MiB, read once per episode."""
    config = episode_pb2.TrainConfig(max_episodes=steps, seed=2)
    request = trainer_service_pb2.TrainRequest(run_id=run_id, task=task, config=config)
    checker = StreamChecker.for_task(task, config, run_id)
    episodes, used = [], 0
    for response in trainer.stub.Train(request, timeout=JOB_TIMEOUT):
        if response.WhichOneof("event") == "episode":
            checker.check(response.episode)
            episodes.append(response.episode)
            used = max(used, gpu_memory_used_mib())
    checker.finish()
    return episodes, used


def test_capabilities_report_the_gpu(cuda: str, trainer: Trainer) -> None:
    caps = trainer.stub.GetCapabilities(
        trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
    )
    assert caps.device.startswith("cuda:0"), caps.device
    # The GPU of its slots (one slot, on cuda:0), under the index jobs know it by.
    assert [gpu.index for gpu in caps.gpus] == [0], caps.gpus
    gpu = caps.gpus[0]
    properties = torch.cuda.get_device_properties(0)
    assert gpu.name == properties.name
    # NVML and the CUDA runtime count the same memory, give or take what the driver keeps.
    assert gpu.memory_total_bytes == pytest.approx(properties.total_memory, rel=0.03)
    assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
    assert 0.0 <= gpu.utilization <= 1.0


def test_the_provider_trains_in_bf16_on_cuda(cuda: str, gpu_data_root: pathlib.Path) -> None:
    from trainer_service.providers.grpo.build import build_trainer

    assert torch.cuda.is_bf16_supported(), "every GPU this project targets has bf16"
    task = tiny_grpo_task(MODEL_DIR, COLOURS_FILE, workers=0)
    job = dataclasses.replace(make_job(gpu_data_root, task), device=cuda)
    trainer = build_trainer(job, output_dir=str(gpu_data_root / "scratch-bf16"))
    try:
        assert trainer.args.bf16 and not trainer.args.use_cpu
        assert trainer.accelerator.mixed_precision == "bf16"
        model: Any = trainer.model
        parameter = next(model.parameters())
        assert parameter.device.type == "cuda"
        # Mixed precision: fp32 master weights, bf16 compute under autocast.
        assert parameter.dtype == torch.float32
    finally:
        del trainer
        torch.cuda.empty_cache()


def test_a_grpo_run_trains_on_the_gpu_with_its_memory_peak_in_every_episode(
    cuda: str, trainer: Trainer
) -> None:
    before = gpu_memory_used_mib()
    task = tiny_grpo_task(MODEL_DIR, COLOURS_FILE, num_generations=8, max_completion_length=16)
    episodes, used = _train(trainer, "gpu-run", task, steps=6)
    assert [e.episode for e in episodes] == list(range(1, 7))
    total_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    for episode in episodes:
        assert 0 < episode.metrics["gpu_memory_peak_gib"] < total_gib, episode.metrics
        assert episode.metrics["step_time"] > 0
        assert episode.metrics["generate_time"] > 0
        assert episode.metrics["completion_tokens_per_second"] > 0
    # The job's processes held the GPU while it trained.
    assert used >= before + JOB_MIB, (before, used)


def test_a_lora_run_trains_adapters_on_the_gpu(cuda: str, trainer: Trainer) -> None:
    task = tiny_grpo_task(MODEL_DIR, COLOURS_FILE, num_generations=8, max_completion_length=16)
    task.grpo.lora.rank = 8
    task.grpo.lora.target_modules.extend(["q_proj", "v_proj"])
    episodes, _ = _train(trainer, "gpu-lora", task, steps=4)
    assert [e.episode for e in episodes] == [1, 2, 3, 4]
    assert all(e.metrics["gpu_memory_peak_gib"] > 0 for e in episodes)
    # Its last checkpoint holds the adapter in PEFT's format, not the model's weights.
    model = trainer.store / "gpu-lora" / f"{4:012d}" / "model"
    config = json.loads((model / "adapter_config.json").read_text())
    assert config["r"] == 8
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert (model / "adapter_model.safetensors").is_file()
    assert not (model / "model.safetensors").exists()
