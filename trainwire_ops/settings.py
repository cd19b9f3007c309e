"""Command lines generated from a service's config dataclass: one source for every default and
help text (the pattern of TRL's ``GRPOConfig`` with ``HfArgumentParser``).

Each field of the frozen config dataclass is declared with :func:`option`, which keeps its
help (and, where the command line differs from code, its flag name, metavar, choices, parser
or command-line default) in the field's metadata. :func:`build_parser` makes one flag per field
and :func:`config_from_args` builds the config back from the parsed flags, so a default or a
help text is written once. Every flag can also come from an environment variable,
``PREFIX`` + the flag's name in upper case (``--heartbeat-timeout`` of the gateway is
``TRAINWIRE_GATEWAY_HEARTBEAT_TIMEOUT``); a flag on the command line wins over the environment,
and ``--help`` shows both the default and the variable. A field declared ``repeat=True`` (a
``tuple[X, ...]``) takes its flag several times, one value each; its variable holds the values
separated by ``os.pathsep`` (``:``), as ``PATH`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

C = TypeVar("C")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    group: str | None = None,
    parse: Callable[[str], Any] | None = None,
    cli_default: Any = dataclasses.MISSING,
    repeat: bool = False,
) -> Any:
    """A config field with its command line.

    Args:
        default: The default (also on the command line unless ``cli_default`` is given).
        help: The help text of the flag.
        flag: The flag (``--name``); by default the field's name with ``_`` as ``-`` and a
            ``_s`` (seconds) suffix dropped.
        metavar: The flag's metavar.
        choices: The values the flag accepts.
        group: The ``--help`` section it is listed in.
        parse: Turns the flag's text into the field's value (default: by the field's type).
        cli_default: The default of the command line when it differs from code's (a server
            port that tests leave off).
        repeat: The flag may be given several times, one value each (the field is a
            ``tuple[X, ...]``; ``parse`` then reads one value). The first use on the command
            line replaces the default rather than adding to it.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "metavar": metavar,
        "choices": tuple(choices) if choices is not None else None,
        "group": group,
        "parse": parse,
        "cli_default": cli_default,
        "repeat": repeat,
    }
    if isinstance(default, list | dict | set):
        raise TypeError("mutable defaults are not allowed in a frozen config")
    return dataclasses.field(default=default, metadata=metadata)


def port_or_off(text: str) -> int | None:
    """A port flag's value: a port, or -1 (or an empty value) for an endpoint that is off."""
    if text.strip() in ("", "-1"):
        return None
    return int(text)


def flag_of(field: dataclasses.Field[Any]) -> str:
    """The flag of a config field."""
    declared = field.metadata.get("flag")
    if declared:
        return str(declared)
    name = field.name[:-2] if field.name.endswith("_s") else field.name
    return "--" + name.replace("_", "-")


def env_of(field: dataclasses.Field[Any], prefix: str) -> str:
    """The environment variable of a config field."""
    return prefix + flag_of(field).lstrip("-").replace("-", "_").upper()


def _kind(annotation: Any) -> tuple[type, bool]:
    """The value type of an annotation and whether ``None`` is allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner, _ = _kind(args[0])
        return inner, True
    if origin is tuple:
        return tuple, False
    return annotation, False


def _parser_for(field: dataclasses.Field[Any], annotation: Any) -> Callable[[str], Any]:
    declared = field.metadata.get("parse")
    if declared is not None:
        return declared  # type: ignore[no-any-return]
    kind, optional = _kind(annotation)
    if kind is tuple:
        return lambda text: tuple(part.strip() for part in text.split(",") if part.strip())
    if kind is bool:
        return _parse_bool
    if kind in (int, float, str):
        convert: Callable[[str], Any] = kind
    elif kind is pathlib.Path:
        convert = pathlib.Path
    else:
        raise TypeError(f"config field {field.name}: no parser for {annotation!r}")
    if optional:
        return lambda text: None if text == "" else convert(text)
    return convert


def _item_parser(field: dataclasses.Field[Any], annotation: Any) -> Callable[[str], Any]:
    """The parser of one value of a repeatable field (``tuple[X, ...]``)."""
    declared = field.metadata.get("parse")
    if declared is not None:
        return declared  # type: ignore[no-any-return]
    args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
    kind = args[0] if args else str
    if kind in (int, float, str, pathlib.Path):
        return kind  # type: ignore[no-any-return]
    raise TypeError(f"config field {field.name}: no parser for {annotation!r}")


def _path_list(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A parser of values separated by ``os.pathsep``, each read by ``item``."""

    def parse(text: str) -> tuple[Any, ...]:
        return tuple(item(part) for part in text.split(os.pathsep) if part)

    return parse


