"""``RunQuery`` as SQL: the filter tree, the order and the keyset of a page, written for SQLite
and PostgreSQL (``SQLITE``, ``POSTGRES``). Every value is a parameter, never SQL text.

The two databases answer alike: text compares by code point (PostgreSQL reads it ``COLLATE
"C"``, SQLite's default is binary), wildcards match case-sensitively (``substr``/``instr``
rather than ``LIKE``, which SQLite folds), and a comparison on a label a run does not have is
false (``!=``, written as a negated ``=``, is then true), never SQL's unknown.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.filters import (
    And,
    Compare,
    Expr,
    Field,
    FieldType,
    Has,
    Match,
    MatchKind,
    Not,
    Or,
)
from gateway.core.runs import TrainingRun
from gateway.core.search import RunPage, RunQuery


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one database writes what a search needs (``{}`` is where an operand goes, ``?``
    where a parameter does, replaced by ``mark``)."""

    mark: str
    true: str
    false: str
    #: A label's value (text, or NULL when absent); the parameter is ``label_arg(key)``.
    label: str
    label_arg: Callable[[str], str]
    #: Whether a run has a label; the parameter is ``label_arg(key)``.
    has_label: str
    #: A label equal to a value, the parameter ``label_pair(key, value)``; None: compare
    #: ``label`` with ``=``.
    label_equals: str | None
    label_pair: Callable[[str, str], str]
    #: Text ordered by code point.
    ordered: str
    #: ``{}`` starts with / ends with / contains the parameter (``?L``: its length, first).
    prefix: str
    suffix: str
    contains: str


SQLITE = Dialect(
    mark="?",
    true="1",
    false="0",
    label="json_extract(labels, ?)",
    label_arg=lambda key: f'$."{key}"',
    has_label="json_extract(labels, ?) IS NOT NULL",
    label_equals=None,
    label_pair=lambda key, value: "",
    ordered="{}",
    prefix="substr({}, 1, ?L) = ?",
    suffix="substr({}, -?L) = ?",
    contains="instr({}, ?) > 0",
)
POSTGRES = Dialect(
    mark="%s",
    true="TRUE",
    false="FALSE",
    label="(labels::jsonb ->> ?::text)",
    label_arg=lambda key: key,
    # jsonb's ? and @> are what a GIN index on labels::jsonb serves.
    has_label="labels::jsonb ?? ?::text",
    label_equals="labels::jsonb @> ?::jsonb",
    label_pair=lambda key, value: json.dumps({key: value}),
    ordered='{} COLLATE "C"',
    prefix="starts_with({}, ?)",
    suffix="right({}, ?L) = ?",
    contains="strpos({}, ?) > 0",
)


