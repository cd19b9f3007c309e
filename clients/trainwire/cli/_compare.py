"""What ``trainwire compare`` shows: the config fields of several runs side by side (the ones
that differ, or all), and each run's state, last episode, final and best reward, as text or JSON.

Pure functions over ``Run`` messages (no client): a run's configuration is flattened to dotted
paths (``task.grpo.learning_rate``, ``config.seed``, ``labels.team``, ``fork_from``) whose values
compare as they are; a field a run does not set (an unset ``optional``, the other kind's task
fields, a label it lacks) reads ``None``, shown as ``-``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from google.protobuf import descriptor, message

from trainwire.cli._format import clean
from trainwire.client import Run, state_name

#: A flattened field's value: a scalar, a short summary of a long list, or None (unset).
Value: TypeAlias = "int | float | str | bool | None"

# Repeated fields longer than this (a custom clip's angles) read as a count and a digest.
_LIST_SHOWN = 8


@dataclass(frozen=True)
class FieldRow:
    """One config field across the compared runs.

    Attributes:
        field: Its dotted path (``task.imitation.learning_rate``).
        values: Its value in each run, in the runs' order (None: unset in that run).
    """

    field: str
    values: tuple[Value, ...]

    @property
    def differs(self) -> bool:
        """Whether any two runs hold different values."""
        return len({_key(v) for v in self.values}) > 1


def _key(value: Value) -> tuple[str, Value]:
    # 1, 1.0 and True are equal in Python; in a config they are different settings.
    return type(value).__name__, value


def _scalar(field: descriptor.FieldDescriptor, value: Any) -> Value:
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        named = field.enum_type.values_by_number.get(value)
        return named.name if named is not None else int(value)
    if field.type == descriptor.FieldDescriptor.TYPE_BYTES:
        return f"{len(value)} bytes"
    if isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _summary(items: Sequence[Any], field: descriptor.FieldDescriptor) -> Value:
    """A repeated field as one value: its items when few, else their count and a digest (two
    runs with the same long list read the same, different ones differ)."""
    if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
        data = b"".join(item.SerializeToString(deterministic=True) for item in items)
    else:
        shown = [_scalar(field, item) for item in items]
        if len(shown) <= _LIST_SHOWN:
            return ",".join(str(v) for v in shown)
        data = repr(shown).encode()
    return f"{len(items)} items #{hashlib.sha256(data).hexdigest()[:8]}"


def _repeated(field: descriptor.FieldDescriptor) -> bool:
    # protobuf 7 dropped ``label`` for ``is_repeated``, which early 6.x releases lack.
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(field.label == descriptor.FieldDescriptor.LABEL_REPEATED)


def _flatten(msg: message.Message, prefix: str, out: dict[str, Value]) -> None:
    for field in msg.DESCRIPTOR.fields:
        path = f"{prefix}.{field.name}"
        oneof = field.containing_oneof
        if oneof is not None and msg.WhichOneof(oneof.name) != field.name:
            continue  # another member of the oneof is set, or an unset ``optional``
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key in sorted(value):
                if value_field.message_type is not None:
                    _flatten(value[key], f"{path}.{key}", out)
                else:
                    out[f"{path}.{key}"] = _scalar(value_field, value[key])
        elif _repeated(field):
            out[path] = _summary(value, field)
        elif field.message_type is not None:
            if msg.HasField(field.name):
                _flatten(value, path, out)
        else:
            out[path] = _scalar(field, value)


def config_fields(run: Run) -> dict[str, Value]:
    """A run's configuration as dotted paths: ``task`` (its kind), ``task.<kind>.*``,
    ``config.*``, ``labels.<key>`` and ``fork_from`` (``RUN@EPISODE``), in that order."""
    out: dict[str, Value] = {"task": run.task.WhichOneof("kind")}
    _flatten(run.task, "task", out)
    _flatten(run.config, "config", out)
    for key in sorted(run.labels):
        out[f"labels.{key}"] = run.labels[key]
    if run.HasField("fork_from"):
        out["fork_from"] = f"{run.fork_from.run_id}@{run.fork_from.episode}"
    return out


def field_rows(runs: Sequence[Run]) -> list[FieldRow]:
    """Every config field any of the runs has, its value in each (None where a run lacks
    it); in the order the first run that has a field lists it, labels and lineage last."""
    flat = [config_fields(run) for run in runs]
    order: dict[str, None] = {}
    for fields in flat:
        order.update(dict.fromkeys(k for k in fields if not _trailing(k)))
    for fields in flat:
        order.update(dict.fromkeys(k for k in fields if _trailing(k)))
    return [FieldRow(name, tuple(fields.get(name) for fields in flat)) for name in order]


def _trailing(name: str) -> bool:
    return name.startswith("labels.") or name == "fork_from"


def differing(rows: Iterable[FieldRow]) -> list[FieldRow]:
    """The rows whose value is not the same in every run."""
    return [row for row in rows if row.differs]


def value_text(value: Value) -> str:
    """A value for the table: ``-`` when unset, floats as their shortest round-trip form."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return clean(str(value))


def _reward(run: Run, value: float) -> str:
    return f"{value:.6g}" if run.episode else "-"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def compare_text(runs: Sequence[Run], rows: Sequence[FieldRow], *, every: bool) -> str:
    """The runs' figures (one line each), then the fields of ``rows`` (one line each, a column
    per run); ``every`` says whether they are all fields or the differing ones."""
    figures = [("RUN", "NAME", "STATE", "EPISODE", "REWARD", "BEST")]
    for run in runs:
        figures.append(
            (
                run.id,
                clean(run.display_name) or "-",
                state_name(run.state).upper(),
                f"{run.episode}/{run.config.max_episodes}",
                _reward(run, run.reward),
                _reward(run, run.best_reward),
            )
        )
    lines = _table(figures)
    lines.append("")
    if rows:
        header = ("FIELD", *(run.id for run in runs))
        cells = [(row.field, *(value_text(v) for v in row.values)) for row in rows]
        lines.extend(_table([header, *cells]))
    else:
        lines.append("no config field differs" if not every else "no config fields")
    return "\n".join(lines)


def compare_json(runs: Sequence[Run], rows: Sequence[FieldRow]) -> dict[str, Any]:
    """``{"runs": [...], "fields": [{"field", "values"}...]}``: each run's id, display name,
    state, last and max episode, final and best reward (null before its first episode), and
    each field's value per run (null: unset)."""
    return {
        "runs": [
            {
                "id": run.id,
                "displayName": run.display_name,
                "state": Run.State.Name(run.state),
                "episode": run.episode,
                "maxEpisodes": run.config.max_episodes,
                "reward": run.reward if run.episode else None,
                "bestReward": run.best_reward if run.episode else None,
            }
            for run in runs
        ],
        "fields": [{"field": row.field, "values": list(row.values)} for row in rows],
    }


__all__ = [
    "FieldRow",
    "Value",
    "compare_json",
    "compare_text",
    "config_fields",
    "differing",
    "field_rows",
    "value_text",
]
