"""The search language of ``ListRuns``: the fields a search reads, the AIP-160 ``filter``
(https://google.aip.dev/160) parsed into an expression tree, and the AIP-132 ``order_by``.

Grammar (AIP-160's, without its global text search and function calls)::

    filter      = [expression]
    expression  = sequence {"AND" sequence}
    sequence    = factor {factor}                 (juxtaposition: AND)
    factor      = term {"OR" term}                (OR binds tighter than AND, as in AIP-160)
    term        = ["NOT" | "-"] simple
    simple      = restriction | "(" expression ")"
    restriction = member comparator value         (comparator: = != < <= > >= :)
    member      = name {"." name}
    order_by    = name [asc | desc] {"," name [asc | desc]}

Values are numbers, words (``STATE_DONE``, ``grpo``) or strings in double or single quotes
(backslash escapes). A ``*`` at the start or end of a string compared with ``=``, ``!=`` or
``:`` is a wildcard (``display_name = "sweep-*"``; ``\\*`` is a star). Times are RFC 3339
strings (``"2025-01-31T12:00:00Z"``, or a date: its midnight UTC); a comparison on a time matches
only runs where that time is set, and ``end_time:*`` asks whether it is. ``labels.KEY`` compares
a label's value (``labels.KEY:*`` and ``labels:KEY`` ask whether the run has it); as in
Kubernetes selectors, ``labels.KEY != "v"`` also matches runs without the label. Positions in
errors count characters from 1.

The texts are read into tokens by ``gateway.core.filter_tokens``. Everything here is parsed and
typed: a bad filter is refused before any database sees it, and ``gateway.core.store.search_sql``
turns the tree into parameterised SQL.
"""

from __future__ import annotations

import calendar
import datetime
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.errors import InvalidRequest
from gateway.core.filter_tokens import Tok, Token, syntax_error, tokenize
from gateway.core.runs import RunState

#: How deep parentheses and NOTs may nest.
MAX_DEPTH = 32


class FieldType(enum.Enum):
    """What a field holds, which decides the values and comparators it takes."""

    STATE = "state"  #: a ``Run.State`` name
    KIND = "kind"  #: the task kind, ``imitation`` or ``grpo``
    NUMBER = "number"  #: a double
    INTEGER = "integer"  #: an int64
    TIME = "time"  #: Unix nanoseconds, 0 = unset; RFC 3339 in filters
    TEXT = "text"  #: a string
    LABEL = "label"  #: a label's value (a string, or none)


@dataclass(frozen=True, slots=True)
class Field:
    """A field a search reads: its name in filters and order_by, and the column of ``runs``."""

    name: str
    type: FieldType
    column: str


#: The scalar fields, by name. ``labels.KEY`` is not among them: its key is free.
FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field("id", FieldType.TEXT, "id"),
        Field("state", FieldType.STATE, "state"),
        Field("display_name", FieldType.TEXT, "display_name"),
        Field("creator", FieldType.TEXT, "creator"),
        Field("episode", FieldType.INTEGER, "episode"),
        Field("reward", FieldType.NUMBER, "reward"),
        Field("best_reward", FieldType.NUMBER, "best_reward"),
        Field("create_time", FieldType.TIME, "create_time"),
        Field("start_time", FieldType.TIME, "start_time"),
        Field("end_time", FieldType.TIME, "end_time"),
        Field("kind", FieldType.KIND, "kind"),
        Field("clip", FieldType.TEXT, "clip"),
        Field("model", FieldType.TEXT, "model"),
        Field("learning_rate", FieldType.NUMBER, "learning_rate"),
        Field("seed", FieldType.INTEGER, "seed"),
    )
}
#: ``labels.KEY`` (and ``labels`` itself, for ``labels:KEY``).
LABELS = Field("labels", FieldType.LABEL, "labels")
#: The fields as error messages list them.
KNOWN_FIELDS = ", ".join([*sorted(FIELDS), "labels.KEY"])
#: The task kinds (``TrainTask.kind``).
KINDS = ("imitation", "grpo")
_STATES = {s.name: s for s in RunState if s is not RunState.UNSPECIFIED}
_STATE_NAMES = ", ".join(f"STATE_{name}" for name in _STATES)

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})"
    r"(?:[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2}))?"
)
_NS_LIMIT = 1 << 63