class _Repeated(argparse.Action):
    """Collects every use of a repeatable flag into a tuple; the first use replaces the default
    (from code or the environment) instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        earlier = () if current is self.default or current is None else tuple(current)
        setattr(namespace, self.dest, (*earlier, values))


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a yes/no value (1/0, true/false)")


def _typed(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """A type for argparse whose error names the flag, not an internal function."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid value: {exc}") from None

    convert.__name__ = flag.lstrip("-")
    return convert


def _metavar(field: dataclasses.Field[Any], flag: str) -> str | None:
    """The declared metavar; SECONDS for a ``_s`` field; none where choices are listed."""
    if field.metadata["metavar"]:
        return str(field.metadata["metavar"])
    if field.metadata["choices"]:
        return None
    if field.name.endswith("_s"):
        return "SECONDS"
    return flag.lstrip("-").replace("-", "_").upper()


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if value is None:
        return "none"
    return str(value)


def build_parser(
    config: type[Any],
    *,
    prog: str,
    description: str,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """A parser with one flag per field of ``config`` (see the module docstring).

    Raises:
        SystemExit: (through the parser) an environment variable with a bad value.
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(config)
    groups: dict[str | None, argparse._ArgumentGroup | argparse.ArgumentParser] = {None: parser}
    for field in dataclasses.fields(config):
        if "help" not in field.metadata:
            continue
        flag = flag_of(field)
        env = env_of(field, env_prefix)
        repeat = bool(field.metadata.get("repeat"))
        # ``item`` reads one flag's value; ``parse`` the whole variable.
        if repeat:
            item = _item_parser(field, hints[field.name])
            parse = _path_list(item)
        else:
            item = parse = _parser_for(field, hints[field.name])
        default = field.metadata["cli_default"]
        if default is dataclasses.MISSING:
            default = field.default
        shown_default = default
        if env in environ:
            try:
                default = parse(environ[env])
            except (TypeError, ValueError) as exc:
                parser.error(f"{env}={environ[env]!r}: {exc}")
        group_name = field.metadata["group"]
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        target = groups[group_name]
        shown_env = f"env {env}, values separated by {os.pathsep!r}" if repeat else f"env {env}"
        help_text = f"{field.metadata['help']} (default: {_shown(shown_default)}; {shown_env})"
        kind, _ = _kind(hints[field.name])
        if kind is bool and field.metadata["parse"] is None:
            target.add_argument(
                flag, dest=field.name, action="store_true", default=default, help=help_text
            )
            continue
        target.add_argument(
            flag,
            dest=field.name,
            type=_typed(item, flag),
            default=default,
            metavar=_metavar(field, flag),
            choices=field.metadata["choices"],
            help=help_text.replace("%", "%%"),
            action=_Repeated if repeat else "store",
        )
    return parser


def config_from_args(config: type[C], args: argparse.Namespace, **extra: Any) -> C:
    """The config of parsed flags (``extra`` sets fields without a flag).

    Raises:
        ValueError: a value the config refuses (its ``__post_init__``).
    """
    values = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(config)  # type: ignore[arg-type]
        if hasattr(args, field.name)
    }
    values.update(extra)
    return config(**values)
