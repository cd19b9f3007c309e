"""The search language of ListRuns: the AIP-160 filter parser, order_by, and page tokens."""

from __future__ import annotations

import base64
import json

import pytest

from gateway.core.errors import InvalidRequest
from gateway.core.filters import (
    FIELDS,
    LABELS,
    And,
    Compare,
    Has,
    Match,
    MatchKind,
    Not,
    Or,
    parse_filter,
    parse_order_by,
)
from gateway.core.runs import RunState
from gateway.core.search import RunQuery, run_query


def refused(text: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse_filter(text)
    (violation,) = info.value.violations
    assert violation.field == "filter"
    assert str(info.value) == f"filter: {violation.description}"
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("", "None"),
        ("   ", "None"),
        ("state = STATE_DONE", "state = STATE_DONE"),
        ("state=done", "state = STATE_DONE"),
        ('state != "STATE_ERROR"', "state != STATE_ERROR"),
        ("best_reward > 0.5", "best_reward > 0.5"),
        ("reward >= -1", "reward >= -1"),
        ("reward<.5", "reward < 0.5"),
        ("learning_rate = 1e-4", "learning_rate = 0.0001"),
        ("episode <= 100", "episode <= 100"),
        ("seed = 7", "seed = 7"),
        ("kind = grpo", 'kind = "grpo"'),
        ('kind : "Imitation"', 'kind = "imitation"'),
        ('model = "Qwen/Qwen2.5-0.5B"', 'model = "Qwen/Qwen2.5-0.5B"'),
        ("clip = walk", 'clip = "walk"'),
        ("creator = 'alice'", 'creator = "alice"'),
        ('display_name = "say \\"hi\\""', 'display_name = "say \\"hi\\""'),
        ('create_time > "2025-01-31T12:00:00Z"', "create_time > 1738324800000000000"),
        ('end_time < "2025-01-31T13:00:00.5+01:00"', "end_time < 1738324800500000000"),
        ('start_time >= "2025-01-31"', "start_time >= 1738281600000000000"),
        ("end_time:*", "end_time:*"),
        ('labels.team = "vision"', 'labels.team = "vision"'),
        ("labels.team = 5", 'labels.team = "5"'),
        ("labels.example.com/team:*", "labels.example.com/team:*"),
        ("labels:team", "labels.team:*"),
        ("labels:*", "labels:*"),
        ('labels.team != "a"', 'labels.team != "a"'),
        ('display_name = "sweep-*"', 'display_name = "sweep-*"'),
        ('display_name = "*-3"', 'display_name = "*-3"'),
        ('display_name = "*lr*"', 'display_name = "*lr*"'),
        ("display_name = sweep*", 'display_name = "sweep*"'),
        ('display_name = "a\\*"', 'display_name = "a\\*"'),
        ('labels.team != "v*"', 'NOT labels.team = "v*"'),
    ],
)
def test_valid_filters_parse_to_their_canonical_form(text: str, canonical: str) -> None:
    assert str(parse_filter(text)) == canonical


def test_or_binds_tighter_than_and_as_aip_160_says() -> None:
    expr = parse_filter("state = DONE OR state = ERROR AND reward > 1")
    assert isinstance(expr, And)
    first, second = expr.items
    assert isinstance(first, Or) and len(first.items) == 2
    assert second == Compare(FIELDS["reward"], ">", 1)
    assert str(expr) == "(state = STATE_DONE OR state = STATE_ERROR) AND reward > 1"


def test_juxtaposition_is_and_parentheses_group_and_not_and_minus_negate() -> None:
    expr = parse_filter("kind = grpo  (seed = 1 OR seed = 2) NOT labels.x:* -labels.y:*")
    assert str(expr) == (
        'kind = "grpo" AND (seed = 1 OR seed = 2) AND NOT labels.x:* AND NOT labels.y:*'
    )
    assert parse_filter("-(seed = 1)") == Not(Compare(FIELDS["seed"], "=", 1))
    assert parse_filter("NOT (NOT seed = 1)") == Not(Not(Compare(FIELDS["seed"], "=", 1)))
    assert refused("NOT NOT seed = 1") == (  # AIP-160: one NOT per term
        'filter: unexpected "NOT" at position 5, expected a field'
    )


