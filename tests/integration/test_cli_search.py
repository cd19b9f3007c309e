"""``trainwire runs list --filter ... --order-by ...`` through the CLI's entry point against the
real gateway (in-memory store, the fake trainer behind it)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.fakes.live import live_stack
from tests.fakes.waiting import TIMEOUT
from tests.integration.test_cli_commands import Gateway
from trainwire import client as tc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with live_stack() as stack, tc.GatewayClient(stack.target, timeout=TIMEOUT) as client:
        yield Gateway(stack, client)


def test_runs_list_filters_and_orders(gateway: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    for name, clip in (("walk-1", "walk"), ("wave-1", "wave"), ("walk-2", "walk")):
        run = gateway.client.create_run(
            tc.imitation_task(clip=clip), tc.train_config(3), display_name=name
        )
        gateway.finished(run.id)
    capsys.readouterr()
    search = ("--filter", 'clip = "walk" AND state = STATE_DONE', "--order-by", "display_name")
    assert gateway.cli("runs", "list", *search, "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["displayName"] for r in listed["runs"]] == ["walk-1", "walk-2"]
    assert gateway.cli("runs", "list", "--filter", 'display_name = "*-1"', "--order-by",
                       "display_name desc") == 0  # fmt: skip
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("ID") and len(table) == 3
    assert "wave-1" in table[1] and "walk-1" in table[2]
    assert gateway.cli("runs", "list", "--filter", "seed = 999") == 0
    assert "no runs found by the filter" in capsys.readouterr().err


def test_a_malformed_filter_is_one_line_naming_the_position(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gateway.cli("runs", "list", "--filter", "state = STATE_DONE AND AND x") != 0
    err = capsys.readouterr().err
    assert 'filter: unexpected "AND" at position 24, expected a field' in err
    assert gateway.cli("runs", "list", "--order-by", "colour") != 0
    assert 'order_by: unknown field "colour" at position 1' in capsys.readouterr().err
