"""Tokens of the search language of ``ListRuns`` (``gateway.core.filters``): the lexer of a
``filter`` or ``order_by`` text.

Invariants: a token list always ends with one ``END`` token; every token knows where it starts
(counted in characters from 1) and its text as written, so that errors can point at it; a
string's value is its unescaped text, and it says whether it starts or ends with an unescaped
``*`` (a wildcard). A text longer than ``MAX_LENGTH`` is refused before it is read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.core.errors import InvalidRequest
from trainwire.contract import FieldViolation

#: The longest filter or order_by accepted.
MAX_LENGTH = 4096

_COMPARATORS = ("<=", ">=", "!=", "=", "<", ">", ":")
#: Characters that end a word (besides whitespace).
_STOP = frozenset("()=!<>:,\"'")


class Tok(enum.Enum):
    """Token kinds."""

    WORD = "word"  #: a name, number, keyword or unquoted value
    STRING = "string"  #: a quoted string
    OP = "comparator"
    LPAREN = "("
    RPAREN = ")"
    COMMA = ","
    END = "end"


@dataclass(frozen=True, slots=True)
class Token:
    """One token: its kind, its text as written, its value (a string's unescaped text) and
    where it starts (counted from 1); a string also says whether it starts and ends with an
    unescaped ``*``."""

    kind: Tok
    text: str
    value: str
    position: int
    star_start: bool = False
    star_end: bool = False

    def shown(self) -> str:
        """The token as an error message names it."""
        if self.kind is Tok.END:
            return "end of input"
        return self.text if self.kind is Tok.STRING else f'"{self.text}"'


def syntax_error(field: str, message: str) -> InvalidRequest:
    """The error refusing a ``filter`` or ``order_by`` (``field``)."""
    return InvalidRequest(f"{field}: {message}", [FieldViolation(field, message)])


def tokenize(text: str, field: str = "filter") -> list[Token]:
    """The tokens of ``text``, ending with an END token.

    Raises:
        InvalidRequest: an unterminated string, a stray ``!``, or a text too long.
    """
    if len(text) > MAX_LENGTH:
        raise syntax_error(field, f"{len(text)} characters; at most {MAX_LENGTH}")
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "(),":
            kind = {"(": Tok.LPAREN, ")": Tok.RPAREN, ",": Tok.COMMA}[c]
            out.append(Token(kind, c, c, i + 1))
            i += 1
        elif c in "=!<>:":
            op = next((o for o in _COMPARATORS if text.startswith(o, i)), "")
            if not op:
                raise syntax_error(field, f'unexpected "{c}" at position {i + 1}')
            out.append(Token(Tok.OP, op, op, i + 1))
            i += len(op)
        elif c in "\"'":
            out.append(_string(text, i, field))
            i += len(out[-1].text)
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in _STOP:
                j += 1
            word = text[i:j]
            out.append(Token(Tok.WORD, word, word, i + 1))
            i = j
    out.append(Token(Tok.END, "", "", n + 1))
    return out


def _string(text: str, start: int, field: str) -> Token:
    quote = text[start]
    chars: list[str] = []
    star_start = star_end = False
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == quote:
            return Token(
                Tok.STRING,
                text[start : i + 1],
                "".join(chars),
                start + 1,
                star_start,
                star_end,
            )
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            chars.append({"n": "\n", "t": "\t", "r": "\r"}.get(nxt, nxt))
            star_end = False
            i += 2
            continue
        if c == "*":
            star_start = star_start or not chars
            star_end = True
        else:
            star_end = False
        chars.append(c)
        i += 1
    raise syntax_error(field, f"unterminated string starting at position {start + 1}")


# -- the expression tree ------------------------------------------------------------------------
