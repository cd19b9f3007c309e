"""The help of the ``trainwire`` command tree, laid out as gh and kubectl lay theirs out.

``CommandParser`` is the parser of every command: argparse's help (usage, description, the
command's own flags), then ``Inherited flags:`` (the global flags, named once in one short list;
``trainwire --help`` explains them), ``Examples:`` (one to three, each a comment and a command)
and an optional footer. ``commands`` walks the tree: the docs generator, the completion scripts
and the tests read the same parsers the command line parses with.

Invariants: a global flag's help text lives only on the root parser (a subcommand's copy has
``help=SUPPRESS``); every command has a description and 1..3 examples (tested).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

#: Width of the wrapped "Inherited flags" list.
_WIDTH = 78


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, with room for subcommand names: argparse measures them without
    their extra indent, so a long one ("imitation") would go on a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction) and action.choices:
            longest = max(len(name) for name in action.choices)
            self._action_max_length = max(
                self._action_max_length, longest + self._current_indent + 2
            )


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help ends with inherited flags, examples and a footer.

    Args:
        examples: ``(comment, command)`` pairs, shown under ``Examples:``.
        footer: Text shown last (e.g. the exit codes), as written.
    """

    def __init__(
        self,
        *args: Any,
        examples: Sequence[tuple[str, str]] = (),
        footer: str = "",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.examples: tuple[tuple[str, str], ...] = tuple(examples)
        self.footer = footer

    def inherited_flags(self) -> list[str]:
        """The global flags this command accepts, as ``--flag METAVAR`` (their help is the
        root's)."""
        return [
            flag_usage(action)
            for action in self._actions
            if action.option_strings and action.help == argparse.SUPPRESS
        ]

    def format_help(self) -> str:
        text = super().format_help().rstrip("\n") + "\n"
        inherited = self.inherited_flags()
        if inherited:
            listed = textwrap.fill(
                "  ".join(f.replace(" ", "\0") for f in inherited),
                width=_WIDTH,
                initial_indent="  ",
                subsequent_indent="  ",
                break_on_hyphens=False,
            ).replace("\0", " ")
            text += (
                "\nInherited flags (before or after the command; see `trainwire --help`):\n"
                f"{listed}\n"
            )
        if self.examples:
            text += "\nExamples:\n" + "".join(
                f"  # {comment}\n  {command}\n" for comment, command in self.examples
            )
        if self.footer:
            text += f"\n{self.footer}\n"
        return text


def flag_usage(action: argparse.Action) -> str:
    """``-v, --verbose`` or ``--gateway HOST:PORT``: a flag with its value's name."""
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or action.dest.upper()
    return f"{names} {metavar}"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name, in the order they were added ({} for a leaf)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The one-line help of each of a parser's subcommands, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._get_subactions()}
    return {}


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command of the tree, depth first, the root (path ``()``) first."""
    yield path, parser
    for name, sub in subcommands(parser).items():
        yield from commands(sub, (*path, name))
