"""GRPO trains the tiny VLM of each architecture: LLaVA, Qwen2.5-VL (``qwen2_vl``) and
SmolVLM/Idefics3 (``smolvlm``), each with its own processor.

In this process, with the builder every rank runs (``build.build_trainer``): a step on rows of
two images each, every image reaching the vision tower (TRL's ``images`` rows become
``pixel_values`` + ``image_grid_thw`` for Qwen, ``pixel_values`` + ``pixel_attention_mask`` for
Idefics3), and a checkpoint's model of each architecture restoring every tensor.

Through the service: one real trainer process with two slots and the gateway in this process run
a short Qwen2.5-VL job and a short SmolVLM job side by side with the provider's defaults (the task
sets model, dataset, reward and steps), each streaming every step once to its end. Whether each
architecture learns is ``bench/grpo_learning.py``'s (80-step runs of seeds 0-5: Qwen2.5-VL at
0.80-0.96, SmolVLM at 0.71-0.96, last-10 mean; a CPU pays 60-70 CPU-seconds per 80 steps);
learning through the service is ``test_grpo_learning.py``'s (LLaVA): what is an architecture's
own (its processor, its image grid or splitting, every image reaching its vision tower, its
checkpoint) is tested above and by its short job.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.gateway_harness import collect, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.grpo_fixtures import make_job, tiny_grpo_task, tiny_vlm
from trainer_service.tools import make_demo_dataset
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
ARCHS = ("llava", "qwen2_vl", "smolvlm")
#: The architectures whose jobs run side by side through the service, and their steps.
THROUGH_THE_SERVICE = ("qwen2_vl", "smolvlm")
STEPS = 4
COLOURS = "datasets/colours/train.jsonl"
TWO_IMAGES = "datasets/two-images/train.jsonl"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Every architecture's tiny VLM at ``models/<arch>``, the colour demo, and 4 rows of two
    images each."""
    root = tmp_path_factory.mktemp("grpo-archs")
    for arch in ARCHS:
        tiny_vlm(tmp_path_factory, root / "models" / arch, arch=arch)
    make_demo_dataset.build(root / "datasets" / "colours")
    make_demo_dataset.build(root / "datasets" / "two-images", rows=4, images_per_row=2)
    return root


@pytest.fixture
def _one_torch_thread() -> Iterator[None]:
    """Trainers built in this process use one CPU thread, as a job's process does."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Where each architecture's vision tower is, and how many images one call of it encodes.
_VISION_TOWER = {"llava": "vision_tower", "qwen2_vl": "visual", "smolvlm": "vision_model"}


def _images_encoded(arch: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if arch == "qwen2_vl":
        return int(kwargs["grid_thw"].shape[0])  # one row (frames, height, width) per image
    pixels = kwargs["pixel_values"] if "pixel_values" in kwargs else args[0]
    return int(pixels.shape[0])  # Idefics3 drops its all-zero padding images first


@pytest.mark.usefixtures("_one_torch_thread")
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_two_images_train_a_step_with_every_image_encoded(
    arch: str, data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    import math

    from trainer_service.providers.grpo.build import build_trainer

    # Two prompts of two completions: four completions, each with its prompt's two images.
    task = tiny_grpo_task(f"models/{arch}", TWO_IMAGES, workers=0, num_generations=2, batch_size=4)
    trainer = build_trainer(make_job(data_root, task, max_episodes=1), output_dir=str(tmp_path))
    model: Any = trainer.model
    tower = getattr(model.model, _VISION_TOWER[arch])
    encoded: list[int] = []
    tower.register_forward_pre_hook(
        lambda module, args, kwargs: encoded.append(_images_encoded(arch, args, kwargs)),
        with_kwargs=True,
    )
    trainer.train()

    # Generation encodes the 4 completions' 8 images, and so does the scoring forward pass.
    assert encoded and all(count == 8 for count in encoded), encoded
    assert len(encoded) >= 2, encoded
    (logged,) = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    assert math.isfinite(logged["loss"]) and math.isfinite(logged["reward"]), logged


@pytest.mark.usefixtures("_one_torch_thread")
@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_restores_every_tensor_from_its_saved_model(
    arch: str, data_root: pathlib.Path
) -> None:
    import torch

    from trainer_service.providers.grpo.build import _restored_model

    # A checkpoint's model/ is save_pretrained of the trained model, as the builder wrote it.
    model = _restored_model(data_root / "models" / arch, torch.float32)
    expected = {
        "llava": "LlavaForConditionalGeneration",
        "qwen2_vl": "Qwen2_5_VLForConditionalGeneration",
        "smolvlm": "Idefics3ForConditionalGeneration",
    }[arch]
    assert type(model).__name__ == expected


def _run(arch: str, steps: int) -> gateway_service_pb2.CreateRunRequest:
    grpo = episode_pb2.GrpoTask(
        model_path=f"models/{arch}",
        dataset_path=COLOURS,
        reward_functions=["exact_match"],
        # Inline decoding: worker start-up would cost more than the 64 small images.
        dataloader_num_workers=0,
    )
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=0),
        episodes_per_second=-1.0,
        display_name=arch,
    )


async def test_qwen2_vl_and_smolvlm_jobs_run_side_by_side_through_the_service(
    data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    flags = ("--data-root", str(data_root), "--heartbeat", "0.5")
    env = {"OMP_NUM_THREADS": "1"}
    with trainer_process(tmp_path / "trainer.log", *flags, slots=2, env=env) as (_, address):
        async with running_gateway((address,), heartbeat_timeout_s=5.0) as client:
            runs = [
                (await client.stub.CreateRun(_run(arch, STEPS), timeout=TIMEOUT)).run
                for arch in THROUGH_THE_SERVICE
            ]
            # Both jobs share the trainer's two slots (and this machine's CPUs).
            results = await asyncio.gather(
                *(collect(client.stub, run.id, timeout=JOB_TIMEOUT) for run in runs)
            )

    for arch, result in zip(THROUGH_THE_SERVICE, results, strict=True):
        done = result.finished
        assert done is not None and done.state == pb.Run.State.STATE_DONE, (arch, done)
        assert [e.episode for e in result.episodes] == list(range(1, STEPS + 1)), arch
        assert all(0.0 <= e.reward <= 1.0 for e in result.episodes), arch
        # Each step sampled its completions from this architecture's own generation.
        assert all(e.grpo.sample_completions for e in result.episodes), arch
