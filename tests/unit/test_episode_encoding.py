"""One encoding per episode: ``encode_episode``, the live log that serves it as it is, and the
publisher that hands the same encoding to the store and to the live log. A detail the store
drops has no JSON written at publication: the live log writes it, from the frame, only for an
HTTP watcher that asks, the same bytes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import cast

import pytest

from gateway.core import framing, live_log
from gateway.core.details import DetailRetention
from gateway.core.episode_json import join_json, json_parts
from gateway.core.feed import Inbox
from gateway.core.framing import (
    JSON,
    SCALARS,
    VIEWS,
    EncodedEpisode,
    detail_offset,
    encode_episode,
    encode_frame,
    frame_payload,
    scalar_frame,
)
from gateway.core.live_log import EpisodeLog
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.publisher import Publisher
from gateway.core.store import EpisodeRecord, Store
from tests.fakes.episodes import scripted_episodes
from tests.fakes.fake_trainer import valid_episodes
from tests.store.test_store_contract import make_run
from trainwire.v1 import episode_pb2


def _episodes() -> list[episode_pb2.Episode]:
    """Imitation episodes with and without a motion, and GRPO episodes with samples; one
    metric each and one reward per sample, so that their JSON does not depend on a map's
    iteration order (which a message read back from bytes need not keep)."""
    grpo = episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d"))
    episodes = [*valid_episodes(12, detail_every=3)]
    episodes += scripted_episodes(grpo, episode_pb2.TrainConfig(max_episodes=3))
    for episode in episodes:
        episode.metrics.clear()
        episode.metrics["loss"] = 0.5
        for sample in episode.grpo.samples:
            sample.rewards.clear()
            sample.rewards["format"] = 1.0
    return episodes


def _grpo_with_rewards() -> episode_pb2.Episode:
    """A GRPO episode whose sample has two rewards, filled out of key order: the JSON of its
    detail follows the map's order in memory, which its bytes do not keep."""
    episode = episode_pb2.Episode(episode=7, reward=0.5)
    sample = episode.grpo.samples.add(prompt="p", completion="c", reward=1.0)
    for key in ("z", "format", "b", "accuracy", "m"):
        sample.rewards[key] = 0.25
    return episode


def _order_lost(episode: episode_pb2.Episode) -> bool:
    """Whether the JSON of the episode's detail, read back from its bytes, may put a map's
    entries in another order (a GRPO sample with two rewards or more)."""
    return any(len(s.rewards) > 1 for s in episode.grpo.samples)


