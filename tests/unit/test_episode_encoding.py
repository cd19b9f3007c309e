"""One encoding per episode: ``encode_episode``, the live log that serves it as it is, and the
publisher that hands the same encoding to the store and to the live log."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import cast

import pytest

from gateway.core import live_log
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
    metric each, so that their JSON does not depend on a map's iteration order."""
    grpo = episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d"))
    episodes = [*valid_episodes(12, detail_every=3)]
    episodes += scripted_episodes(grpo, episode_pb2.TrainConfig(max_episodes=3))
    for episode in episodes:
        episode.metrics.clear()
        episode.metrics["loss"] = 0.5
    return episodes


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


def test_the_log_serves_encoded_episodes_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = [encode_episode(e) for e in valid_episodes(300, detail_every=3)]
    _refuse_encoding(monkeypatch)
    log = EpisodeLog("r", keep=100)
    log.publish_encoded(encoded[:150])
    log.publish_encoded(encoded[150:])  # trims the tail to its last 100
    assert (log.base, log.last_episode) == (200, 300)
    fields: list[Callable[[EncodedEpisode], bytes]] = [
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
    publisher = Publisher(run, log, pacer, cast(Store, store), Observer(), lambda: None)
    publisher.details = cast(DetailRetention, details)
    inbox = Inbox()

    async def produce() -> None:
        for episode in episodes:
            await inbox.put(episode, 100)

    _refuse_encoding(monkeypatch)
    reader = asyncio.create_task(produce())
    await publisher.run(inbox, reader)
    await publisher.flush()

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
        assert record.detail_at == encoded.detail_at
        assert record.keep_detail is (record.episode % 2 == 0)
        assert record.detail_json == (encoded.detail_json if record.keep_detail else None)
    assert details.committed_details == [(e.episode, e.has_detail) for e in expected]
