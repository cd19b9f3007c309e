"""What the model saw, at the rank's seams: the completion tap around every reward function (as
TRL's own reward step calls them), the samples an episode makes of a scored batch, their
thumbnails, and the step metrics the step gate times."""

from __future__ import annotations

import asyncio
import io
import math
import types
from typing import Any, cast

import pytest
import torch
from PIL import Image
from transformers import TrainerControl, TrainerState

from tests.unit.test_grpo_callback import ARGS, GrantingChannel
from trainer_service.core.provider import EpisodeCounter
from trainer_service.providers.grpo.callback import EpisodeMaker, StepGate, spread
from trainer_service.providers.grpo.rewards import (
    CompletionTap,
    build_reward_functions,
    completion_text,
)
from trainer_service.providers.grpo.step_metrics import GIB, StepMeter
from trainer_service.providers.grpo.thumbnails import THUMBNAIL_SIDE, as_image, thumbnail
from trainwire.contract import (
    MAX_SAMPLE_IMAGE_BYTES,
    MAX_SAMPLE_TEXT_BYTES,
    MAX_SAMPLES,
    StreamChecker,
)

REWARDS = ["exact_match", "format", "length"]
WEIGHTS = [1.0, 0.5, 2.0]


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _prompt(question: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]


def _trl_rewards(funcs: list[Any], inputs: list[dict[str, Any]], completions: list[Any]) -> Any:
    """TRL 1.16's own reward step (``GRPOTrainer._calculate_rewards``) on one process, with a
    stand-in for the trainer it reads: rewards per completion and function, None as NaN."""
    from trl import GRPOTrainer

    torch.set_num_threads(1)
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(report_to=[]),
        state=types.SimpleNamespace(global_step=0),
        reward_funcs=funcs,
        reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs],
        _log_completion_extra=lambda *args: None,
        _log_metric=lambda *args: None,
        environments=None,
    )
    prompts = [row["prompt"] for row in inputs]
    ids = [[1] * len(completion_text(c).split()) for c in completions]
    return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, ids)


def test_the_tap_sees_every_function_and_adds_up_the_reward_as_trl_does() -> None:
    tap = CompletionTap()
    funcs = build_reward_functions(REWARDS, 8, tap)
    tap.set_weights(WEIGHTS)
    assert [f.__name__ for f in funcs] == REWARDS  # TRL's metric names stay the functions'
    red, blue = Image.new("RGB", (9, 7), (255, 0, 0)), Image.new("RGB", (9, 7), (0, 0, 255))
    inputs = [
        {"prompt": _prompt("Colour?"), "image": red, "solution": "red"},
        {"prompt": _prompt("Colour?"), "image": red, "solution": "red"},
        {"prompt": _prompt("Which?"), "image": blue, "solution": None},  # exact_match: None
        {"prompt": _prompt("Which?"), "image": blue, "solution": None},
    ]
    texts = ["<answer>red</answer>", "blue", "<answer>x</answer>", "y " * 20]
    completions = [_chat(t) for t in texts]
    per_function = _trl_rewards(funcs, inputs, completions)
    # TRL's total: the weighted sum, NaN (a None) left out.
    trl_total = (per_function * torch.tensor(WEIGHTS)).nansum(dim=1).tolist()
    batch = tap.latest()
    assert batch is not None and batch.number == 1 and len(batch) == 4
    assert [batch.reward(i) for i in range(4)] == pytest.approx(trl_total)
    assert batch.function_rewards(0) == {"exact_match": 1.0, "format": 1.0, "length": 0.0}
    assert batch.function_rewards(2) == {"format": 1.0, "length": 0.0}  # None: absent
    assert batch.function_rewards(3)["length"] == -1.0  # 20 "tokens" of 8
    assert [batch.completion(i) for i in range(4)] == texts
    assert batch.prompt(0) == "Colour?"  # the user's text, not the system's
    assert [batch.solution(i) for i in range(4)] == ["red", "red", "", ""]
    assert batch.image(0) is red and batch.image(3) is blue
    # A second batch replaces it once every function scored it.
    funcs[0](prompts=["p"], completions=[_chat("a")], solution=["a"])
    assert tap.latest() is batch
    second = [_chat("b")]
    for func in funcs:
        func(prompts=["plain prompt"], completions=second, images=[[blue, red]])
    latest = tap.latest()
    assert latest is not None and latest.number == 2 and latest.prompt(0) == "plain prompt"
    assert latest.image(0) is blue  # the first of a row's images


