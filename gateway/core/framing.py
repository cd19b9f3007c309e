"""Episode framing: an episode's encodings, and the protobuf framing that sends them unchanged.

A *frame* is the protobuf encoding of field 1 (length-delimited) holding a serialized
``Episode``. That one byte string is at once a complete ``WatchRunResponse`` with ``episode``
set and one element of ``EpisodeBatch.episodes``, so publishing to any number of watchers never
re-serializes an episode, and a batch is a single ``bytes.join`` (``encode_batch``).

A history is read in one of four *views* (``view_of``), each a byte string per episode: the
frame with the episode's detail or without it (``SCALARS``), or the episode's JSON (``JSON``:
the protobuf JSON mapping, ``gateway.core.episode_json``) with or without its detail.

Invariants:

* An episode's serialized bytes are deterministic (map entries in key order), and its detail
  (``Episode.detail``, fields 10 and 11) serializes after every other field: the episode
  without its detail is a prefix of its bytes (``detail_offset``), and its scalar frame is the
  frame of that prefix. An episode without a detail has one frame for both views (the same
  object).
* ``EncodedEpisode`` is the one encoding of a published episode: its bytes, frames and JSON are
  each written at most once (``encode_episode``), and every consumer (the store, the live log)
  takes them from it rather than encoding the episode again. Its detail's JSON (a motion:
  ~0.13 ms and ~6 KiB) is written only when the store keeps the detail; otherwise the live log
  writes it from the frame if an HTTP watcher ever asks (``detail_json_of``), which gives the
  same bytes (``encode_episode`` writes it at once where it would not: see there).
* A batch holds at most ``MAX_BATCH_EPISODES`` episodes and, unless a single frame is larger,
  at most ``MAX_BATCH_BYTES`` bytes (``batch_end``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gateway.core.episode_json import join_json, json_parts
from trainwire.v1 import episode_pb2

MAX_BATCH_EPISODES = 256
#: The largest batch message. A watcher holds at most one message in flight, and gRPC a copy of
#: it, so this bounds what a watcher that stopped reading costs the gateway (~256 KiB).
MAX_BATCH_BYTES = 128 << 10
_EPISODE_TAG = b"\x0a"  # field 1, wire type 2: WatchRunResponse.episode / EpisodeBatch.episodes
_BATCH_TAG = b"\x2a"  # field 5, wire type 2: WatchRunResponse.batch

#: A view of a history is the sum of these flags (0: frames with their detail). ``SCALARS``
#: is 1, so a ``scalars`` bool is a view too.
SCALARS = 1  # without the episode's detail
JSON = 2  # each episode's JSON instead of its frame
VIEWS = 4


def view_of(scalars: bool, json: bool = False) -> int:
    """The view of a history with or without detail (``scalars``), as frames or ``json``."""
    return (SCALARS if scalars else 0) | (JSON if json else 0)


def varint(value: int) -> bytes:
    """The protobuf varint of ``value``."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: ``Episode.detail``'s fields (10: imitation, 11: grpo); they serialize after every other field.
_DETAIL_FIELDS = frozenset({10, 11})


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def detail_offset(data: bytes) -> int:
    """Where the ``detail`` field of a serialized ``Episode`` begins (``len(data)`` when it has
    none, or when ``data`` is not an episode): the episode's numbers are ``data[:offset]``."""
    i = 0
    end = len(data)
    try:
        while i < end:
            start = i
            key, i = _read_varint(data, i)
            if key >> 3 in _DETAIL_FIELDS:
                return start
            wire = key & 7
            if wire == 0:
                _, i = _read_varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                length, i = _read_varint(data, i)
                i += length
            elif wire == 5:
                i += 4
            else:
                return end
    except IndexError:
        return end
    return end


#: The tag and length of every frame of fewer than 2^14 bytes (all but the largest motions),
#: looked up instead of written: a replay from the store frames every episode it reads. The
#: length is a one- or two-byte varint.
_HEADS = [bytes((0x0A, n)) for n in range(1 << 7)] + [
    bytes((0x0A, n & 0x7F | 0x80, n >> 7)) for n in range(1 << 7, 1 << 14)
]


def encode_frame(episode_bytes: bytes) -> bytes:
    """The frame of a serialized ``Episode`` (see the module docstring)."""
    size = len(episode_bytes)
    if size < len(_HEADS):
        return _HEADS[size] + episode_bytes
    return _EPISODE_TAG + varint(size) + episode_bytes


def frame_payload(frame: bytes) -> bytes:
    """The serialized ``Episode`` inside a frame."""
    i = 1
    while frame[i] & 0x80:
        i += 1
    return frame[i + 1 :]


def encode_batch(frames: Sequence[bytes]) -> bytes:
    """A serialized ``WatchRunResponse`` whose ``batch`` holds these frames' episodes."""
    body = b"".join(frames)
    return _BATCH_TAG + varint(len(body)) + body