def _spy_detail_json(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The details' JSON that ``encode_episode`` writes from now on."""
    written: list[bytes] = []
    parts = framing.json_parts

    def spy(episode: episode_pb2.Episode, detail: bool = True) -> tuple[bytes, bytes | None]:
        numbers, detail_json = parts(episode, detail)
        if detail_json is not None:
            written.append(detail_json)
        return numbers, detail_json

    monkeypatch.setattr(framing, "json_parts", spy)
    return written


def _refuse_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(episode: episode_pb2.Episode) -> tuple[bytes, bytes | None]:
        raise AssertionError("the live log encoded an episode")

    monkeypatch.setattr(live_log, "json_parts", refused)


def test_an_encoded_episode_holds_what_its_frames_give() -> None:
    for episode in _episodes():
        encoded = encode_episode(episode)
        data = episode.SerializeToString(deterministic=True)
        has_detail = episode.WhichOneof("detail") is not None
        assert encoded.data == data and encoded.episode == episode.episode
        assert (encoded.reward, encoded.best_reward) == (episode.reward, episode.best_reward)
        assert encoded.frame == encode_frame(data)
        assert encoded.scalar_frame == scalar_frame(encoded.frame)
        assert encoded.has_detail is has_detail
        if has_detail:
            assert encoded.detail_at == detail_offset(data) < len(data)
        else:
            assert encoded.detail_at == -1 and encoded.scalar_frame is encoded.frame
        numbers, detail = json_parts(episode)
        assert (encoded.scalar_json, encoded.detail_json) == (numbers, detail)
        assert encoded.json == join_json(numbers, detail)
        # What a log given the frame alone writes (a restore, a replica).
        log = EpisodeLog("r")
        log.publish([encoded.frame])
        assert log.episodes(JSON, 0, 1) == [encoded.json]
        assert log.episodes(JSON | SCALARS, 0, 1) == [encoded.scalar_json]


def test_a_detail_the_store_drops_is_not_json_encoded_at_publication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    episodes = _episodes()
    assert not any(_order_lost(e) for e in episodes)
    kept = [encode_episode(e) for e in episodes]
    written = _spy_detail_json(monkeypatch)
    dropped = [encode_episode(e, keep_detail=False) for e in episodes]
    assert not written
    assert {e.WhichOneof("detail") for e in episodes} == {None, "imitation", "grpo"}
    for encoded, full in zip(dropped, kept, strict=True):
        # Everything but the detail's JSON is as when the store keeps the detail.
        assert (encoded.data, encoded.frame, encoded.scalar_frame, encoded.scalar_json) == (
            full.data,
            full.frame,
            full.scalar_frame,
            full.scalar_json,
        )
        if encoded.has_detail:
            assert encoded.json is None and encoded.detail_json is None
        else:
            assert encoded.json is encoded.scalar_json == full.json


def test_an_http_watcher_gets_the_json_of_a_detail_not_written_at_publication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    episodes = list(valid_episodes(300, detail_every=1))  # a motion every episode
    expected = [encode_episode(e) for e in episodes]
    encoded = [encode_episode(e, keep_detail=e.episode % 50 == 0) for e in episodes]
    _refuse_encoding(monkeypatch)  # nothing parsed and written whole: only details from frames
    log = EpisodeLog("r", keep=100)
    log.publish_encoded(encoded[:150])
    log.publish_encoded(encoded[150:])  # trims the tail to its last 100
    # Written for a watcher with the detail, once; the others need none.
    written = _spy_detail_json(monkeypatch)
    assert log.episodes(0, 200, 300) == [e.frame for e in expected[200:]]
    assert log.episodes(SCALARS, 200, 300) == [e.scalar_frame for e in expected[200:]]
    numbers = log.episodes(JSON | SCALARS, 200, 300)
    assert all(n is e.scalar_json for n, e in zip(numbers, encoded[200:], strict=True))
    assert not written
    event = log.frames_event(249, 250, JSON)  # one episode kept by the store: written then
    assert event.frames[0] is encoded[249].json == expected[249].json
    assert not written
    full = log.episodes(JSON, 200, 300)
    assert full == [e.json for e in expected[200:]]  # the same bytes
    assert len(written) == 98  # the two the store keeps were written at publication
    assert all(a is b for a, b in zip(log.episodes(JSON, 200, 300), full, strict=True))
    assert len(written) == 98  # written once, kept as before


def test_a_detail_whose_bytes_lose_its_order_is_written_at_publication() -> None:
    episode = _grpo_with_rewards()
    assert _order_lost(episode)
    numbers, detail = json_parts(episode)
    encoded = encode_episode(episode, keep_detail=False)
    assert (encoded.json, encoded.detail_json) == (join_json(numbers, detail), detail)
    log = EpisodeLog("r")
    log.publish_encoded([encoded])
    assert log.episodes(JSON, 0, 1) == [encoded.json]


def test_the_log_serves_encoded_episodes_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = [encode_episode(e) for e in valid_episodes(300, detail_every=3)]
    _refuse_encoding(monkeypatch)
    log = EpisodeLog("r", keep=100)
    log.publish_encoded(encoded[:150])
    log.publish_encoded(encoded[150:])  # trims the tail to its last 100
    assert (log.base, log.last_episode) == (200, 300)
    fields: list[Callable[[EncodedEpisode], bytes | None]] = [
        lambda e: e.frame,
        lambda e: e.scalar_frame,
        lambda e: e.json,
        lambda e: e.scalar_json,
    ]
    assert len(fields) == VIEWS
    for view, field in enumerate(fields):
        held = log.episodes(view, 200, 300)
        assert all(h is field(e) for h, e in zip(held, encoded[200:], strict=True))
    event = log.frames_event(299, 300, JSON)
    assert event.frames[0] is encoded[299].json and event.first == 300


class _Store:
    """Commits every episode on the next loop iteration."""

    def __init__(self) -> None:
        self.records: list[EpisodeRecord] = []

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        self.records.append(record)
        asyncio.get_running_loop().call_soon(callback, None)


class _EvenDetails:
    """Keeps the details of even episodes for good; records what it is told of commits."""

    def __init__(self) -> None:
        self.committed_details: list[tuple[int, bool]] = []

    def keeps(self, episode: int, done: bool) -> bool:
        return episode % 2 == 0

    def committed(self, episode: int, reward: float, has_detail: bool) -> None:
        self.committed_details.append((episode, has_detail))


async def test_the_publisher_hands_one_encoding_to_the_store_and_the_live_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    episodes = list(valid_episodes(12, detail_every=3))
    expected = [encode_episode(e) for e in episodes]
    run = make_run("r", episodes=len(episodes))
    log = EpisodeLog(run.id)
    store = _Store()
    details = _EvenDetails()
    pacer = Pacer(math.inf, 1.0, lambda: 0.0)
    publisher = Publisher(
        run,
        log,
        pacer,
        cast(Store, store),
        Observer(),
        lambda: None,
        cast(DetailRetention, details),
    )
    inbox = Inbox()

    async def produce() -> None:
        for episode in episodes:
            await inbox.put(episode, 100)

    _refuse_encoding(monkeypatch)
    details_written = _spy_detail_json(monkeypatch)
    reader = asyncio.create_task(produce())
    await publisher.run(inbox, reader)
    await publisher.flush()
    assert len(details_written) == sum(
        1 for e in episodes if e.episode % 2 == 0 and e.WhichOneof("detail")
    )
    # The JSON view before a JSON watcher reads it (b"": not written yet).
    written = list(log._views[JSON])
    assert all(w in (b"", e.json) for w, e in zip(written, expected, strict=True))

    n = len(episodes)
    assert log.last_episode == run.episode == n
    frames = log.episodes(0, 0, n)
    scalars = log.episodes(SCALARS, 0, n)
    full = log.episodes(JSON, 0, n)
    numbers = log.episodes(JSON | SCALARS, 0, n)
    for i, (record, encoded) in enumerate(zip(store.records, expected, strict=True)):
        # The store and the log hold the same encoding: the very objects, not equal copies.
        assert frame_payload(frames[i]) == record.data == encoded.data
        assert record.scalars == frame_payload(scalars[i])
        assert numbers[i] is record.numbers_json and numbers[i] == encoded.scalar_json
        assert full[i] == encoded.json  # the detail's JSON even where the store drops it
        if encoded.has_detail:
            # Written at publication only where the store keeps it: the others from the frame.
            assert (record.detail_json is None) is (written[i] == b"")
        assert record.detail_at == encoded.detail_at
        assert record.keep_detail is (record.episode % 2 == 0)
        assert record.detail_json == (encoded.detail_json if record.keep_detail else None)
    assert details.committed_details == [(e.episode, e.has_detail) for e in expected]