def test_the_tap_wraps_async_functions_and_survives_malformed_answers() -> None:
    tap = CompletionTap()

    async def judge(completions: list[Any], **_: Any) -> list[float | None]:
        return [0.25 for _ in completions]

    def broken(completions: list[Any], **_: Any) -> Any:
        return "not a list"

    def odd(completions: list[Any], **_: Any) -> list[Any]:
        return [math.nan, True, "7", -0.0][: len(completions)]

    wrapped = tap.wrap([judge, broken, odd], ["mod:judge", "mod:broken", "mod:odd"])
    from trl.trainer.utils import is_async_callable

    assert [is_async_callable(f) for f in wrapped] == [True, False, False]
    completions = [_chat(str(i)) for i in range(4)]
    assert asyncio.run(cast(Any, wrapped[0])(completions=completions)) == [0.25] * 4
    assert wrapped[1](completions=completions) == "not a list"  # TRL reports it, not the tap
    wrapped[2](completions=completions)
    batch = tap.latest()
    assert batch is not None
    assert batch.function_rewards(3) == {"mod:judge": 0.25, "mod:odd": 0.0}
    assert math.copysign(1.0, batch.function_rewards(3)["mod:odd"]) == 1.0  # -0.0 reads 0
    assert batch.function_rewards(2) == {"mod:judge": 0.25, "mod:odd": 7.0}
    assert batch.reward(0) == 0.25  # weights 1 until set
    with pytest.raises(ValueError, match="2 weights for 3"):
        tap.set_weights([1.0, 2.0])


