"""``GET /v1/runs/{id}/events`` read with a strict parser: replay, resume exactly once
(``Last-Event-ID``, ``?after``), the scalar view, keepalives, the end, cuts, coalesced writes,
and a second replay served from the event cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from gateway.core import framing, live_log
from gateway.core.store import base
from gateway.http import sse
from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import collect
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.http.conftest import Http, http_gateway
from tests.http.harness import Stream, read_stream
from tests.http.test_api import error_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def events_url(http: Http, run_id: str, query: str = "") -> str:
    return f"{http.url}/v1/runs/{run_id}/events{query}"


async def finished_run(http: Http, episodes: int) -> str:
    run = await http.create(max_episodes=episodes)
    await http.wait_state(run["id"], "STATE_DONE")
    return str(run["id"])


async def test_replay_of_a_finished_run_is_every_episode_once_then_caught_up_and_finished(
    http: Http,
) -> None:
    run_id = await finished_run(http, 300)
    stream = await read_stream(http.session, events_url(http, run_id))
    assert stream.ended and stream.parser.retry == [sse.RETRY_MS]
    assert stream.numbers == list(range(1, 301))
    assert stream.kinds[-2:] == ["caught_up", "finished"]
    assert stream.events[-2].data.replace(" ", "") == '{"lastEpisode":"300"}'
    final = stream.finished
    assert final is not None and final["state"] == "STATE_DONE" and final["episode"] == "300"
    # The same episodes, field for field, as WatchRun sends them.
    over_grpc = await collect(http.grpc.stub, run_id)
    assert stream.episodes == over_grpc.episodes


async def test_after_and_last_event_id_resume_exactly_once(http: Http) -> None:
    run_id = await finished_run(http, 60)
    stream = await read_stream(http.session, events_url(http, run_id, "?after=50"))
    assert stream.numbers == list(range(51, 61))
    # A reconnect: Last-Event-ID wins over the ?after= of the URL it first opened.
    stream = await read_stream(
        http.session, events_url(http, run_id, "?after=10"), headers={"Last-Event-ID": "55"}
    )
    assert stream.numbers == list(range(56, 61))
    stream = await read_stream(http.session, events_url(http, run_id, "?after=60"))
    assert stream.numbers == [] and stream.kinds == ["caught_up", "finished"]
    stream = await read_stream(http.session, events_url(http, run_id, "?after=900"))
    assert stream.kinds == ["caught_up", "finished"]


@pytest.mark.parametrize(
    ("query", "headers", "field"),
    [
        ("?after=-1", None, "after"),
        ("?after=ten", None, "after"),
        ("", {"Last-Event-ID": "x"}, "Last-Event-ID"),
        ("", {"Last-Event-ID": str(1 << 63)}, "Last-Event-ID"),
        ("?view=summary", None, "view"),
        ("?view=SCALARS", None, "view"),
        ("?view=", None, "view"),
    ],
)
async def test_a_bad_resume_point_or_view_is_400(
    http: Http, query: str, headers: dict[str, str] | None, field: str
) -> None:
    run_id = await finished_run(http, 3)
    status, reply = await http.call("GET", f"/v1/runs/{run_id}/events{query}", headers=headers)
    error = error_of(reply)
    assert (status, error["status"]) == (400, "INVALID_ARGUMENT")
    assert error["details"][0]["fieldViolations"][0]["field"] == field


async def test_an_unknown_run_is_404_before_any_event(http: Http) -> None:
    status, reply = await http.call("GET", "/v1/runs/nosuchrun/events")
    assert (status, error_of(reply)["status"]) == (404, "NOT_FOUND")


async def test_live_episodes_keepalives_while_paused_and_the_end(http: Http) -> None:
    run_id = (await http.create(max_episodes=3000, episodes_per_second=40))["id"]
    base = f"/v1/runs/{run_id}"
    stream = Stream()
    reader = asyncio.create_task(
        read_stream(http.session, events_url(http, run_id), stream=stream, timeout=JOB_TIMEOUT)
    )
    await until(lambda: len(stream.numbers) >= 10, "10 episodes")
    assert "caught_up" in stream.kinds
    await http.ok("POST", f"{base}:pause")
    # Keepalives every 0.2 s here.
    await until(lambda: stream.parser.comments.count("keepalive") >= 3, "3 keepalives")
    await http.ok("POST", f"{base}:resume")
    count = len(stream.numbers)
    await until(lambda: len(stream.numbers) >= count + 10, "10 episodes after the resume")
    await http.ok("POST", f"{base}:stop")
    result = await reader
    assert result.ended and result.kinds.count("caught_up") == 1
    assert result.numbers == list(range(1, result.numbers[-1] + 1))
    assert result.finished is not None and result.finished["state"] == "STATE_STOPPED"
    assert result.finished["episode"] == str(result.numbers[-1])


async def test_a_reconnect_with_last_event_id_continues_without_gap_or_duplicate(
    http: Http,
) -> None:
    run_id = (await http.create(max_episodes=150, episodes_per_second=60))["id"]
    url = events_url(http, run_id)
    seen: list[int] = []
    for _ in range(4):  # cut three times, each after a few more live episodes
        headers = {"Last-Event-ID": str(seen[-1])} if seen else None
        part = await read_stream(http.session, url, headers, until=lambda s: len(s.numbers) >= 15)
        seen += part.numbers
    rest = await read_stream(
        http.session, url, {"Last-Event-ID": str(seen[-1])}, timeout=JOB_TIMEOUT
    )
    seen += rest.numbers
    assert seen == list(range(1, 151))
    assert rest.finished is not None and rest.finished["state"] == "STATE_DONE"


async def test_restarting_the_http_side_cuts_streams_and_they_resume(http: Http) -> None:
    run_id = (await http.create(max_episodes=200, episodes_per_second=50))["id"]
    url = events_url(http, run_id)
    stream = Stream()
    reader = asyncio.create_task(read_stream(http.session, url, stream=stream))
    await until(lambda: len(stream.numbers) >= 20, "20 episodes")
    face = http.grpc.gateway.http
    assert face is not None and face.open_streams == 1
    host, port = face.host, face.port
    await face.stop()
    cut = await reader
    assert cut.ended and cut.finished is None and face.open_streams == 0
    await face.start(host, port)
    rest = await read_stream(
        http.session, url, {"Last-Event-ID": str(cut.numbers[-1])}, timeout=JOB_TIMEOUT
    )
    assert cut.numbers + rest.numbers == list(range(1, 201))
    assert rest.finished is not None


async def test_a_client_that_goes_away_frees_its_stream_at_once(http: Http) -> None:
    run_id = (await http.create(max_episodes=3000, episodes_per_second=10))["id"]
    await http.wait_state(run_id, "STATE_RUNNING")
    await http.ok("POST", f"/v1/runs/{run_id}:pause")  # nothing to write: only keepalives
    face = http.grpc.gateway.http
    assert face is not None
    await read_stream(
        http.session, events_url(http, run_id), until=lambda s: "caught_up" in s.kinds
    )
    await until(lambda: face.open_streams == 0, "the stream freed")
    await http.ok("POST", f"/v1/runs/{run_id}:stop")


async def test_a_gateway_that_stops_ends_its_streams(fake: FakeTrainer) -> None:
    async with http_gateway(fake) as http:
        run_id = (await http.create(max_episodes=3000, episodes_per_second=10))["id"]
        stream = Stream()
        reader = asyncio.create_task(
            read_stream(http.session, events_url(http, run_id), stream=stream)
        )
        await until(lambda: "caught_up" in stream.kinds, "caught_up")
        await http.grpc.gateway.stop()
        cut = await asyncio.wait_for(reader, TIMEOUT)
        assert cut.ended and cut.finished is None


async def test_a_replay_goes_out_in_few_writes(
    fake: FakeTrainer, http: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.default = Script(detail_every=50)
    run_id = await finished_run(http, 2000)
    writes = 0
    write = web.StreamResponse.write

    async def counting(self: web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting)
    stream = await read_stream(http.session, events_url(http, run_id))
    assert stream.numbers == list(range(1, 2001))
    # The first page's head (the first message, read alone), 2000 episodes in batches of
    # <= 256 (history pages of 256), caught_up and finished.
    assert writes <= 1 + 2000 // 256 + 4, writes


async def test_the_scalar_view_is_every_episode_without_its_detail(http: Http) -> None:
    run_id = await finished_run(http, 120)  # a motion every 10th episode
    full = await read_stream(http.session, events_url(http, run_id, "?view=full"))
    assert full.episodes == (await read_stream(http.session, events_url(http, run_id))).episodes
    assert sum(e.HasField("imitation") for e in full.episodes) == 12
    scalars = await read_stream(http.session, events_url(http, run_id, "?view=scalars&after=5"))
    assert scalars.numbers == list(range(6, 121))
    assert scalars.kinds[-2:] == ["caught_up", "finished"]
    expected = full.episodes[5:]
    for episode in expected:
        episode.ClearField("detail")
    assert scalars.episodes == expected


async def test_the_scalar_view_of_a_live_run(http: Http) -> None:
    run_id = (await http.create(max_episodes=40, episodes_per_second=80))["id"]
    stream = await read_stream(
        http.session, events_url(http, run_id, "?view=scalars"), timeout=JOB_TIMEOUT
    )
    assert stream.numbers == list(range(1, 41)) and stream.finished is not None
    assert not any(e.WhichOneof("detail") for e in stream.episodes)


async def test_a_replay_frames_the_json_written_at_publication_and_encodes_nothing(
    http: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each episode's JSON is written once, when it is published (and stored): replays of a
    finished run, from the store, only frame it."""
    run_id = await finished_run(http, 600)
    # DONE is visible a moment before the gateway lets the run's driver go; until then a
    # watcher replays the run's live log (which writes each episode's JSON once, on demand).
    core = http.grpc.gateway.core
    assert core is not None
    await until(lambda: core.table.get(run_id) is None, f"run {run_id} let go")
    encoded = 0
    parts = base.json_parts

    def counting(episode: Any) -> tuple[bytes, bytes | None]:
        nonlocal encoded
        encoded += 1
        return parts(episode)

    for module in (base, framing, live_log):
        monkeypatch.setattr(module, "json_parts", counting)
    url = events_url(http, run_id)
    first = await read_stream(http.session, url)
    second = await read_stream(http.session, url)
    scalars = await read_stream(http.session, events_url(http, run_id, "?view=scalars"))
    assert encoded == 0
    assert first.numbers == second.numbers == scalars.numbers == list(range(1, 601))
    assert second.events == first.events