def test_values_are_typed_for_their_field() -> None:
    assert parse_filter("state = STATE_RUNNING") == Compare(
        FIELDS["state"], "=", int(RunState.RUNNING)
    )
    assert parse_filter("episode > 10") == Compare(FIELDS["episode"], ">", 10)
    assert parse_filter("reward > 1e400") == Compare(FIELDS["reward"], ">", float("inf"))
    assert parse_filter("reward > 99999999999999999999") == Compare(FIELDS["reward"], ">", 1e20)
    match = parse_filter('model = "*gpt*"')
    assert match == Match(FIELDS["model"], MatchKind.CONTAINS, "gpt")
    assert parse_filter('labels.team = "*"') == Match(LABELS, MatchKind.PREFIX, "", "team")
    assert isinstance(parse_filter("display_name:*"), Has)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "state = STATE_DONE AND AND x",
            'filter: unexpected "AND" at position 24, expected a field',
        ),
        (
            "best_reward > 0.5 AND",
            "filter: unexpected end of input at position 22, expected a field",
        ),
        ("(seed = 1", 'filter: unexpected end of input at position 10, expected ")"'),
        ("seed = 1)", 'filter: unexpected ")" at position 9'),
        ("seed = 1, seed = 2", 'filter: unexpected "," at position 9'),
        ("seed =", "filter: unexpected end of input at position 7, expected a value"),
        ("seed = AND", 'filter: unexpected "AND" at position 8, expected a value'),
        (
            "reward",
            'filter: expected a comparator (= != < <= > >= :) after "reward" at position 7, '
            "found end of input",
        ),
        ('display_name = "open', "filter: unterminated string starting at position 16"),
        ("seed ! 1", 'filter: unexpected "!" at position 6'),
        ("= 1", 'filter: unexpected "=" at position 1, expected a field'),
        ("state < STATE_DONE", 'filter: state takes = and != only, not "<" at position 7'),
        (
            "state = FINISHED",
            "filter: state needs one of STATE_PENDING, STATE_RUNNING, STATE_PAUSED, STATE_DONE, "
            'STATE_STOPPED, STATE_ERROR, not "FINISHED" at position 9',
        ),
        ("kind = ppo", 'filter: kind needs one of imitation, grpo, not "ppo" at position 8'),
        ('reward > "0.5"', 'filter: reward needs a number, not "0.5" at position 10'),
        (
            "seed = 99999999999999999999",
            'filter: seed needs a 64-bit integer, not "99999999999999999999" at position 8',
        ),
        (
            'create_time > "yesterday"',
            'filter: create_time needs an RFC 3339 time in quotes, e.g. "2025-01-31T12:00:00Z", '
            'not "yesterday" at position 15',
        ),
        (
            'end_time < "2025-02-30T00:00:00Z"',
            'filter: end_time needs an RFC 3339 time in quotes, e.g. "2025-01-31T12:00:00Z", '
            'not "2025-02-30T00:00:00Z" at position 12',
        ),
        (
            "reward:*",
            'filter: "reward:*" at position 1: ":*" works on labels, times and text fields',
        ),
        (
            'labels = "x"',
            'filter: "labels" at position 1 needs a key: labels.KEY = ..., or labels:KEY for '
            "runs that have it",
        ),
        (
            "labels.-x:*",
            'filter: "labels.-x" at position 1 is not a label key (A-Z a-z 0-9 and . _ / -, '
            "starting with a letter or digit)",
        ),
    ],
)
def test_malformed_filters_name_the_position(text: str, message: str) -> None:
    assert refused(text) == message


def test_an_unknown_field_is_named_with_the_known_ones() -> None:
    message = refused('state = STATE_DONE AND team = "a"')
    assert message.startswith('filter: unknown field "team" at position 24; known fields: ')
    known = message.split("known fields: ")[1].split(", ")
    assert known == [*sorted(FIELDS), "labels.KEY"]
    for name in ("state", "reward", "best_reward", "episode", "create_time", "start_time",
                 "end_time", "display_name", "creator", "kind", "clip", "model",
                 "learning_rate", "seed"):  # fmt: skip
        assert name in known


def test_long_and_deep_filters_are_refused() -> None:
    assert "at most 4096" in refused("seed = 1 AND " * 400 + "seed = 1")
    assert "nested more than 32 deep" in refused("(" * 40 + "seed = 1" + ")" * 40)
    assert "nested more than 32 deep" in refused("NOT (" * 20 + "seed = 1" + ")" * 20)
    assert parse_filter("(" * 30 + "seed = 1" + ")" * 30) is not None


