"""``Episode`` messages in the protobuf JSON mapping, fast.

``google.protobuf.json_format`` is pure Python and shortens each float digit by digit: too slow for
a replay on the event loop (figures: README, "Measurements behind the design"). ``episode_json``
writes the same mapping for this one message directly: field names in lowerCamelCase, int64 as a
string, defaults omitted, non-finite doubles as ``"NaN"``/``"Infinity"``, timestamps in RFC 3339.
The one difference: ``float`` values (motion angles) are written with 9 significant digits, which
reads back to the same float32, where json_format searches the shortest such string.
``json_format.Parse`` of the output gives back the same message (``tests/http/test_episode_json.py``
proves it on generated episodes). A GRPO sample's thumbnail (``bytes``) is standard base64, as the
mapping writes bytes: the page shows it as a ``data:`` URL of its ``imageType``.

If ``Episode`` gains a field this module does not know, it falls back to json_format for every
episode (correct, slow) and says so once in the log.
"""

from __future__ import annotations

import base64
import datetime
import functools
import logging
import math
from collections.abc import Sequence
from json.encoder import encode_basestring

from google.protobuf import json_format, timestamp_pb2

from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: The fields written here; another field in the descriptor switches to json_format.
KNOWN_FIELDS = frozenset(
    {"episode", "reward", "best_reward", "done", "metrics", "produce_time", "imitation", "grpo"}
)
_KNOWN_DETAIL_FIELDS = {
    "ImitationDetail": frozenset({"frame_count", "joint_count", "angles"}),
    "GrpoDetail": frozenset({"sample_completions", "samples"}),
    "GrpoSample": frozenset(
        {"prompt", "image", "image_type", "completion", "reward", "rewards", "solution"}
    ),
}


def _descriptor_known() -> bool:
    fields = {f.name for f in episode_pb2.Episode.DESCRIPTOR.fields}
    details = {
        d.name: {f.name for f in d.fields}
        for d in (
            episode_pb2.ImitationDetail.DESCRIPTOR,
            episode_pb2.GrpoDetail.DESCRIPTOR,
            episode_pb2.GrpoSample.DESCRIPTOR,
        )
    }
    return fields == KNOWN_FIELDS and details == _KNOWN_DETAIL_FIELDS


_FAST = _descriptor_known()
if not _FAST:  # pragma: no cover - only when the contract grows
    _LOGGER.warning("Episode has fields episode_json does not know: using json_format (slow)")

#: JSON of a string, as ``json.JSONEncoder(ensure_ascii=False)`` writes it (its C encoder).
_string = encode_basestring
_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()
_SECONDS_MIN, _SECONDS_MAX = -62135596800, 253402300799  # 0001-01-01 .. 9999-12-31


def _double(value: float) -> str:
    text = repr(value)
    if "n" in text:  # nan, inf, -inf: the only reprs with an "n"
        return '"NaN"' if text == "nan" else ('"Infinity"' if text == "inf" else '"-Infinity"')
    return text


def _float(value: float) -> str:
    # Near FLT_MAX nine digits round up past it, which readers reject: the exact value; and
    # "-0" reads back as the integer 0, without its sign: "-0.0".
    if not math.isfinite(value) or abs(value) >= 1e38 or value == 0:
        return _double(value)
    return f"{value:.9g}"


@functools.lru_cache(maxsize=16)
def _floats_format(count: int) -> str:
    # One %-format for a whole motion: a third of the time of one call per value.
    return ",".join(["%.9g"] * count)


def _floats(values: Sequence[float]) -> str:
    numbers = tuple(values)
    text = _floats_format(len(numbers)) % numbers
    if "n" in text or "e+38" in text or "-0," in text or text.endswith("-0"):
        # nan, inf (the contract forbids them), huge, or -0.0: see _float
        return ",".join(map(_float, numbers))
    return text


@functools.lru_cache(maxsize=256)
def _second(seconds: int) -> str:
    # Episodes come many to a second: each second is written once.
    days, second = divmod(seconds, 86400)
    date = datetime.date.fromordinal(_EPOCH_ORDINAL + days)
    return f"{date.isoformat()}T{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}"


def _timestamp(stamp: timestamp_pb2.Timestamp) -> str:
    """``stamp.ToJsonString()`` (RFC 3339, Z, 0/3/6/9 fractional digits), faster."""
    seconds, nanos = stamp.seconds, stamp.nanos
    if not (_SECONDS_MIN <= seconds <= _SECONDS_MAX and 0 <= nanos < 1_000_000_000):
        return stamp.ToJsonString()  # raises ValueError, as json_format does
    if nanos == 0:
        return _second(seconds) + "Z"
    if nanos % 1000:
        return f"{_second(seconds)}.{nanos:09d}Z"
    if nanos % 1_000_000:
        return f"{_second(seconds)}.{nanos // 1000:06d}Z"
    return f"{_second(seconds)}.{nanos // 1_000_000:03d}Z"


