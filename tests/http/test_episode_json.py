"""``episode_json`` writes the protobuf JSON mapping of ``Episode``: json_format reads back the
same message, and the JSON equals json_format's own but for the digits of float32 angles."""

from __future__ import annotations

import json
import math
import struct

from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http import episode_json as module
from gateway.http.episode_json import episode_json
from tests.fakes.fake_trainer import valid_episodes
from trainwire.v1 import episode_pb2

doubles = st.floats(allow_nan=True, allow_infinity=True)
float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
texts = st.text(max_size=40)


@st.composite
def episodes(draw: st.DrawFn) -> episode_pb2.Episode:
    episode = episode_pb2.Episode(
        episode=draw(st.integers(0, 2**63 - 1)),
        reward=draw(doubles),
        best_reward=draw(doubles),
        done=draw(st.booleans()),
        metrics=draw(st.dictionaries(texts, doubles, max_size=4)),
    )
    if draw(st.booleans()):
        episode.produce_time.FromNanoseconds(draw(st.integers(0, 4_000_000_000 * 10**9)))
    kind = draw(st.sampled_from(["none", "imitation", "grpo"]))
    if kind == "imitation":
        episode.imitation.frame_count = draw(st.integers(0, 240))
        episode.imitation.joint_count = draw(st.integers(0, 32))
        episode.imitation.angles.extend(draw(st.lists(float32s, max_size=50)))
    elif kind == "grpo":
        episode.grpo.sample_completions.extend(draw(st.lists(texts, max_size=4)))
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


def test_the_fake_trainers_stream_reads_back_identically() -> None:
    for episode in valid_episodes(60, detail_every=7):
        assert json_format.Parse(episode_json(episode), episode_pb2.Episode()) == episode


def test_it_knows_every_field_of_the_contract() -> None:
    # A new Episode field makes episode_json fall back to json_format: then teach it the field.
    assert module._FAST