def test_order_by_takes_fields_and_directions() -> None:
    keys = parse_order_by("best_reward desc, create_time")
    assert [(k.field.name, k.descending) for k in keys] == [
        ("best_reward", True),
        ("create_time", False),
    ]
    assert parse_order_by("") == ()
    assert [str(k) for k in parse_order_by("  seed ASC,display_name DESC ")] == [
        "seed",
        "display_name desc",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("best_reward desc,", "order_by: unexpected end of input at position 18, expected a field"),
        (
            "best_reward up",
            'order_by: unexpected "up" at position 13, expected "asc", "desc", "," or the end',
        ),
        ("reward, reward desc", 'order_by: "reward" at position 9 is named twice'),
        (", reward", 'order_by: unexpected "," at position 1, expected a field'),
    ],
)
def test_malformed_order_by_names_the_position(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_order_by(text)
    assert str(info.value) == message
    assert [v.field for v in info.value.violations] == ["order_by"]


def test_order_by_takes_scalar_fields_only() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_order_by("labels.team")
    assert str(info.value).startswith('order_by: unknown field "labels.team" at position 1')
    assert "labels.KEY" not in str(info.value)


# -- page tokens --------------------------------------------------------------------------------


def test_every_order_ends_with_seq_in_the_direction_of_its_last_key() -> None:
    assert [(str(k), k.descending) for k in RunQuery().keys] == [("seq desc", True)]
    query = run_query("", "best_reward desc", None, "", 10)
    assert [str(k) for k in query.keys] == ["best_reward desc", "seq desc"]
    query = run_query("", "state desc, create_time", None, "", 10)
    assert [str(k) for k in query.keys] == ["state desc", "create_time", "seq"]


def test_a_token_carries_the_keyset_and_is_refused_for_another_search() -> None:
    query = run_query('labels.team = "a"', "best_reward desc", RunState.DONE, "", 10)
    token = query.page_token((0.75, 12))
    again = run_query('labels.team="a"', "best_reward   desc", RunState.DONE, token, 20)
    assert again.after == (0.75, 12) and again.limit == 20  # spacing does not count
    for other in (
        run_query('labels.team = "b"', "best_reward desc", RunState.DONE, "", 10),
        run_query('labels.team = "a"', "best_reward", RunState.DONE, "", 10),
        run_query('labels.team = "a"', "best_reward desc", None, "", 10),
        run_query("", "", None, "", 10),
    ):
        with pytest.raises(InvalidRequest) as info:
            other.from_page_token(token)
        assert str(info.value).startswith("page_token: issued for another filter, order_by")
        assert [v.field for v in info.value.violations] == ["page_token"]


def test_the_default_search_keeps_the_seq_tokens_of_earlier_gateways() -> None:
    old = base64.urlsafe_b64encode(b"runs/v1/42").decode()
    assert RunQuery().page_token((42,)) == old
    assert RunQuery().from_page_token(old).after == (42,)
    assert RunQuery(RunState.DONE).from_page_token(old).after == (42,)
    with pytest.raises(InvalidRequest, match="issued for another filter"):
        run_query("seed = 1", "", None, old, 10)
    assert RunQuery().page_token(None) == ""


@pytest.mark.parametrize(
    "raw",
    [
        b"garbage",
        b"runs/v1/0",
        b"runs/v1/-4",
        b"runs/v1/" + str(2**63).encode(),
        b"runs/v2/not json",
        b"runs/v2/{}",
    ],
)
def test_forged_tokens_are_refused(raw: bytes) -> None:
    token = base64.urlsafe_b64encode(raw).decode()
    with pytest.raises(InvalidRequest, match="page_token: not a token from a previous ListRuns"):
        RunQuery().from_page_token(token)


def test_a_token_whose_values_do_not_fit_its_keys_is_refused() -> None:
    query = run_query("", "display_name", None, "", 10)
    fingerprint = query.fingerprint
    for values in ([1, 2], ["a"], ["a", "b"], ["a", True], ["a", 2**63]):
        raw = b"runs/v2/" + json.dumps([fingerprint, *values]).encode()
        with pytest.raises(InvalidRequest, match="not a token from a previous ListRuns"):
            query.from_page_token(base64.urlsafe_b64encode(raw).decode())
    raw = b"runs/v2/" + json.dumps([fingerprint, "a", 3]).encode()
    assert query.from_page_token(base64.urlsafe_b64encode(raw).decode()).after == ("a", 3)