# -- the expression tree ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compare:
    """``field op value``: ``op`` one of ``= != < <= > >=``; the value typed for the field
    (a state's number, nanoseconds for a time); ``key`` is the label's for ``labels.KEY``."""

    field: Field
    op: str
    value: int | float | str
    key: str = ""

    def __str__(self) -> str:
        if self.field.type is FieldType.STATE:
            shown = f"STATE_{RunState(int(self.value)).name}"
        else:
            shown = _literal(self.value)
        return f"{_member(self.field, self.key)} {self.op} {shown}"


class MatchKind(enum.Enum):
    """Where a wildcard pattern's text must be."""

    PREFIX = "prefix"
    SUFFIX = "suffix"
    CONTAINS = "contains"


@dataclass(frozen=True, slots=True)
class Match:
    """A text field or label whose value starts with, ends with or contains ``text``."""

    field: Field
    where: MatchKind
    text: str
    key: str = ""

    def __str__(self) -> str:
        star = "*"
        before = star if self.where is not MatchKind.PREFIX else ""
        after = star if self.where is not MatchKind.SUFFIX else ""
        return f"{_member(self.field, self.key)} = {_literal(self.text, before, after)}"


@dataclass(frozen=True, slots=True)
class Has:
    """``field:*``: a label is present (``key``), the run has any label (labels, no key), a
    text is not empty, a time is set."""

    field: Field
    key: str = ""

    def __str__(self) -> str:
        return f"{_member(self.field, self.key)}:*"


@dataclass(frozen=True, slots=True)
class Not:
    """``NOT item``."""

    item: Expr

    def __str__(self) -> str:
        return f"NOT {_grouped(self.item)}"


@dataclass(frozen=True, slots=True)
class And:
    """Every item holds."""

    items: tuple[Expr, ...]

    def __str__(self) -> str:
        return " AND ".join(_grouped(i) for i in self.items)


@dataclass(frozen=True, slots=True)
class Or:
    """Some item holds."""

    items: tuple[Expr, ...]

    def __str__(self) -> str:
        return " OR ".join(_grouped(i) for i in self.items)


Expr = Compare | Match | Has | Not | And | Or


def _member(field: Field, key: str) -> str:
    return f"labels.{key}" if key else field.name


def _literal(value: int | float | str, before: str = "", after: str = "") -> str:
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("*", "\\*")
        return f'"{before}{escaped}{after}"'
    return repr(value)


def _grouped(item: Expr) -> str:
    return f"({item})" if isinstance(item, And | Or) else str(item)


# -- the filter parser --------------------------------------------------------------------------


class _Parser:
    """A recursive-descent parser over one filter's tokens (see the module docstring)."""

    def __init__(self, text: str) -> None:
        self.tokens = tokenize(text)
        self.at = 0
        self.depth = 0

    @property
    def token(self) -> Token:
        return self.tokens[self.at]

    def take(self) -> Token:
        token = self.tokens[self.at]
        if token.kind is not Tok.END:
            self.at += 1
        return token

    def keyword(self, word: str) -> bool:
        token = self.token
        return token.kind is Tok.WORD and token.text == word

    def unexpected(self, token: Token, wanted: str = "") -> InvalidRequest:
        tail = f", expected {wanted}" if wanted else ""
        return syntax_error(
            "filter", f"unexpected {token.shown()} at position {token.position}{tail}"
        )

    def filter(self) -> Expr | None:
        if self.token.kind is Tok.END:
            return None
        expr = self.expression()
        if self.token.kind is not Tok.END:
            raise self.unexpected(self.token)
        return expr

    def expression(self) -> Expr:
        items = [self.sequence()]
        while self.keyword("AND"):
            self.take()
            items.append(self.sequence())
        return _joined(And, items)

    def sequence(self) -> Expr:
        items = [self.factor()]
        while self.token.kind in (Tok.WORD, Tok.STRING, Tok.LPAREN) and not (
            self.keyword("AND") or self.keyword("OR")
        ):
            items.append(self.factor())
        return _joined(And, items)

    def factor(self) -> Expr:
        items = [self.term()]
        while self.keyword("OR"):
            self.take()
            items.append(self.term())
        return _joined(Or, items)

    def term(self) -> Expr:
        token = self.token
        if self.keyword("NOT"):
            self.take()
            return Not(self.nested(self.simple))
        if token.kind is Tok.WORD and token.text.startswith("-"):
            # "-term" negates: the minus is split off the member ("-labels.x:*") or stands
            # alone before a parenthesis ("-(...)").
            if token.text == "-":
                self.take()
            else:
                rest = token.text[1:]
                self.tokens[self.at] = Token(Tok.WORD, rest, rest, token.position + 1)
            return Not(self.nested(self.simple))
        return self.simple()

    def nested(self, parse: Callable[[], Expr]) -> Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise syntax_error(
                "filter",
                f"nested more than {MAX_DEPTH} deep at position {self.token.position}",
            )
        try:
            return parse()
        finally:
            self.depth -= 1

    def simple(self) -> Expr:
        token = self.token
        if token.kind is Tok.LPAREN:
            self.take()
            expr = self.nested(self.expression)
            if self.token.kind is not Tok.RPAREN:
                raise self.unexpected(self.token, '")"')
            self.take()
            return expr
        if token.kind is not Tok.WORD or token.text in ("AND", "OR", "NOT"):
            raise self.unexpected(token, "a field")
        return self.restriction()

    def restriction(self) -> Expr:
        name = self.take()
        field, key = _resolve(name)
        op = self.token
        if op.kind is not Tok.OP:
            raise syntax_error(
                "filter",
                f"expected a comparator (= != < <= > >= :) after {name.shown()} at position "
                f"{op.position}, found {op.shown()}",
            )
        self.take()
        value = self.token
        if value.kind not in (Tok.WORD, Tok.STRING) or (
            value.kind is Tok.WORD and value.text in ("AND", "OR", "NOT")
        ):
            raise self.unexpected(value, "a value")
        self.take()
        return _restriction(field, key, name, op, value)


