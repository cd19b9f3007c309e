"""``episode_json`` writes the protobuf JSON mapping of ``Episode``: json_format reads back the
same message, the JSON equals json_format's own but for the digits of float32 angles, and its
timestamps are ``Timestamp.ToJsonString``'s, valid or not."""

from __future__ import annotations

import json
import math
import struct

import pytest
from google.protobuf import json_format, timestamp_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import episode_json as module
from gateway.core.episode_json import episode_json
from tests.fakes.fake_trainer import valid_episodes
from trainwire.v1 import episode_pb2

doubles = st.floats(allow_nan=True, allow_infinity=True)
float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
texts = st.text(max_size=40)
SECONDS_MIN, SECONDS_MAX = -62135596800, 253402300799  # what Timestamp.ToJsonString takes
#: Nanoseconds that take 0, 3, 6 and 9 fractional digits.
nanos = st.one_of(
    st.just(0),
    st.integers(0, 999).map(lambda n: n * 1_000_000),
    st.integers(0, 999_999).map(lambda n: n * 1000),
    st.integers(0, 999_999_999),
)


@st.composite
def episodes(draw: st.DrawFn, numbers: st.SearchStrategy[float] = doubles) -> episode_pb2.Episode:
    episode = episode_pb2.Episode(
        episode=draw(st.integers(0, 2**63 - 1)),
        reward=draw(numbers),
        best_reward=draw(numbers),
        done=draw(st.booleans()),
        metrics=draw(st.dictionaries(texts, numbers, max_size=4)),
    )
    if draw(st.booleans()):
        episode.produce_time.seconds = draw(st.integers(SECONDS_MIN, SECONDS_MAX))
        episode.produce_time.nanos = draw(nanos)
    kind = draw(st.sampled_from(["none", "imitation", "grpo"]))
    if kind == "imitation":
        episode.imitation.frame_count = draw(st.integers(0, 240))
        episode.imitation.joint_count = draw(st.integers(0, 32))
        episode.imitation.angles.extend(draw(st.lists(float32s, max_size=50)))
    elif kind == "grpo":
        episode.grpo.sample_completions.extend(draw(st.lists(texts, max_size=4)))
        for _ in range(draw(st.integers(0, 3))):
            episode.grpo.samples.add(
                prompt=draw(texts),
                image=draw(st.binary(max_size=64)),
                image_type=draw(st.sampled_from(["", "image/webp", "image/png"])),
                completion=draw(texts),
                reward=draw(numbers),
                rewards=draw(st.dictionaries(texts, numbers, max_size=3)),
                solution=draw(texts),
            )
    return episode


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _same(ours: object, theirs: object) -> bool:
    """JSON values equal, reading NaN as equal to NaN."""
    if isinstance(ours, float) and isinstance(theirs, float):
        return ours == theirs or (math.isnan(ours) and math.isnan(theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(_same, ours, theirs))
    return ours == theirs


@settings(max_examples=300, deadline=None)
@given(episodes())
def test_the_json_is_the_protobuf_mapping(episode: episode_pb2.Episode) -> None:
    text = episode_json(episode)
    assert "\n" not in text and "\r" not in text  # one `data:` line of an event
    back = json_format.Parse(text, episode_pb2.Episode())
    assert back.SerializeToString(deterministic=True) == episode.SerializeToString(
        deterministic=True
    ) or _same(json_format.MessageToDict(back), json_format.MessageToDict(episode))
    ours = json.loads(text)
    theirs = json.loads(json_format.MessageToJson(episode))
    if "imitation" in theirs and "angles" in theirs["imitation"]:
        assert [_float32(a) for a in ours["imitation"].pop("angles")] == [
            _float32(a) for a in theirs["imitation"].pop("angles")
        ]
    assert _same(ours, theirs), (ours, theirs)


@settings(max_examples=300, deadline=None)
@given(episodes(st.floats(allow_nan=False, allow_infinity=True)))
def test_json_format_reads_back_the_same_message(episode: episode_pb2.Episode) -> None:
    assert json_format.Parse(episode_json(episode), episode_pb2.Episode()) == episode


@settings(max_examples=500, deadline=None)
@given(st.integers(SECONDS_MIN, SECONDS_MAX), nanos)
def test_timestamps_are_written_as_json_format_writes_them(seconds: int, nanos: int) -> None:
    stamp = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    assert module._timestamp(stamp) == stamp.ToJsonString()


@pytest.mark.parametrize(
    ("seconds", "nanos"), [(SECONDS_MIN - 1, 0), (SECONDS_MAX + 1, 0), (0, -1), (0, 10**9)]
)
def test_an_invalid_timestamp_fails_as_in_json_format(seconds: int, nanos: int) -> None:
    stamp = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    with pytest.raises(ValueError):
        stamp.ToJsonString()
    with pytest.raises(ValueError):
        module._timestamp(stamp)


@pytest.mark.parametrize(
    "angles",
    [
        [0.0, -0.0, 1e-45, -1e-45, 1.17549435e-38, 1e37, 9.99999968e37],
        [3.40282347e38, -3.40282347e38, 1e38, 0.5],  # near FLT_MAX: written exactly
        [math.inf, -math.inf, 1.0],  # the contract forbids them; the mapping does not
        [math.sin(i) for i in range(240 * 32)],  # the contract's largest motion
    ],
)
def test_motions_read_back_the_same(angles: list[float]) -> None:
    episode = episode_pb2.Episode(episode=1)
    episode.imitation.angles.extend(angles)
    episode.imitation.frame_count = 1
    episode.imitation.joint_count = len(angles)
    assert json_format.Parse(episode_json(episode), episode_pb2.Episode()) == episode


def test_the_fake_trainers_stream_reads_back_identically() -> None:
    for episode in valid_episodes(60, detail_every=7):
        assert json_format.Parse(episode_json(episode), episode_pb2.Episode()) == episode


def test_it_knows_every_field_of_the_contract() -> None:
    # A new Episode field makes episode_json fall back to json_format: then teach it the field.
    assert module._FAST