def episode_json(episode: episode_pb2.Episode) -> str:
    """The episode in the protobuf JSON mapping, on one line (see the module docstring)."""
    numbers, detail = json_parts(episode)
    return join_json(numbers, detail).decode()


def join_json(numbers: bytes, detail: bytes | None) -> bytes:
    """The JSON of a whole episode from its ``json_parts``."""
    if detail is None:
        return numbers
    return numbers[:-1] + (b"," if len(numbers) > 2 else b"") + detail + b"}"


def json_parts(episode: episode_pb2.Episode, detail: bool = True) -> tuple[bytes, bytes | None]:
    """The episode's JSON apart from its detail, as the store keeps them: the object of its
    numbers (every field but ``detail``) and the detail as a member of that object
    (``"imitation":{...}``), or None when it has none (or ``detail`` is False: the numbers
    only); ``join_json`` puts them together, and the numbers alone are the episode's scalar
    view."""
    if not _FAST:  # pragma: no cover
        numbers, detail_json = _slow_parts(episode)
        return numbers, detail_json if detail else None
    parts: list[str] = []
    number = episode.episode
    if number:
        parts.append(f'"episode":"{number}"')
    # proto3 writes a double unless it is +0.0 (-0.0 is written, NaN too).
    reward = episode.reward
    if reward or math.copysign(1.0, reward) < 0:
        parts.append(f'"reward":{_double(reward)}')
    best = episode.best_reward
    if best or math.copysign(1.0, best) < 0:
        parts.append(f'"bestReward":{_double(best)}')
    if episode.done:
        parts.append('"done":true')
    metrics = episode.metrics
    if metrics:
        # Keys, then values by key: a map's items() iterates in Python, twice as slow.
        items = ",".join([f"{_string(k)}:{_double(metrics[k])}" for k in metrics])
        parts.append(f'"metrics":{{{items}}}')
    if episode.HasField("produce_time"):
        parts.append(f'"produceTime":"{_timestamp(episode.produce_time)}"')
    numbers = ("{" + ",".join(parts) + "}").encode()
    kind = episode.WhichOneof("detail") if detail else None
    if kind == "imitation":
        motion = episode.imitation
        inner = []
        if motion.frame_count:
            inner.append(f'"frameCount":{motion.frame_count}')
        if motion.joint_count:
            inner.append(f'"jointCount":{motion.joint_count}')
        if motion.angles:
            inner.append(f'"angles":[{_floats(motion.angles)}]')
        return numbers, f'"imitation":{{{",".join(inner)}}}'.encode()
    if kind == "grpo":
        grpo = episode.grpo
        completions = grpo.sample_completions
        samples = grpo.samples
        inner_grpo = []
        if completions:
            inner_grpo.append(f'"sampleCompletions":[{",".join(map(_string, completions))}]')
        if samples:
            inner_grpo.append(f'"samples":[{",".join(map(_sample, samples))}]')
        return numbers, f'"grpo":{{{",".join(inner_grpo)}}}'.encode()
    return numbers, None


def _sample(sample: episode_pb2.GrpoSample) -> str:
    """One ``GrpoSample`` object (fields at their default left out, as for the episode)."""
    parts: list[str] = []
    if sample.prompt:
        parts.append(f'"prompt":{_string(sample.prompt)}')
    image = sample.image
    if image:
        parts.append(f'"image":"{base64.b64encode(image).decode("ascii")}"')
    if sample.image_type:
        parts.append(f'"imageType":{_string(sample.image_type)}')
    if sample.completion:
        parts.append(f'"completion":{_string(sample.completion)}')
    reward = sample.reward
    if reward or math.copysign(1.0, reward) < 0:
        parts.append(f'"reward":{_double(reward)}')
    rewards = sample.rewards
    if rewards:
        items = ",".join([f"{_string(k)}:{_double(rewards[k])}" for k in rewards])
        parts.append(f'"rewards":{{{items}}}')
    if sample.solution:
        parts.append(f'"solution":{_string(sample.solution)}')
    return "{" + ",".join(parts) + "}"


def _slow_parts(episode: episode_pb2.Episode) -> tuple[bytes, bytes | None]:  # pragma: no cover
    kind = episode.WhichOneof("detail")
    numbers = episode_pb2.Episode()
    numbers.CopyFrom(episode)
    if kind is not None:
        numbers.ClearField(kind)
    text = json_format.MessageToJson(numbers, indent=None, ensure_ascii=False).encode()
    if kind is None:
        return text, None
    name = episode.DESCRIPTOR.fields_by_name[kind].json_name
    detail = json_format.MessageToJson(getattr(episode, kind), indent=None, ensure_ascii=False)
    return text, f'"{name}":{detail}'.encode()
