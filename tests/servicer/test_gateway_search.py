"""ListRuns with a filter and an order through gRPC: a real gateway (SQLite file store) over the
scripted fake trainer, its runs labelled at creation and trained to the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import Client, running_gateway
from tests.fakes.waiting import TIMEOUT
from tests.servicer.test_gateway_admission import bad_fields
from trainwire import aio
from trainwire.errors import InvalidArgument
from trainwire.v1 import gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State

#: (display name, labels, max_episodes) of the runs each test creates, oldest first.
RUNS = [
    ("sweep-a1", {"team": "a", "lr": "high"}, 3),
    ("sweep-a2", {"team": "a"}, 5),
    ("sweep-b1", {"team": "b"}, 4),
    ("other", {}, 2),
    ("sweep-a3", {"team": "a", "lr": "low"}, 6),
]


@pytest.fixture
async def client(fake: FakeTrainer, tmp_path: Path) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,), db=str(tmp_path / "gw.sqlite3")) as c:
        yield c


async def finished_runs(c: Client) -> dict[str, pb.Run]:
    """Creates ``RUNS`` and waits for each to finish; the finished runs by display name."""
    ids = {}
    for name, labels, episodes in RUNS:
        run = await c.create(max_episodes=episodes, display_name=name, labels=labels)
        ids[name] = run.id
    return {name: await c.finished(run_id) for name, run_id in ids.items()}


async def pages(c: Client, request: pb.ListRunsRequest) -> list[list[str]]:
    """The display names of every page of a listing, following its tokens."""
    out: list[list[str]] = []
    while True:
        page = await c.stub.ListRuns(request, timeout=TIMEOUT)
        out.append([r.display_name for r in page.runs])
        if not page.next_page_token:
            return out
        following = pb.ListRunsRequest()
        following.CopyFrom(request)  # the same search, from the token on
        following.page_token = page.next_page_token
        request = following


async def refused(c: Client, request: pb.ListRunsRequest) -> tuple[str, list[str]]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ListRuns(request, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details() or "", bad_fields(info.value)


async def test_filter_and_order_page_through_grpc(client: Client) -> None:
    runs = await finished_runs(client)
    assert all(r.state == State.STATE_DONE for r in runs.values())
    search = pb.ListRunsRequest(
        filter='state = STATE_DONE AND labels.team = "a"', order_by="episode desc", page_size=2
    )
    assert await pages(client, search) == [["sweep-a3", "sweep-a2"], ["sweep-a1"]]
    by_name = pb.ListRunsRequest(
        filter='display_name = "sweep-*" AND NOT labels.team = "b"', order_by="display_name"
    )
    assert await pages(client, by_name) == [["sweep-a1", "sweep-a2", "sweep-a3"]]
    either = pb.ListRunsRequest(filter="labels:lr OR episode = 2", page_size=1)
    assert await pages(client, either) == [["sweep-a3"], ["other"], ["sweep-a1"]]
    best = pb.ListRunsRequest(order_by="best_reward desc, create_time", page_size=3)
    names = [n for page in await pages(client, best) for n in page]
    ordered = sorted(runs.values(), key=lambda r: (-r.best_reward, r.create_time.ToNanoseconds()))
    assert names == [r.display_name for r in ordered]
    none = await client.stub.ListRuns(pb.ListRunsRequest(filter="seed = 12345"), timeout=TIMEOUT)
    assert (list(none.runs), none.next_page_token) == ([], "")
    view = await client.stub.ListRuns(
        pb.ListRunsRequest(filter='labels.lr = "low"', view=pb.RUN_VIEW_FULL), timeout=TIMEOUT
    )
    assert [dict(r.labels) for r in view.runs] == [{"team": "a", "lr": "low"}]


async def test_bad_searches_are_invalid_argument_naming_the_field_and_position(
    client: Client,
) -> None:
    await client.create(max_episodes=2, display_name="x", labels={"team": "a"})
    details, fields = await refused(
        client, pb.ListRunsRequest(filter="state = STATE_DONE AND AND best_reward > 1")
    )
    assert details == 'filter: unexpected "AND" at position 24, expected a field'
    assert fields == ["filter"]
    details, fields = await refused(client, pb.ListRunsRequest(filter="team = a"))
    assert details.startswith('filter: unknown field "team" at position 1; known fields: ')
    assert "labels.KEY" in details and "best_reward" in details and fields == ["filter"]
    details, fields = await refused(client, pb.ListRunsRequest(order_by="reward sideways"))
    assert "position 8" in details and fields == ["order_by"]
    first = await client.stub.ListRuns(
        pb.ListRunsRequest(filter="labels.team:*", page_size=1), timeout=TIMEOUT
    )
    token = first.next_page_token
    assert token == ""  # one run: no next page
    await client.create(max_episodes=2, display_name="y", labels={"team": "a"})
    first = await client.stub.ListRuns(
        pb.ListRunsRequest(filter="labels.team:*", page_size=1), timeout=TIMEOUT
    )
    token = first.next_page_token
    assert token
    details, fields = await refused(
        client, pb.ListRunsRequest(filter="labels.team:*", order_by="episode", page_token=token)
    )
    assert "issued for another filter, order_by or state" in details
    assert fields == ["page_token"]
    details, fields = await refused(
        client, pb.ListRunsRequest(filter='labels.team = "a"', page_token=token)
    )
    assert fields == ["page_token"]
    again = await client.stub.ListRuns(
        pb.ListRunsRequest(filter="labels.team :*", page_size=1, page_token=token),
        timeout=TIMEOUT,
    )
    assert [r.display_name for r in again.runs] == ["x"]


async def test_the_client_passes_filter_and_order_by(client: Client) -> None:
    await finished_runs(client)
    async with aio.GatewayClient(client.address, timeout=TIMEOUT) as gw:
        runs = await gw.list_runs(filter='labels.team = "a"', order_by="episode", page_size=1)
        assert [r.display_name for r in runs] == ["sweep-a1", "sweep-a2", "sweep-a3"]
        with pytest.raises(InvalidArgument, match="position 1"):
            await gw.list_runs(filter="nope = 1")
