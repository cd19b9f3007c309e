"""Fixtures of the HTTP side's tests: a real in-process gateway (fake trainer behind it) with
its HTTP side on port 0, and an aiohttp client session for it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import Client, running_gateway
from tests.fakes.waiting import TIMEOUT, until
from tests.http.harness import create_body


@dataclass
class Http:
    """A gateway under test, its gRPC client and an HTTP session to its HTTP side."""

    grpc: Client
    session: aiohttp.ClientSession
    url: str

    async def call(
        self, method: str, path: str, body: Any = None, **kwargs: Any
    ) -> tuple[int, dict[str, Any]]:
        """A JSON API call: (HTTP status, JSON body)."""
        headers = kwargs.pop("headers", None)
        if method == "POST" and headers is None:
            headers = {"Content-Type": "application/json"}
        data = (
            None if body is None else (body if isinstance(body, str | bytes) else json.dumps(body))
        )
        async with self.session.request(
            method, self.url + path, data=data, headers=headers, **kwargs
        ) as response:
            return response.status, await response.json(content_type=None)

    async def ok(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """A call that must succeed."""
        status, reply = await self.call(method, path, body)
        assert status == 200, reply
        return reply

    async def create(self, **kwargs: Any) -> dict[str, Any]:
        """Creates an imitation run (``create_body``); returns the Run."""
        return (await self.ok("POST", "/v1/runs", create_body(**kwargs)))["run"]

    async def wait_state(self, run_id: str, *states: str) -> dict[str, Any]:
        """Waits (``until``) until the run (read over the JSON API) is in one of ``states``;
        returns it."""

        async def reached() -> dict[str, Any] | None:
            run: dict[str, Any] = (await self.ok("GET", f"/v1/runs/{run_id}"))["run"]
            return run if run["state"] in states else None

        return await until(reached, f"run {run_id} {'/'.join(states)}")


@contextlib.asynccontextmanager
async def http_gateway(fake: FakeTrainer, **overrides: Any) -> AsyncIterator[Http]:
    """``running_gateway`` with its HTTP side on 127.0.0.1:0 and a session to it."""
    async with (
        running_gateway((fake.address,), http_port=0, **overrides) as client,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session,
    ):
        assert client.gateway.http is not None
        yield Http(client, session, client.gateway.http.url)


@pytest.fixture
async def http(fake: FakeTrainer) -> AsyncIterator[Http]:
    """A gateway with the HTTP side, over the fake trainer."""
    async with http_gateway(fake) as served:
        yield served
