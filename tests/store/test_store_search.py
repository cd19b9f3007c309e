"""Searches (``Store.list_runs`` with a filter, an order and keyset pages) against both
backends, checked against a plain-Python reading of the same expression tree; and the indexes
searches use, in new and migrated databases."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from gateway.core.filters import (
    And,
    Compare,
    Expr,
    FieldType,
    Has,
    Match,
    MatchKind,
    Not,
    Or,
    OrderKey,
)
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunQuery, run_query
from gateway.core.store import PostgresStore, SqliteStore, Store
from gateway.core.store.sqlite_schema import search_values
from tests.store.test_postgres_store import make_old
from tests.unit.test_store_schema import v1_database
from trainwire.v1 import episode_pb2

T0 = 1_738_324_800_000_000_000  # 2025-01-31T12:00:00Z
HOUR = 3600 * 10**9
NAMES = ["sweep-1", "Sweep-2", "sweep-10", "b", "B", "été", "ete", "", "a*b", "lr 3e-4"]
STATES = [RunState.DONE, RunState.STOPPED, RunState.ERROR, RunState.RUNNING, RunState.PENDING]


def corpus() -> list[TrainingRun]:
    """24 runs that differ in every field a search reads, with ties in most of them."""
    runs = []
    for i in range(24):
        if i % 3 == 2:
            task = episode_pb2.TrainTask(
                grpo=episode_pb2.GrpoTask(
                    model_path=["tiny-gpt2", "Qwen/Qwen2.5-0.5B"][i % 2],
                    learning_rate=[1e-5, 3e-5][i % 2],
                )
            )
        else:
            task = episode_pb2.TrainTask(
                imitation=episode_pb2.ImitationTask(
                    rig_name="stickman",
                    clip_name=["walk", "wave", "jump"][i % 3],
                    learning_rate=[1e-3, 3e-3][i % 2],
                )
            )
        state = STATES[i % 5]
        labels = {}
        if i % 2 == 0:
            labels["team"] = ["vision", "rl", "Vision"][i % 3]
        if i % 4 == 1:
            labels["example.com/sweep"] = str(i % 3)
        runs.append(
            TrainingRun(
                id=f"run-{i:02d}",
                task=task,
                config=episode_pb2.TrainConfig(max_episodes=100, seed=i % 4),
                state=state,
                episode=(i * 7) % 30,
                reward=[-1.5, 0.0, 0.25, 0.5, 0.75][i % 5],
                best_reward=[0.5, 0.9, -0.25, 0.9, 0.75, 1.0][i % 6],
                create_time=T0 + (i // 2) * HOUR,  # pairs share a time
                start_time=0 if state is RunState.PENDING else T0 + i * HOUR,
                end_time=T0 + (i + 1) * HOUR if state.finished else 0,
                display_name=NAMES[i % len(NAMES)],
                creator=["alice", "bob", ""][i % 3],
                labels=labels,
            )
        )
    return runs


# -- the oracle: the same tree read in Python -----------------------------------------------


def field_value(run: TrainingRun, name: str) -> Any:
    kind, clip, model, rate, seed = search_values(run.task, run.config)
    searched = {"kind": kind, "clip": clip, "model": model, "learning_rate": rate, "seed": seed}
    if name in searched:
        return searched[name]
    if name == "state":
        return int(run.state)
    return getattr(run, name)


def holds(expr: Expr, run: TrainingRun) -> bool:
    if isinstance(expr, And):
        return all(holds(i, run) for i in expr.items)
    if isinstance(expr, Or):
        return any(holds(i, run) for i in expr.items)
    if isinstance(expr, Not):
        return not holds(expr.item, run)
    value = run.labels.get(expr.key) if expr.key else None
    if not expr.key and expr.field.type is not FieldType.LABEL:
        value = field_value(run, expr.field.name)
    if isinstance(expr, Has):
        if expr.field.type is FieldType.LABEL:
            return value is not None if expr.key else bool(run.labels)
        return value not in (0, "")
    if value is None:  # a label the run does not have
        return isinstance(expr, Compare) and expr.op == "!="
    if isinstance(expr, Match):
        return {
            MatchKind.PREFIX: value.startswith,
            MatchKind.SUFFIX: value.endswith,
            MatchKind.CONTAINS: value.__contains__,
        }[expr.where](expr.text)
    if expr.field.type is FieldType.TIME and value == 0:
        return False
    ops: dict[str, Callable[[Any, Any], bool]] = {
        "=": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b,
    }
    return ops[expr.op](value, expr.value)


def expected(runs: list[TrainingRun], query: RunQuery) -> list[str]:
    found = [
        r
        for r in runs
        if (query.state is None or r.state is query.state)
        and (query.filter is None or holds(query.filter, r))
    ]
    for key in reversed(query.keys):  # stable sorts, last key first
        found.sort(key=lambda r, k=key: sort_value(r, k), reverse=key.descending)
    return [r.id for r in found]


def sort_value(run: TrainingRun, key: OrderKey) -> Any:
    return field_value(run, key.field.name)


async def stored(store: Store) -> list[TrainingRun]:
    runs = corpus()
    for run in runs:
        run.seq = await store.insert_run(run)
    return runs


async def walk(store: Store, query: RunQuery) -> list[str]:
    """Every page of a search, through its page tokens."""
    ids: list[str] = []
    token = ""
    for _ in range(100):
        page = await store.list_runs(query.from_page_token(token))
        ids.extend(r.id for r in page.runs)
        token = query.page_token(page.after)
        if not token:
            return ids
    raise AssertionError("pages never end")


FILTERS = [
    "",
    "state = STATE_DONE",
    "state != STATE_DONE",
    "best_reward > 0.5",
    "best_reward >= 0.9 AND reward < 0.5",
    "reward <= 0",
    "episode > 10 AND episode <= 20",
    "seed = 2 OR seed = 3",
    "kind = grpo",
    "kind = imitation AND clip = walk",
    'model = "Qwen/Qwen2.5-0.5B"',
    "model = *gpt*",
    "learning_rate = 3e-3",
    "learning_rate < 1e-4",
    'creator = "alice"',
    "creator:*",
    "NOT creator:*",
    'display_name = "sweep-*"',
    'display_name = "*e"',
    'display_name = "*e*"',
    'display_name = "a\\*b"',
    'display_name != "sweep-*"',
    'display_name > "b"',
    'display_name < "a"',
    'display_name = "été"',
    'labels.team = "vision"',
    'labels.team != "vision"',
    'labels.team = "*ision"',
    'labels.team > "r"',
    "labels.team:*",
    "-labels.team:*",
    "labels:example.com/sweep",
    'labels.example.com/sweep = "1"',
    "labels:*",
    "NOT labels:*",
    'create_time > "2025-01-31T15:00:00Z"',
    'create_time >= "2025-01-31T15:00:00Z" AND create_time < "2025-01-31T17:00:00+00:00"',
    'start_time < "2025-01-31T14:00:00Z"',
    "start_time:*",
    'end_time != "2025-01-31T13:00:00Z"',
    "NOT end_time:*",
    "state = STATE_DONE OR state = STATE_ERROR AND best_reward > 0.5",
    'state = STATE_DONE AND best_reward >= 0.5 AND labels.team = "vision"',
    "(kind = grpo OR labels.team:*) AND NOT (seed = 0) best_reward > 0",
]
ORDERS = [
    "",
    "best_reward desc",
    "best_reward",
    "create_time",
    "create_time desc",
    "display_name",
    "display_name desc, reward",
    "state, best_reward desc",
    "kind desc, learning_rate, seed desc",
    "end_time desc",
    "model, clip desc, id",
]


async def test_filters_find_what_the_expression_says_on_both_stores(store: Store) -> None:
    runs = await stored(store)
    for text in FILTERS:
        query = run_query(text, "", None, "", 1000)
        page = await store.list_runs(query)
        assert [r.id for r in page.runs] == expected(runs, query), text
        assert page.after is None


async def test_the_oracle_agrees_with_what_people_expect(store: Store) -> None:
    runs = await stored(store)

    async def ids(text: str, order: str = "") -> list[str]:
        page = await store.list_runs(run_query(text, order, None, "", 1000))
        return [r.id for r in page.runs]

    # Values and semantics written out by hand, so the oracle cannot drift with the code.
    assert await ids('display_name = "B"', "id") == ["run-04", "run-14"]
    assert await ids('display_name = "sweep-*"', "id") == [
        "run-00",
        "run-02",
        "run-10",
        "run-12",
        "run-20",
        "run-22",
    ]
    assert await ids('labels.team = "vision"', "id") == ["run-00", "run-06", "run-12", "run-18"]
    without = await ids('labels.team != "vision"')
    assert "run-01" in without and "run-04" in without and "run-00" not in without
    assert await ids('display_name = "a\\*b"', "id") == ["run-08", "run-18"]
    assert await ids("kind = grpo AND seed = 3", "id") == ["run-11", "run-23"]
    assert await ids("NOT end_time:*", "id") == [r.id for r in runs if not r.state.finished]
    # Code point order on both databases: upper case before lower case, é after z.
    names = await names_in_order(store)
    assert names.index("B") < names.index("a*b") < names.index("b") < names.index("été")


async def names_in_order(store: Store) -> list[str]:
    page = await store.list_runs(run_query("", "display_name", None, "", 1000))
    return list(dict.fromkeys(r.display_name for r in page.runs))


async def test_orders_sort_like_python_with_seq_breaking_ties(store: Store) -> None:
    runs = await stored(store)
    for order in ORDERS:
        query = run_query("", order, None, "", 1000)
        page = await store.list_runs(query)
        assert [r.id for r in page.runs] == expected(runs, query), order
    newest = await store.list_runs(RunQuery(limit=1000))
    assert [r.id for r in newest.runs] == [r.id for r in reversed(runs)]


@pytest.mark.parametrize("page_size", [1, 4, 7])
async def test_pages_under_a_filter_and_an_order_cover_each_run_once(
    store: Store, page_size: int
) -> None:
    runs = await stored(store)
    for text, order in [
        ("", ""),
        ("best_reward > 0", "best_reward desc"),
        ("labels.team:* OR kind = grpo", "display_name, reward desc"),
        ("state != STATE_PENDING", "create_time"),
        ("NOT creator:*", "state desc, learning_rate"),
        ('display_name = "*e*"', "end_time desc"),
    ]:
        query = run_query(text, order, None, "", page_size)
        assert await walk(store, query) == expected(runs, query), (text, order)
    query = run_query("best_reward > 0", "best_reward desc", RunState.DONE, "", page_size)
    assert await walk(store, query) == expected(runs, query)


async def test_keyset_pages_do_not_shift_when_runs_are_created_between_them(
    store: Store,
) -> None:
    runs = await stored(store)
    query = run_query("best_reward >= 0.9", "best_reward desc", None, "", 3)
    first = await store.list_runs(query)
    extra = corpus()[0]
    extra.id, extra.best_reward = "late", 1.0  # sorts first (newest of the best): read already
    await store.insert_run(extra)
    rest = await walk(store, query.from_page_token(query.page_token(first.after)))
    assert [r.id for r in first.runs] + rest == expected(runs, query)


async def test_label_values_are_parameters_not_sql(store: Store) -> None:
    await stored(store)
    for text in (
        'labels.team = "x\') OR 1=1 --"',
        'display_name = "\'; DROP TABLE runs; --"',
        'labels.team = "*%_*"',
        'display_name = "_*"',
    ):
        page = await store.list_runs(run_query(text, "", None, "", 1000))
        assert page.runs == [], text
    assert len((await store.list_runs(RunQuery(limit=1000))).runs) == 24


# -- indexes ------------------------------------------------------------------------------------

SEARCH_INDEXES = {"runs_best_reward", "runs_create_time"}


def sqlite_indexes(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
        return {name for (name,) in rows}
    finally:
        conn.close()


def test_new_and_migrated_sqlite_databases_have_the_search_indexes(tmp_path: Path) -> None:
    SqliteStore(str(tmp_path / "new.sqlite3")).close()
    assert sqlite_indexes(tmp_path / "new.sqlite3") >= SEARCH_INDEXES
    old = tmp_path / "v1.sqlite3"
    v1_database(old)
    store = SqliteStore(str(old), migrate=True)
    try:
        found = store.list_runs(run_query('clip = "wave" AND kind = imitation', "", None, "", 9))
        assert [r.id for r in found.runs] == ["old"]
    finally:
        store.close()
    assert sqlite_indexes(old) >= SEARCH_INDEXES


async def postgres_indexes(url: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'runs'")
        return {name for (name,) in await cur.fetchall()}


async def test_new_and_migrated_postgres_databases_have_the_search_indexes(
    postgres_server: Any,
) -> None:
    new = postgres_server.create_database("search")
    store = PostgresStore(new, "a")
    await store.start()
    await store.close()
    assert SEARCH_INDEXES | {"runs_labels"} <= await postgres_indexes(new)
    old = postgres_server.create_database("search_old")
    await make_old(old, version=4)
    store = PostgresStore(old, "a", migrate=True)
    await store.start()
    try:
        found = await store.list_runs(run_query("clip = walk AND seed = 3", "", None, "", 9))
        assert [r.id for r in found.runs] == ["old"]
    finally:
        await store.close()
    assert SEARCH_INDEXES | {"runs_labels"} <= await postgres_indexes(old)
