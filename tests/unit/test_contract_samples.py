"""The stream rules for GRPO samples (``detail.grpo.samples``): at most 8 per episode, texts of at
most 4 KiB of UTF-8, a thumbnail of at most 16 KiB whose ``image_type`` is set exactly when it
is there, is one of the allowed types and names the format its bytes are in, finite rewards;
and the checker's screen agrees with its rule-by-rule check on any samples."""

from __future__ import annotations

import io
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.unit.test_contract_stream import ExactChecker, make_stream, outcome, violation
from trainwire._contract_stream import image_type_of
from trainwire.contract import (
    MAX_SAMPLE_IMAGE_BYTES,
    MAX_SAMPLE_TEXT_BYTES,
    MAX_SAMPLES,
    SAMPLE_IMAGE_TYPES,
    StreamChecker,
)
from trainwire.v1 import episode_pb2


def _encoded(fmt: str, size: tuple[int, int] = (6, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, fmt)
    return out.getvalue()


PICTURES = {"image/jpeg": _encoded("JPEG"), "image/png": _encoded("PNG")}
PICTURES["image/webp"] = _encoded("WEBP")


def _sample(**fields: object) -> episode_pb2.GrpoSample:
    values: dict[str, object] = {
        "prompt": "What colour?",
        "image": PICTURES["image/jpeg"],
        "image_type": "image/jpeg",
        "completion": "<answer>green</answer>",
        "reward": 1.5,
        "rewards": {"exact_match": 1.0, "format": 1.0},
        "solution": "green",
    }
    values.update(fields)
    return episode_pb2.GrpoSample(**values)  # type: ignore[arg-type]


def _stream(*samples: episode_pb2.GrpoSample) -> list[episode_pb2.Episode]:
    """Two GRPO episodes, the samples on the first (an episode the checker's screen sees)."""
    stream = make_stream([0.1, 0.2], kind="grpo")
    stream[0].grpo.samples.extend(samples)
    return stream


def _passes(stream: list[episode_pb2.Episode]) -> None:
    assert outcome(StreamChecker, stream, kind="grpo") == (2, 0.2, True)
    assert outcome(ExactChecker, stream, kind="grpo") == (2, 0.2, True)


def test_the_largest_samples_pass() -> None:
    padded = PICTURES["image/png"] + b"\0" * (MAX_SAMPLE_IMAGE_BYTES - len(PICTURES["image/png"]))
    largest = [
        _sample(
            prompt="é" * (MAX_SAMPLE_TEXT_BYTES // 2),
            completion="😀" * (MAX_SAMPLE_TEXT_BYTES // 4),
            solution="s" * MAX_SAMPLE_TEXT_BYTES,
            image=padded,
            image_type="image/png",
        )
    ] * MAX_SAMPLES
    _passes(_stream(*largest))
    for kind, picture in PICTURES.items():
        assert image_type_of(picture) == kind
        _passes(_stream(_sample(image=picture, image_type=kind)))
    # No image, no type; no solution; no rewards (every function returned None): still valid.
    _passes(_stream(_sample(image=b"", image_type="", solution="", rewards={}, reward=0.0)))


@pytest.mark.parametrize(
    ("sample", "rule", "field", "words"),
    [
        (_sample(image=b"\xff\xd8\xff" + b"\0" * MAX_SAMPLE_IMAGE_BYTES), "detail_size",
         "detail.grpo.samples[1].image", f"image of {MAX_SAMPLE_IMAGE_BYTES + 3} bytes"),
        (_sample(image_type=""), "detail_format", "detail.grpo.samples[1].image_type",
         "image_type ''; one of image/webp, image/png, image/jpeg"),
        (_sample(image=b"", image_type="image/png"), "detail_format",
         "detail.grpo.samples[1].image_type", "image_type 'image/png' without an image"),
        (_sample(image_type="image/gif"), "detail_format", "detail.grpo.samples[1].image_type",
         "image_type 'image/gif'"),
        (_sample(image_type="image/png"), "detail_format", "detail.grpo.samples[1].image",
         "image_type 'image/png', but the image's bytes are image/jpeg"),
        (_sample(image=b"<svg onload=alert(1)>", image_type="image/jpeg"), "detail_format",
         "detail.grpo.samples[1].image", "bytes are not a PNG, JPEG or WebP image"),
        (_sample(prompt="é" * 2049), "detail_size", "detail.grpo.samples[1].prompt",
         "prompt of 4098 bytes; at most 4096"),
        (_sample(completion="x" * 4097), "detail_size", "detail.grpo.samples[1].completion",
         "completion of 4097 bytes"),
        (_sample(solution="😀" * 1025), "detail_size", "detail.grpo.samples[1].solution",
         "solution of 4100 bytes"),
        (_sample(reward=math.nan), "finite", "detail.grpo.samples[1].reward", "reward is nan"),
        (_sample(rewards={"format": 1.0, "mod:judge": -math.inf}), "finite",
         "detail.grpo.samples[1].rewards[mod:judge]", "reward is -inf"),
    ],
)  # fmt: skip
def test_each_broken_sample_rule_names_its_field(
    sample: episode_pb2.GrpoSample, rule: str, field: str, words: str
) -> None:
    stream = _stream(_sample(), sample)
    err = violation(stream, kind="grpo")
    assert (err.rule, err.episode, err.field) == (rule, 1, field)
    assert words in str(err) and "run run-7" in str(err)
    assert outcome(StreamChecker, stream, kind="grpo") == outcome(ExactChecker, stream, kind="grpo")


def test_at_most_eight_samples() -> None:
    err = violation(_stream(*[_sample()] * (MAX_SAMPLES + 1)), kind="grpo")
    assert (err.rule, err.field) == ("detail_size", "detail.grpo.samples")
    assert "9 samples; at most 8" in str(err)


texts = st.text(max_size=3) | st.sampled_from(["é" * 2048, "é" * 2049, "😀" * 1025, "x" * 4096])
numbers = st.floats(width=64) | st.sampled_from([math.nan, math.inf, 1e308, -0.0])
images = st.sampled_from(
    [b"", b"junk", *PICTURES.values(), b"\x89PNG\r\n\x1a\n" + b"\0" * MAX_SAMPLE_IMAGE_BYTES]
)
samples = st.builds(
    episode_pb2.GrpoSample,
    prompt=texts,
    image=images,
    image_type=st.sampled_from(["", *SAMPLE_IMAGE_TYPES, "text/html"]),
    completion=texts,
    reward=numbers,
    rewards=st.dictionaries(st.text(max_size=5), numbers, max_size=3),
    solution=texts,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(samples, max_size=MAX_SAMPLES + 1))
# Bytes of no known image kind with no type: the screen once let these through.
@example([episode_pb2.GrpoSample(image=b"junk")])
def test_screened_and_exact_checks_agree_on_any_samples(
    drawn: list[episode_pb2.GrpoSample],
) -> None:
    stream = _stream(*drawn)
    assert outcome(StreamChecker, stream, kind="grpo") == outcome(ExactChecker, stream, kind="grpo")