def batch_end(
    frames: Sequence[bytes],
    lo: int,
    end: int,
    max_episodes: int = MAX_BATCH_EPISODES,
    max_bytes: int = MAX_BATCH_BYTES,
) -> int:
    """The end of the batch that starts at ``frames[lo]``: at most ``max_episodes`` frames up to
    ``end`` and, unless a single frame is larger, at most ``max_bytes`` bytes (message overhead
    included)."""
    # 6 bytes: the batch tag and its length varint (a 1 MiB body needs 3-4 bytes).
    limit = min(end, lo + max_episodes)
    if limit <= lo:
        return lo
    # The running sizes, and how many of them fit (in C: a replay sizes every episode).
    sizes = list(itertools.accumulate(map(len, frames[lo:limit])))
    return lo + max(1, bisect.bisect_right(sizes, max_bytes - 6))


def split_batches(
    frames: Sequence[bytes],
    start: int,
    end: int,
    max_episodes: int = MAX_BATCH_EPISODES,
    max_bytes: int = MAX_BATCH_BYTES,
) -> Iterator[tuple[int, int]]:
    """Splits ``frames[start:end]`` into ``(lo, hi)`` ranges (see ``batch_end``)."""
    lo = start
    while lo < end:
        hi = batch_end(frames, lo, end, max_episodes, max_bytes)
        yield lo, hi
        lo = hi


def scalar_frame(frame: bytes) -> bytes:
    """The frame of the same episode without its detail (the same object when it has none)."""
    payload = frame_payload(frame)
    at = detail_offset(payload)
    return frame if at == len(payload) else encode_frame(payload[:at])


@dataclass(frozen=True, slots=True)
class EncodedEpisode:
    """One published episode, encoded once for every consumer (see the module docstring).

    ``data`` is the deterministic serialization; ``detail_at`` where its detail begins (-1:
    it has none); ``frame`` and ``scalar_frame`` its frames with and without the detail (the
    same object when it has none); ``json`` and ``scalar_json`` its JSON with and without the
    detail (the same object when it has none); ``detail_json`` the detail as a member of the
    JSON object (``json_parts``), None when it has none. Where the detail's JSON was not
    written (``encode_episode``), ``json`` and ``detail_json`` are None.
    """

    episode: int
    reward: float
    best_reward: float
    data: bytes
    detail_at: int
    frame: bytes
    scalar_frame: bytes
    json: bytes | None
    scalar_json: bytes
    detail_json: bytes | None

    @property
    def has_detail(self) -> bool:
        """Whether the episode carries a detail."""
        return self.detail_at >= 0


def encode_episode(episode: episode_pb2.Episode, keep_detail: bool = True) -> EncodedEpisode:
    """The one encoding of ``episode`` (see ``EncodedEpisode``); its detail's JSON only when
    ``keep_detail`` (the store keeps the detail, and its record the JSON) or when the detail's
    bytes would not give the same JSON back (``detail_json_of``)."""
    # Deterministic: map entries (metrics) in key order, so the stored bytes are canonical
    # and a watcher can compare what it got with any replay byte for byte.
    data = episode.SerializeToString(deterministic=True)
    frame = encode_frame(data)
    kind = episode.WhichOneof("detail")
    if kind is None:
        detail_at, scalars = -1, frame
    else:
        # The detail field serializes last: its tag (one byte), its length, its message.
        size = getattr(episode, kind).ByteSize()
        detail_at = len(data) - 1 - len(varint(size)) - size
        scalars = encode_frame(data[:detail_at])
    write_detail = kind is not None and (keep_detail or not _rebuilt_exactly(episode, kind))
    numbers_json, detail_json = json_parts(episode, detail=write_detail)
    if kind is None:
        json: bytes | None = numbers_json
    else:
        json = None if detail_json is None else join_json(numbers_json, detail_json)
    return EncodedEpisode(
        episode.episode,
        episode.reward,
        episode.best_reward,
        data,
        detail_at,
        frame,
        scalars,
        json,
        numbers_json,
        detail_json,
    )


def _rebuilt_exactly(episode: episode_pb2.Episode, kind: str) -> bool:
    """Whether the JSON of the episode's detail, written from the detail's serialized bytes
    (``detail_json_of``), is the JSON of the detail in memory. A motion's is; a map's entries
    are written in the order the message iterates them, which depends on how it was filled, so
    a GRPO sample with two rewards or more may not be."""
    return kind != "grpo" or all(len(sample.rewards) < 2 for sample in episode.grpo.samples)


def detail_json_of(frame: bytes) -> bytes | None:
    """The JSON of a frame's episode's detail, as ``json_parts`` writes it (None: it has none),
    from the detail's bytes alone (parsed as an ``Episode`` holding just its detail)."""
    payload = frame_payload(frame)
    at = detail_offset(payload)
    if at == len(payload):
        return None
    return json_parts(episode_pb2.Episode.FromString(payload[at:]))[1]


@dataclass(frozen=True, slots=True)
class EpisodeFrames:
    """Consecutive episodes for a watcher, as frames (or, in a ``JSON`` view, their JSON).

    ``batch`` says they go out as one ``EpisodeBatch``; otherwise there is exactly one frame and
    it goes out as a single ``episode``. ``first`` is the number of the first episode. Immutable,
    so one object can go to every watcher that is at the same place
    (``EpisodeLog.frames_event``).
    """

    frames: Sequence[bytes]
    batch: bool
    first: int