@pytest.mark.parametrize(
    ("keys", "picked"),
    [
        ("aabbccdd", [0, 2, 4, 6, 1, 3, 5, 7]),
        ("aaaaaaaaaa", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("abcdefghij", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("aaabbbb", [0, 3, 1, 4, 2, 5, 6]),
        ("", []),
    ],
)
def test_samples_spread_over_the_batchs_prompts(keys: str, picked: list[int]) -> None:
    assert spread(list(keys)) == picked


def _scored_tap(rows: int, generations: int, size: tuple[int, int] = (48, 40)) -> CompletionTap:
    """A tap holding one batch of ``rows`` prompts x ``generations`` completions."""
    tap = CompletionTap()
    funcs = build_reward_functions(["exact_match", "format"], 8, tap)
    tap.set_weights([1.0, 0.5])
    prompts, completions, images, solutions = [], [], [], []
    for row in range(rows):
        image = Image.new("RGBA", size, (row * 40 % 256, 90, 200, 128))
        for g in range(generations):
            prompts.append(_prompt(f"Row {row}: colour?"))
            completions.append(_chat(f"<answer>c{row}</answer>" if g == 0 else "é" * 3000))
            images.append(image.copy())
            solutions.append(f"c{row}")
    for func in funcs:
        func(prompts=prompts, completions=completions, image=images, solution=solutions)
    return tap


def test_an_episode_carries_samples_with_thumbnails_and_keeps_the_contract() -> None:
    tap = _scored_tap(rows=12, generations=2, size=(640, 480))
    channel = GrantingChannel()
    maker = EpisodeMaker(EpisodeCounter(2), tap)
    gate = StepGate(maker, channel, max_steps=2)
    state, control = TrainerState(), TrainerControl()
    for step, logs in ((1, {"loss": 0.5, "reward": 0.3}), (2, {"loss": 0.4})):
        state.global_step = step
        gate.on_log(ARGS, state, control, logs=logs)
    first, carried = channel.episodes
    checker = StreamChecker("grpo", 2, "run-samples")
    checker.check(first)
    checker.check(carried)
    checker.finish()
    samples = first.grpo.samples
    assert len(samples) == MAX_SAMPLES
    # The first completion of each of the first eight rows: eight different images.
    assert [s.solution for s in samples] == [f"c{row}" for row in range(8)]
    assert [s.completion for s in samples] == [f"<answer>c{row}</answer>" for row in range(8)]
    assert [s.reward for s in samples] == [1.5] * 8
    assert samples[3].rewards == {"exact_match": 1.0, "format": 1.0}
    assert samples[3].prompt == "Row 3: colour?"
    for sample in samples:
        assert sample.image_type == "image/jpeg" and len(sample.image) <= MAX_SAMPLE_IMAGE_BYTES
        with Image.open(io.BytesIO(sample.image)) as image:
            assert image.format == "JPEG" and image.size == (THUMBNAIL_SIDE, 96)
    # sample_completions as before: the batch's first four texts, cut to 4 KiB.
    assert list(first.grpo.sample_completions[:1]) == ["<answer>c0</answer>"]
    assert len(first.grpo.sample_completions) == 4
    assert all(len(t.encode()) <= MAX_SAMPLE_TEXT_BYTES for t in first.grpo.sample_completions)
    # A step that reused the batch shows the same samples (encoded once).
    assert carried.grpo == first.grpo and maker._detail is not None


def test_one_prompts_batch_shows_several_of_its_answers_and_texts_are_cut() -> None:
    tap = _scored_tap(rows=1, generations=4)
    episode = EpisodeMaker(EpisodeCounter(1), tap).make({"reward": 0.0})
    samples = episode.grpo.samples
    assert len(samples) == 4 and len({s.image for s in samples}) == 1
    assert [s.reward for s in samples] == [1.5, 0.0, 0.0, 0.0]
    assert samples[1].completion == "é" * (MAX_SAMPLE_TEXT_BYTES // 2)  # 6000 bytes, cut at 4096
    StreamChecker("grpo", 1).check(episode)


def test_before_any_batch_and_without_an_image_an_episode_still_keeps_the_contract() -> None:
    tap = CompletionTap()
    maker = EpisodeMaker(EpisodeCounter(2), tap)
    first = maker.make({"reward": 0.1})
    assert not first.grpo.samples and not first.grpo.sample_completions
    funcs = build_reward_functions(["format"], 8, tap)
    funcs[0](prompts=["q"], completions=["<answer>a</answer>"], image=[b"not an image"])
    second = maker.make({"reward": 0.2})
    (sample,) = second.grpo.samples
    assert sample.image == b"" and sample.image_type == "" and sample.reward == 1.0
    checker = StreamChecker("grpo", 2)
    checker.check(first)
    checker.check(second)


def test_thumbnails_fit_the_limit_whatever_the_image() -> None:
    noise = Image.effect_noise((160, 120), 120).convert("RGB")  # ~8.5 KiB at 128 x 96
    data, kind = thumbnail(noise)
    assert kind == "image/jpeg" and len(data) <= MAX_SAMPLE_IMAGE_BYTES
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (THUMBNAIL_SIDE, 96)
    # A tighter limit makes it lose quality, then shrink, until it fits.
    small, _ = thumbnail(noise, limit=3000)
    assert len(small) <= 3000
    with Image.open(io.BytesIO(small)) as image:
        assert max(image.size) < THUMBNAIL_SIDE
    with pytest.raises(ValueError, match="no thumbnail fits in 10 bytes"):
        thumbnail(noise, limit=10)
    # Never enlarged; palette, grey and transparent images come out RGB (transparency white).
    tiny = Image.new("LA", (5, 3), (0, 0))
    with Image.open(io.BytesIO(thumbnail(tiny)[0])) as image:
        assert image.size == (5, 3) and image.mode == "RGB"
        assert min(image.convert("L").tobytes()) > 240
    for mode in ("P", "L", "I;16", "CMYK"):
        assert thumbnail(Image.new(mode, (20, 10)))[0]
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    assert as_image(png.getvalue()) is not None
    assert as_image({"bytes": png.getvalue(), "path": None}) is not None
    assert as_image(b"junk") is None and as_image("a/path.png") is None and as_image(None) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Memory:
    def __init__(self) -> None:
        self.resets = 0
        self.peak = 0

    def reset(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        return self.peak


def test_the_step_meter_times_steps_and_generations() -> None:
    clock = _Clock()
    meter = StepMeter(clock)
    assert meter.take() == {"generate_time": 0.0}
    meter.step_began()
    clock.now += 0.5  # loading the batch
    meter.generated(1.5, 300)
    meter.generated(0.5, 100)  # a second call in the same step (tools)
    clock.now += 3.0
    meter.step_ended()
    assert meter.take() == {
        "step_time": 3.5,
        "generate_time": 2.0,
        "completion_tokens_per_second": 200.0,
    }
    meter.step_began()
    clock.now += 1.0
    meter.step_ended()  # a step that trained on the last batch: its speed carried
    assert meter.take() == {
        "step_time": 1.0,
        "generate_time": 0.0,
        "completion_tokens_per_second": 200.0,
    }


def test_the_gate_times_each_step_from_its_go_to_its_end_and_the_gpu_peak_on_cuda() -> None:
    clock, memory = _Clock(), _Memory()
    channel = GrantingChannel()
    maker = EpisodeMaker(EpisodeCounter(2))
    maker.meter = StepMeter(clock, memory)
    gate = StepGate(maker, channel, max_steps=2)
    state, control = TrainerState(), TrainerControl()
    gate.on_train_begin(ARGS, state, control)
    for step, (seconds, peak) in enumerate(((2.0, 3 * GIB), (1.0, GIB // 2)), start=1):
        clock.now += seconds
        maker.meter.generated(seconds / 2, 64)
        memory.peak = int(peak)
        gate.on_step_end(ARGS, state, control)
        state.global_step = step
        clock.now += 7.0  # the trainer's go takes its time: a pause is no part of a step
        gate.on_log(ARGS, state, control, logs={"loss": 1.0, "reward": 0.5, "step_time": 9.9})
    first, second = channel.episodes
    assert first.metrics["step_time"] == 2.0 and second.metrics["step_time"] == 1.0
    assert first.metrics["generate_time"] == 1.0 and second.metrics["generate_time"] == 0.5
    assert first.metrics["completion_tokens_per_second"] == 64.0
    assert [e.metrics["gpu_memory_peak_gib"] for e in (first, second)] == [3.0, 0.5]
    assert memory.resets == 3  # at the start and after each go
    # Without a memory probe (a CPU job) there is no GPU metric.
    plain = EpisodeMaker(EpisodeCounter(1))
    plain.meter = StepMeter(clock)
    assert "gpu_memory_peak_gib" not in plain.make({"reward": 0.0}).metrics