def _joined(kind: type[And] | type[Or], items: list[Expr]) -> Expr:
    if len(items) == 1:
        return items[0]
    flat: list[Expr] = []
    for item in items:
        flat.extend(item.items if isinstance(item, kind) else (item,))
    return kind(tuple(flat))


def _resolve(name: Token, field_name: str = "filter", labels: bool = True) -> tuple[Field, str]:
    """The field (and label key) a member names."""
    text = name.text
    if labels and (text == "labels" or text.startswith("labels.")):
        key = text[len("labels.") :] if text != "labels" else ""
        if key and not _LABEL_KEY.fullmatch(key):
            raise syntax_error(
                field_name,
                f"{name.shown()} at position {name.position} is not a label key (A-Z a-z 0-9 "
                "and . _ / -, starting with a letter or digit)",
            )
        return LABELS, key
    field = FIELDS.get(text)
    if field is None:
        known = KNOWN_FIELDS if labels else ", ".join(sorted(FIELDS))
        raise syntax_error(
            field_name,
            f"unknown field {name.shown()} at position {name.position}; known fields: {known}",
        )
    return field, ""


def _bad_value(name: Token, value: Token, need: str) -> InvalidRequest:
    return syntax_error(
        "filter",
        f"{name.text} needs {need}, not {value.shown()} at position {value.position}",
    )


