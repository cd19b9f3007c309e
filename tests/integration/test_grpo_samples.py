"""What the model saw, through the real services: a GRPO run on the real trainer (its job in a
child process, the offline tiny VLM) behind the real gateway, watched over server-sent events
while it trains and replayed over gRPC once it is done.

Every episode carries samples: a JPEG thumbnail of the row's image (which PIL decodes, within
the contract's 16 KiB), the prompt, the answer, the expected answer and its rewards, the total
being the sum of the function rewards weighted by the task's ``reward_weights``; and the step
metrics ``step_time``, ``generate_time`` and ``completion_tokens_per_second`` (no GPU metric on a
CPU). The SSE stream and the replay carry the same episodes, samples included.
"""

from __future__ import annotations

import base64
import io
import json
import math
import pathlib
from collections.abc import Iterator

import aiohttp
import pytest
from PIL import Image

from tests.fakes.gateway_harness import collect, running_gateway
from tests.fakes.trainer_harness import RunningTrainer, running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.grpo_fixtures import grpo_data_root, tiny_grpo_task
from tests.http.harness import read_stream
from trainer_service.tools import make_demo_dataset
from trainwire.contract import MAX_SAMPLE_IMAGE_BYTES, MAX_SAMPLES, StreamChecker
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

STEPS = 3
REWARDS = ("exact_match", "format", "length")
WEIGHTS = (1.0, 0.5, 2.0)


@pytest.fixture
def trainer(grpo_data_root: pathlib.Path) -> Iterator[RunningTrainer]:
    with running_trainer(
        {"grpo": "trainer_service.providers.grpo"},
        warm_up=False,
        wait_idle=False,
        stop_wait=TIMEOUT,
        device="cpu",
        data_root=grpo_data_root,
        heartbeat_s=1.0,
    ) as running:
        yield running
        assert running.runner.wait_idle(TIMEOUT)


def _check_sample(sample: episode_pb2.GrpoSample) -> None:
    assert sample.image_type == "image/jpeg" and 0 < len(sample.image) <= MAX_SAMPLE_IMAGE_BYTES
    with Image.open(io.BytesIO(sample.image)) as image:
        image.load()
        assert image.format == "JPEG" and image.mode == "RGB"
        assert 0 < max(image.size) <= 128  # the demo images are 48 x 40: never enlarged
    assert "What colour is the shape" in sample.prompt
    assert sample.solution in make_demo_dataset.DEFAULT_ANSWERS["colour"]
    assert set(sample.rewards) <= set(REWARDS) and "format" in sample.rewards
    total = sum(w * sample.rewards.get(name, 0.0) for name, w in zip(REWARDS, WEIGHTS, strict=True))
    assert sample.reward == pytest.approx(total)


async def test_samples_and_step_metrics_reach_sse_and_the_replay(trainer: RunningTrainer) -> None:
    task = tiny_grpo_task(
        workers=0, batch_size=4, reward_functions=REWARDS, reward_weights=list(WEIGHTS)
    )
    request = gateway_service_pb2.CreateRunRequest(
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=STEPS, seed=3),
        episodes_per_second=-1.0,
    )
    async with (
        running_gateway((trainer.address,), http_port=0) as gateway,
        aiohttp.ClientSession() as session,
    ):
        run = (await gateway.stub.CreateRun(request, timeout=TIMEOUT)).run
        assert gateway.gateway.http is not None
        url = f"{gateway.gateway.http.url}/v1/runs/{run.id}/events"
        live = await read_stream(session, url, timeout=JOB_TIMEOUT)
        assert live.ended and live.finished is not None, live.kinds
        assert live.finished["state"] == "STATE_DONE", live.finished
        replay = await collect(gateway.stub, run.id)

    assert live.numbers == list(range(1, STEPS + 1))
    assert replay.episodes == live.episodes  # samples and all, as the SSE JSON read back
    checker = StreamChecker.for_task(task, request.config, run.id)
    for episode in replay.episodes:
        checker.check(episode)
        samples = episode.grpo.samples
        # Two prompts of two completions each: all four, the two rows' first answers first.
        assert len(samples) == 4 <= MAX_SAMPLES
        assert samples[0].solution == samples[2].solution != ""
        for sample in samples:
            _check_sample(sample)
        assert 1 <= len(episode.grpo.sample_completions) <= 4  # as before the samples
        metrics = episode.metrics
        assert "gpu_memory_peak_gib" not in metrics  # a CPU job
        assert 0 < metrics["generate_time"] < metrics["step_time"] < JOB_TIMEOUT
        assert 0 < metrics["completion_tokens_per_second"] < 1e6
    checker.finish()
    # The JSON the page reads: the thumbnail as base64 with its MIME type, a data: URL away.
    event = json.loads(next(e.data for e in live.events if e.event == "episode"))
    first = event["grpo"]["samples"][0]
    assert first["imageType"] == "image/jpeg"
    assert base64.b64decode(first["image"]) == live.episodes[0].grpo.samples[0].image
    assert math.isfinite(first.get("reward", 0.0)) and set(first["rewards"]) <= set(REWARDS)
