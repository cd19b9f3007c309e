"""``Episode`` messages in the protobuf JSON mapping, fast.

``google.protobuf.json_format`` is pure Python: about 180 us for a plain episode and 13 ms for one
carrying a motion (660 floats, each shortened digit by digit), so a 5000-episode replay would cost
seconds of the event loop. ``episode_json`` writes the same mapping for this one message
directly: field names in lowerCamelCase, int64 as a string, defaults omitted, non-finite doubles as
``"NaN"``/``"Infinity"``, timestamps in RFC 3339. The one difference: ``float`` values (motion
angles) are written with 9 significant digits, which reads back to the same float32, where
json_format searches the shortest such string. ``json_format.Parse`` of the output gives back
the same message (``tests/http/test_episode_json.py`` proves it on generated episodes).

If ``Episode`` gains a field this module does not know, it falls back to json_format for every
episode (correct, slow) and says so once in the log.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable

from google.protobuf import json_format

from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: The fields written here; another field in the descriptor switches to json_format.
KNOWN_FIELDS = frozenset(
    {"episode", "reward", "best_reward", "done", "metrics", "produce_time", "imitation", "grpo"}
)
_KNOWN_DETAIL_FIELDS = {
    "ImitationDetail": frozenset({"frame_count", "joint_count", "angles"}),
    "GrpoDetail": frozenset({"sample_completions"}),
}


def _descriptor_known() -> bool:
    fields = {f.name for f in episode_pb2.Episode.DESCRIPTOR.fields}
    details = {
        d.name: {f.name for f in d.fields}
        for d in (episode_pb2.ImitationDetail.DESCRIPTOR, episode_pb2.GrpoDetail.DESCRIPTOR)
    }
    return fields == KNOWN_FIELDS and details == _KNOWN_DETAIL_FIELDS


_FAST = _descriptor_known()
if not _FAST:  # pragma: no cover - only when the contract grows
    _LOGGER.warning("Episode has fields episode_json does not know: using json_format (slow)")

_string = json.JSONEncoder(ensure_ascii=False).encode


def _double(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    if math.isnan(value):
        return '"NaN"'
    return '"Infinity"' if value > 0 else '"-Infinity"'


def _present(value: float) -> bool:
    """Whether proto3 writes a double: anything but +0.0 (-0.0 is written)."""
    return value != 0 or math.copysign(1.0, value) < 0


def _float(value: float) -> str:
    if not math.isfinite(value):
        return _double(value)
    # Near FLT_MAX nine digits round up past it, which readers reject: the exact value.
    return repr(value) if abs(value) >= 1e38 else f"{value:.9g}"


def _floats(values: Iterable[float]) -> str:
    text = ",".join(map("%.9g".__mod__, values))
    if "n" in text or "e+38" in text:  # nan, inf (the contract forbids them), or huge
        return ",".join(map(_float, values))
    return text


def episode_json(episode: episode_pb2.Episode) -> str:
    """The episode in the protobuf JSON mapping, on one line (see the module docstring)."""
    if not _FAST:  # pragma: no cover
        return json_format.MessageToJson(episode, indent=None, ensure_ascii=False)
    parts: list[str] = []
    if episode.episode:
        parts.append(f'"episode":"{episode.episode}"')
    if _present(episode.reward):
        parts.append(f'"reward":{_double(episode.reward)}')
    if _present(episode.best_reward):
        parts.append(f'"bestReward":{_double(episode.best_reward)}')
    if episode.done:
        parts.append('"done":true')
    if episode.metrics:
        items = ",".join(f"{_string(k)}:{_double(v)}" for k, v in episode.metrics.items())
        parts.append(f'"metrics":{{{items}}}')
    if episode.HasField("produce_time"):
        parts.append(f'"produceTime":"{episode.produce_time.ToJsonString()}"')
    kind = episode.WhichOneof("detail")
    if kind == "imitation":
        motion = episode.imitation
        inner = []
        if motion.frame_count:
            inner.append(f'"frameCount":{motion.frame_count}')
        if motion.joint_count:
            inner.append(f'"jointCount":{motion.joint_count}')
        if motion.angles:
            inner.append(f'"angles":[{_floats(motion.angles)}]')
        parts.append(f'"imitation":{{{",".join(inner)}}}')
    elif kind == "grpo":
        completions = episode.grpo.sample_completions
        inner_grpo = f'"sampleCompletions":{_string(list(completions))}' if completions else ""
        parts.append(f'"grpo":{{{inner_grpo}}}')
    return "{" + ",".join(parts) + "}"