class _Writer:
    """Accumulates SQL text and its parameters for one dialect."""

    def __init__(self, dialect: Dialect) -> None:
        self.d = dialect
        self.params: list[Any] = []

    def sql(self, template: str, *params: Any) -> str:
        """``template`` with each ``?`` as the dialect's mark (``??`` is a literal ``?``),
        taking ``params`` in order."""
        self.params.extend(params)
        return template.replace("??", "\0").replace("?", self.d.mark).replace("\0", "?")

    def expr(self, node: Expr) -> str:
        if isinstance(node, And):
            return "(" + " AND ".join(self.expr(i) for i in node.items) + ")"
        if isinstance(node, Or):
            return "(" + " OR ".join(self.expr(i) for i in node.items) + ")"
        if isinstance(node, Not):
            return f"NOT {self.expr(node.item)}"
        if isinstance(node, Has):
            return self.has(node)
        if isinstance(node, Match):
            return self.match(node)
        return self.compare(node)

    def operand(self, field: Field, key: str) -> str:
        if key:
            return self.sql(self.d.label, self.d.label_arg(key))
        return field.column

    def guarded(self, field: Field, key: str, test: str) -> str:
        """A test that is false, not unknown, for a label the run does not have."""
        return f"coalesce({test}, {self.d.false})" if key else f"({test})"

    def compare(self, node: Compare) -> str:
        field, key, op = node.field, node.key, node.op
        if key and op == "!=":
            return f"NOT {self.compare(Compare(field, '=', node.value, key))}"
        if key and op == "=" and self.d.label_equals is not None:
            return self.sql(self.d.label_equals, self.d.label_pair(key, str(node.value)))
        operand = self.operand(field, key)
        text = field.type in (FieldType.TEXT, FieldType.KIND, FieldType.LABEL)
        if text and op not in ("=", "!="):
            operand = self.d.ordered.format(operand)
        test = operand + self.sql(f" {op} ?", node.value)
        if field.type is FieldType.TIME:
            test = f"{field.column} != 0 AND {test}"  # unset times match no comparison
        return self.guarded(field, key, test)

    def match(self, node: Match) -> str:
        if not node.text:  # "*": any value (for a label: the run has it)
            return self.has(Has(node.field, node.key)) if node.key else self.d.true
        template = {
            MatchKind.PREFIX: self.d.prefix,
            MatchKind.SUFFIX: self.d.suffix,
            MatchKind.CONTAINS: self.d.contains,
        }[node.where]
        operand = self.operand(node.field, node.key)
        length = [len(node.text)] if "?L" in template else []
        test = self.sql(template.replace("?L", "?").format(operand), *length, node.text)
        return self.guarded(node.field, node.key, test)

    def has(self, node: Has) -> str:
        if node.field.type is FieldType.LABEL:
            if node.key:
                return "(" + self.sql(self.d.has_label, self.d.label_arg(node.key)) + ")"
            return "(labels != '{}')"
        if node.field.type is FieldType.TIME:
            return f"({node.field.column} != 0)"
        return f"({node.field.column} != '')"

    def keyset(self, query: RunQuery) -> str:
        """Rows after ``query.after`` in the order of ``query.keys``."""
        assert query.after is not None
        keys = query.keys
        columns = [self.key_column(k.field) for k in keys]
        if len({k.descending for k in keys}) == 1:
            op = "<" if keys[0].descending else ">"
            marks = ", ".join(self.d.mark for _ in keys)
            self.params.extend(query.after)
            return f"({', '.join(columns)}) {op} ({marks})"
        branches = []
        for i, key in enumerate(keys):
            tests = [self.sql(f"{columns[j]} = ?", query.after[j]) for j in range(i)]
            op = "<" if key.descending else ">"
            tests.append(self.sql(f"{columns[i]} {op} ?", query.after[i]))
            branches.append("(" + " AND ".join(tests) + ")")
        return "(" + " OR ".join(branches) + ")"

    def key_column(self, field: Field) -> str:
        if field.type in (FieldType.TEXT, FieldType.KIND):
            return self.d.ordered.format(field.column)
        return field.column


def select_runs(query: RunQuery, columns: str, dialect: Dialect) -> tuple[str, list[Any]]:
    """The SELECT of a query's page: ``columns``, then the sort values of each row; one row
    more than ``query.limit`` (whether more follow)."""
    w = _Writer(dialect)
    where: list[str] = []
    if query.state is not None:
        where.append(w.sql("state = ?", int(query.state)))
    if query.filter is not None:
        where.append(w.expr(query.filter))
    if query.after is not None:
        where.append(w.keyset(query))
    keys = query.keys
    order = ", ".join(f"{w.key_column(k.field)} {'DESC' if k.descending else 'ASC'}" for k in keys)
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    sql = (
        f"SELECT {columns}, {', '.join(k.field.column for k in keys)} FROM runs{clause} "
        f"ORDER BY {order} LIMIT {w.sql('?', query.limit + 1)}"
    )
    return sql, w.params


def page_of(
    rows: Sequence[Sequence[Any]],
    query: RunQuery,
    width: int,
    run_from_row: Callable[[Sequence[Any]], TrainingRun],
) -> RunPage:
    """The page of ``select_runs``' rows (each ``width`` run columns, then its sort values)."""
    shown = rows[: query.limit]
    more = len(rows) > query.limit
    after = tuple(shown[-1][width:]) if more and shown else None
    return RunPage([run_from_row(r[:width]) for r in shown], after)
