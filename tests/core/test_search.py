"""Searches at the core's seam: a filter reads what the store has committed, and each run it
finds is returned as the gateway has it now (under virtual time, with the store's writes held
back on purpose)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.errors import InvalidRequest
from gateway.core.runs import RunState
from tests.fakes.core_harness import running_core
from tests.fakes.virtual_time import VIRTUAL_TIME

pytestmark = VIRTUAL_TIME


async def test_a_filter_reads_committed_values_and_returns_runs_as_they_are_now() -> None:
    async with running_core() as core:
        run = await core.create(max_episodes=10_000, episodes_per_second=2.0)
        await core.wait_episode(run.id, 2)
        core.store.update_delay_s = 5.0  # the pause reaches the store 5 s after the run shows it
        pausing = asyncio.create_task(core.registry.pause(run.id))
        await asyncio.sleep(1.0)
        assert (await core.run(run.id)).state is RunState.PAUSED
        found, token = await core.registry.list_runs(0, "", None, "state = STATE_RUNNING")
        assert [(r.id, r.state) for r in found] == [(run.id, RunState.PAUSED)] and token == ""
        paused, _ = await core.registry.list_runs(0, "", None, "state = STATE_PAUSED")
        assert paused == []
        await pausing
        paused, _ = await core.registry.list_runs(0, "", None, "state = STATE_PAUSED")
        assert [r.id for r in paused] == [run.id]
        episode = (await core.run(run.id)).episode
        found, _ = await core.registry.list_runs(0, "", None, f"episode = {episode}")
        assert [r.episode for r in found] == [episode]  # committed with its episode


async def test_a_search_checks_its_page_size_filter_order_and_token_before_the_store() -> None:
    async with running_core() as core:
        for _ in range(3):
            await core.create(max_episodes=2)
        runs, token = await core.registry.list_runs(2, "", None, "seed = 7", "create_time")
        assert len(runs) == 2 and token
        rest, end = await core.registry.list_runs(2, token, None, "seed = 7", "create_time")
        assert len(rest) == 1 and end == ""
        assert [r.seq for r in runs + rest] == sorted(r.seq for r in runs + rest)
        for args, field in (
            ((1001, "", None), "page_size"),
            ((0, "", None, "seed ="), "filter"),
            ((0, "", None, "", "seed sideways"), "order_by"),
            ((2, token, None, "seed = 7", "create_time desc"), "page_token"),
            ((2, token, RunState.DONE, "seed = 7", "create_time"), "page_token"),
        ):
            with pytest.raises(InvalidRequest) as info:
                await core.registry.list_runs(*args)  # type: ignore[arg-type]
            assert [v.field for v in info.value.violations] == [field]
