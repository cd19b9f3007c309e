"""A search of runs as a store runs it (``RunQuery``: a state, a filter, an order, where the page
starts and how many), the page it answers (``RunPage``), and the ``ListRuns`` page tokens that
carry a search from one page to the next.

Pages are keyset pages: every order ends with the run's ``seq`` (creation order, unique), so the
sort values of a page's last run say exactly where the next page starts, however many runs are
created or deleted in between. A token holds those values and a fingerprint of the search (its
state, filter and order, as parsed: spacing does not count); a token used with another search
is refused. Searches read the values the store has committed: a run whose values change while
it is listed may be missed or listed twice across pages, as with any live list.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.filters import Expr, Field, FieldType, OrderKey, parse_filter, parse_order_by
from gateway.core.runs import RunState, TrainingRun
from trainwire.contract import FieldViolation

#: The tiebreak every order ends with.
SEQ = Field("seq", FieldType.INTEGER, "seq")
#: Tokens of the default order without a filter (the only tokens of earlier gateways, so
#: replicas of both versions take each other's during an upgrade).
_SEQ_TOKEN = b"runs/v1/"
#: Tokens of any other search.
_KEYSET_TOKEN = b"runs/v2/"
_INT64 = 1 << 63
_TOKEN_MESSAGE = "not a token from a previous ListRuns response"


@dataclass(frozen=True, slots=True)
class RunQuery:
    """What ``Store.list_runs`` reads.

    Attributes:
        state: Only runs in this state (None: any).
        filter: Only runs this expression holds for (None: all).
        order: The order asked for (empty: newest first).
        after: The sort values (``keys``) of the run the page starts after (None: the first
            page).
        limit: At most this many runs.
    """

    state: RunState | None = None
    filter: Expr | None = None
    order: tuple[OrderKey, ...] = ()
    after: tuple[Any, ...] | None = None
    limit: int = 50

    @property
    def keys(self) -> tuple[OrderKey, ...]:
        """The order with its final tiebreak on ``seq``, in the direction of the last key
        (newest first for the default order)."""
        descending = self.order[-1].descending if self.order else True
        return (*self.order, OrderKey(SEQ, descending))

    @property
    def fingerprint(self) -> str:
        """What a page token binds: the state, filter and order, canonically written."""
        state = "" if self.state is None else self.state.name
        order = ", ".join(str(k) for k in self.order)
        text = f"{state}\n{'' if self.filter is None else self.filter}\n{order}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def page_token(self, after: tuple[Any, ...] | None) -> str:
        """The token of the page that starts after the run whose sort values are ``after``
        ("" for none)."""
        if after is None:
            return ""
        if self.filter is None and not self.order:
            raw = _SEQ_TOKEN + str(after[0]).encode()
        else:
            raw = _KEYSET_TOKEN + json.dumps([self.fingerprint, *after]).encode()
        return base64.urlsafe_b64encode(raw).decode()

    def from_page_token(self, token: str) -> RunQuery:
        """This query starting where ``token`` says (as it is for "").

        Raises:
            InvalidRequest: a token this gateway did not issue, or one issued for another
                search.
        """
        if not token:
            return self
        try:
            raw = base64.urlsafe_b64decode(token.encode())
        except (binascii.Error, ValueError):
            raise _bad_token(_TOKEN_MESSAGE) from None
        if raw.startswith(_SEQ_TOKEN):
            if self.filter is not None or self.order:
                raise _bad_token(_OTHER_SEARCH)
            text = raw[len(_SEQ_TOKEN) :]
            if not text.isdigit() or not 0 < int(text) < _INT64:
                raise _bad_token(_TOKEN_MESSAGE)
            return replace(self, after=(int(text),))
        if not raw.startswith(_KEYSET_TOKEN):
            raise _bad_token(_TOKEN_MESSAGE)
        try:
            fingerprint, *values = json.loads(raw[len(_KEYSET_TOKEN) :])
        except (ValueError, TypeError):
            raise _bad_token(_TOKEN_MESSAGE) from None
        if fingerprint != self.fingerprint:
            raise _bad_token(_OTHER_SEARCH)
        keys = self.keys
        if len(values) != len(keys) or not all(
            _fits(k.field, v) for k, v in zip(keys, values, strict=True)
        ):
            raise _bad_token(_TOKEN_MESSAGE)
        return replace(self, after=tuple(values))


_OTHER_SEARCH = (
    "issued for another filter, order_by or state; ask for the first page again (no page_token)"
)


def _fits(field: Field, value: Any) -> bool:
    """Whether a token's value has the type of its key."""
    if field.type in (FieldType.TEXT, FieldType.KIND):
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if field.type is FieldType.NUMBER:
        return True
    return isinstance(value, int) and -_INT64 <= value < _INT64


def _bad_token(why: str) -> InvalidRequest:
    return InvalidRequest(f"page_token: {why}", [FieldViolation("page_token", why)])


@dataclass(frozen=True, slots=True)
class RunPage:
    """A page of runs in the order asked for, and the sort values of its last run when more
    follow (None on the last page)."""

    runs: list[TrainingRun]
    after: tuple[Any, ...] | None


def run_query(
    filter_text: str, order_by: str, state: RunState | None, page_token: str, limit: int
) -> RunQuery:
    """The query of a ``ListRuns`` request.

    Raises:
        InvalidRequest: a bad filter, order_by or page_token.
    """
    query = RunQuery(state, parse_filter(filter_text), parse_order_by(order_by), None, limit)
    return query.from_page_token(page_token)