def _restriction(field: Field, key: str, name: Token, comparator: Token, value: Token) -> Expr:
    """The typed node of ``name comparator value``."""
    op = comparator.text
    star = value.kind is Tok.WORD and value.text == "*"
    if field is LABELS and not key:
        if op != ":":
            raise syntax_error(
                "filter",
                f'"labels" at position {name.position} needs a key: labels.KEY {op} ..., '
                "or labels:KEY for runs that have it",
            )
        if star:
            return Has(LABELS)
        if not _LABEL_KEY.fullmatch(value.value):
            raise _bad_value(name, value, "a label key")
        return Has(LABELS, value.value)
    if op == ":" and star:
        if field.type not in (FieldType.LABEL, FieldType.TEXT, FieldType.TIME):
            raise syntax_error(
                "filter",
                f'"{name.text}:*" at position {name.position}: ":*" works on labels, times and '
                "text fields",
            )
        return Has(field, key)
    if op == ":":
        op = "="
    kind = field.type
    if kind in (FieldType.STATE, FieldType.KIND) and op not in ("=", "!="):
        raise syntax_error(
            "filter",
            f"{name.text} takes = and != only, not {comparator.shown()} at position "
            f"{comparator.position}",
        )
    if kind is FieldType.STATE:
        state = _STATES.get(value.value.upper().removeprefix("STATE_"))
        if state is None:
            raise _bad_value(name, value, f"one of {_STATE_NAMES}")
        return Compare(field, op, int(state))
    if kind is FieldType.KIND:
        lowered = value.value.lower()
        if lowered not in KINDS:
            raise _bad_value(name, value, f"one of {', '.join(KINDS)}")
        return Compare(field, op, lowered)
    if kind in (FieldType.NUMBER, FieldType.INTEGER):
        match = _NUMBER.fullmatch(value.text) if value.kind is Tok.WORD else None
        if match is None:
            raise _bad_value(name, value, "a number")
        exact = not any(c in value.text for c in ".eE")
        number: int | float = int(value.text) if exact else float(value.text)
        if isinstance(number, int) and abs(number) >= _NS_LIMIT:
            if kind is FieldType.INTEGER:
                raise _bad_value(name, value, "a 64-bit integer")
            number = float(number)
        return Compare(field, op, number)
    if kind is FieldType.TIME:
        ns = _time_ns(value.value)
        if ns is None:
            raise _bad_value(name, value, 'an RFC 3339 time in quotes, e.g. "2025-01-31T12:00:00Z"')
        return Compare(field, op, ns)
    text = value.value
    wild_start = value.star_start if value.kind is Tok.STRING else text.startswith("*")
    wild_end = value.star_end if value.kind is Tok.STRING else text.endswith("*")
    if op in ("=", "!=") and (wild_start or wild_end):
        core = text[1 if wild_start else 0 : len(text) - 1 if wild_end else len(text)]
        if wild_start and wild_end and core:
            node: Expr = Match(field, MatchKind.CONTAINS, core, key)
        else:
            node = Match(field, MatchKind.PREFIX if wild_end else MatchKind.SUFFIX, core, key)
        return Not(node) if op == "!=" else node
    return Compare(field, op, text, key)


def _time_ns(text: str) -> int | None:
    """Unix nanoseconds of an RFC 3339 time (a bare date: its midnight UTC), or None."""
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        moment = datetime.datetime(
            int(year), int(month), int(day), int(hour or 0), int(minute or 0), int(second or 0)
        )
    except ValueError:
        return None  # no such day, hour, minute or second
    seconds = calendar.timegm(moment.timetuple())
    if zone and zone not in "Zz":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    ns = seconds * 1_000_000_000 + int((fraction or "").ljust(9, "0"))
    return ns if -_NS_LIMIT < ns < _NS_LIMIT else None


def parse_filter(text: str) -> Expr | None:
    """The expression of an AIP-160 filter (None for an empty one).

    Raises:
        InvalidRequest: a malformed filter (naming the position), an unknown field (listing the
            known ones) or a value the field does not take.
    """
    return _Parser(text).filter()


# -- order_by -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OrderKey:
    """One key of an order: a scalar field, ascending unless ``descending``."""

    field: Field
    descending: bool = False

    def __str__(self) -> str:
        return f"{self.field.name} desc" if self.descending else self.field.name


def parse_order_by(text: str) -> tuple[OrderKey, ...]:
    """The keys of an AIP-132 ``order_by`` (``best_reward desc, create_time``); empty for "".

    Raises:
        InvalidRequest: a malformed order (naming the position), an unknown field (listing the
            fields an order takes) or a field named twice.
    """
    tokens = tokenize(text, "order_by")
    keys: list[OrderKey] = []
    at = 0
    if tokens[0].kind is Tok.END:
        return ()
    while True:
        name = tokens[at]
        if name.kind is not Tok.WORD:
            raise syntax_error(
                "order_by",
                f"unexpected {name.shown()} at position {name.position}, expected a field",
            )
        field, _ = _resolve(name, "order_by", labels=False)
        if any(k.field is field for k in keys):
            raise syntax_error(
                "order_by", f"{name.shown()} at position {name.position} is named twice"
            )
        at += 1
        descending = False
        word = tokens[at]
        if word.kind is Tok.WORD and word.text.lower() in ("asc", "desc"):
            descending = word.text.lower() == "desc"
            at += 1
        keys.append(OrderKey(field, descending))
        token = tokens[at]
        if token.kind is Tok.END:
            return tuple(keys)
        if token.kind is not Tok.COMMA:
            raise syntax_error(
                "order_by",
                f"unexpected {token.shown()} at position {token.position}, expected "
                '"asc", "desc", "," or the end',
            )
        at += 1
