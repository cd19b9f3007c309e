"""Plain-text and JSON rendering of runs and errors for the ``trainwire`` CLI (no rich needed).

Every string that comes from a server goes through ``clean`` before it reaches the terminal: a
display name holding ``ESC[2J``, BEL or CR must not clear, ring or overwrite anything. JSON output
escapes control characters the same way (``\\u001b``), C1 ones included.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC
from typing import Any, Literal

import grpc
from google.protobuf import json_format, message
from google.rpc import status_pb2

from trainwire.client import Run, TrainwireError, state_name
from trainwire.v1 import episode_pb2, gateway_service_pb2

_SPARK = "▁▂▃▄▅▆▇█"
# C0 controls, DEL and the C1 controls (0x80-0x9f: 0x9b is a one-byte CSI on some terminals).
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), never sent raw."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def to_dict(msg: message.Message) -> dict[str, Any]:
    """A message in the protobuf JSON mapping with its default options: lowerCamelCase names,
    enum names, int64 as strings, fields at their default left out (what grpcurl and the
    gateway's HTTP API print)."""
    data: dict[str, Any] = json_format.MessageToDict(msg)
    return data


def run_json(run: Run) -> dict[str, Any]:
    """A run as the unary RPCs return it: ``{"run": {...}}`` (e.g. ``GetRunResponse``)."""
    return to_dict(gateway_service_pb2.GetRunResponse(run=run))


def dumps(data: Any) -> str:
    """One line of JSON; control characters (C1 ones too, which ``json`` leaves raw) escaped."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return _CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def task_summary(run: Run) -> str:
    """``imitation wave/stickman`` or ``grpo models/x on data.jsonl``."""
    kind = run.task.WhichOneof("kind")
    if kind == "imitation":
        task = run.task.imitation
        clip = task.clip_name if task.WhichOneof("clip_source") == "clip_name" else task.clip.name
        rig = task.rig.name if task.WhichOneof("rig_source") == "rig" else task.rig_name
        return clean(f"imitation {clip or 'custom'}/{rig or 'stickman'}")
    if kind == "grpo":
        return clean(f"grpo {run.task.grpo.model_path} on {run.task.grpo.dataset_path}")
    return "-"


def run_name(run: Run) -> str:
    """What a legend calls a run: ``name (id)`` (the name cut at 40 characters), or its id."""
    if not run.display_name:
        return run.id
    return clean(f"{run.display_name[:40]} ({run.id})")


def rate_text(run: Run) -> str:
    """``10/s x 2`` or ``unpaced``."""
    if run.episodes_per_second < 0:
        return "unpaced"
    return f"{run.episodes_per_second:g}/s x {run.speed:g}"


def time_text(run: Run, field: Literal["create_time", "start_time", "end_time"]) -> str:
    """A timestamp field as local ISO time without microseconds, or ``-`` when unset."""
    if not run.HasField(field):
        return "-"
    stamp = getattr(run, field).ToDatetime(tzinfo=UTC)
    return stamp.astimezone().replace(microsecond=0).isoformat(sep=" ")


def run_line(run: Run) -> str:
    """One line: id, state, progress, rewards and rate."""
    parts = [
        f"run {run.id}",
        state_name(run.state).upper(),
        f"episode {run.episode}/{run.config.max_episodes}",
    ]
    if run.episode:
        parts.append(f"reward {run.reward:.4g} (best {run.best_reward:.4g})")
    parts.append(f"speed {run.speed:g}x")
    line = "  ".join(parts)
    if run.error_message:
        line += f"  error: {clean(run.error_message)}"
    return line


def labels_text(labels: Mapping[str, str]) -> str:
    """``team=vision, sweep=lr`` (sorted by key), or ``-``."""
    return clean(", ".join(f"{k}={labels[k]}" for k in sorted(labels))) or "-"


def fork_text(source: gateway_service_pb2.ForkSource) -> str:
    """``run ID at episode N`` (``its latest checkpoint`` for episode 0)."""
    where = f"episode {source.episode}" if source.episode else "its latest checkpoint"
    return clean(f"run {source.run_id} at {where}")


def trainers_text(run: Run) -> str:
    """Rank 0's trainer, or every trainer of a job that spans several, rank 0's first."""
    trainers = [clean(t) for t in run.trainers] or ([clean(run.trainer)] if run.trainer else [])
    if len(trainers) > 1:
        return f"{', '.join(trainers)} (rank 0 on {trainers[0]})"
    return trainers[0] if trainers else "-"


def run_details(run: Run) -> str:
    """A ``key: value`` block with everything people look at."""
    rows = [
        ("id", run.id),
        ("name", clean(run.display_name) or "-"),
        ("state", state_name(run.state).upper()),
        ("task", task_summary(run)),
        ("episode", f"{run.episode}/{run.config.max_episodes}"),
        ("reward", f"{run.reward:.6g}" if run.episode else "-"),
        ("best reward", f"{run.best_reward:.6g}" if run.episode else "-"),
        ("rate", rate_text(run)),
        ("seed", str(run.config.seed)),
        ("trainer", trainers_text(run)),
        ("checkpoint", f"episode {run.checkpoint_episode}" if run.checkpoint_episode else "-"),
        ("created", time_text(run, "create_time")),
        ("started", time_text(run, "start_time")),
        ("ended", time_text(run, "end_time")),
    ]
    if run.labels:
        rows.append(("labels", labels_text(run.labels)))
    if run.HasField("fork_from"):
        rows.append(("forked from", fork_text(run.fork_from)))
    if run.state_detail:
        rows.append(("detail", clean(run.state_detail)))
    if run.restarts:
        rows.append(("restarts", str(run.restarts)))
    if run.parked:
        rows.append(("parked", "yes: its trainer slot is free until it is resumed"))
    if run.request_id:
        rows.append(("request id", clean(run.request_id)))
    if run.error_message:
        rows.append(("error", clean(run.error_message)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)


def size_text(size: int) -> str:
    """A byte count for people: ``812 B``, ``3.4 MiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def checkpoints_table(run_id: str, checkpoints: Sequence[episode_pb2.Checkpoint]) -> str:
    """An aligned table of a run's checkpoints, oldest first (or a line saying there is none)."""
    if not checkpoints:
        return f"run {run_id} has no checkpoint yet"
    rows = [("EPISODE", "CREATED", "SIZE", "SHA-256")]
    for checkpoint in checkpoints:
        stamp = checkpoint.create_time.ToDatetime(tzinfo=UTC).astimezone()
        rows.append(
            (
                str(checkpoint.episode),
                stamp.replace(microsecond=0).isoformat(sep=" "),
                size_text(checkpoint.size_bytes),
                checkpoint.sha256,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def runs_table(runs: Sequence[Run]) -> str:
    """An aligned table of runs (a header line, then one line per run)."""
    header = ("ID", "STATE", "EPISODE", "REWARD", "BEST", "TASK", "NAME", "CREATED")
    rows = [header]
    for run in runs:
        rows.append(
            (
                run.id,
                state_name(run.state).upper(),
                f"{run.episode}/{run.config.max_episodes}",
                f"{run.reward:.4g}" if run.episode else "-",
                f"{run.best_reward:.4g}" if run.episode else "-",
                task_summary(run),
                clean(run.display_name) or "-",
                time_text(run, "create_time"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def error_lines(exc: TrainwireError, gateway: str, timeout: float) -> list[str]:
    """``error: CODE: message`` and, when the message lacks them, one line per bad field."""
    message = clean(exc.message)
    if exc.code_name == "UNAVAILABLE" and "connect" in message.lower():
        message = f"cannot reach the gateway at {gateway} ({message})"
    elif exc.code_name == "DEADLINE_EXCEEDED":
        message = f"{message} (no answer from {gateway} within {timeout:g} s; see --timeout)"
    lines = [f"error: {exc.code_name}: {message}"]
    for violation in exc.field_violations:
        text = clean(f"{violation.field}: {violation.description}")
        if text not in message:
            lines.append(f"  {text}")
    return lines


def error_status(exc: TrainwireError) -> status_pb2.Status:
    """The error's ``google.rpc.Status`` (its details as the server sent them)."""
    if exc.status is not None:
        return exc.status
    code = exc.code.value[0] if exc.code is not None else 2  # UNKNOWN
    return status_pb2.Status(code=code, message=exc.message)


def error_json(exc: TrainwireError) -> str:
    """The error as one JSON line: ``{"error": STATUS}``, STATUS being the ``google.rpc.Status``
    in the protobuf JSON mapping (``code``, ``message``, ``details`` with ``@type``), as
    ``grpcurl -format-error`` prints it."""
    return dumps({"error": to_dict(error_status(exc))})


def error_detail_lines(exc: TrainwireError) -> list[str]:
    """What ``-v`` adds to an error: the gRPC code and details and every google.rpc detail."""
    cause = exc.__cause__
    lines = [f"  grpc code: {exc.code_name} ({exc.code.value[0] if exc.code else '?'})"]
    if isinstance(cause, grpc.Call):
        lines.append(f"  grpc details: {clean(cause.details() or '')}")
    if exc.reason:
        metadata = ", ".join(f"{k}={clean(v)}" for k, v in sorted(exc.metadata.items()))
        lines.append(f"  reason: {clean(exc.reason)}" + (f" ({metadata})" if metadata else ""))
    if exc.localized_message:
        lines.append(f"  message for people: {clean(exc.localized_message)}")
    for violation in exc.field_violations:
        lines.append(f"  bad field: {clean(violation.field)}: {clean(violation.description)}")
    return lines


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """The values as a line of block characters, at most ``width`` wide (bucket means)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width <= 0:
        return ""
    if len(finite) > width:
        buckets = []
        for i in range(width):
            chunk = finite[i * len(finite) // width : (i + 1) * len(finite) // width]
            buckets.append(sum(chunk) / len(chunk))
        finite = buckets
    low, high = min(finite), max(finite)
    span = high - low
    if span == 0:
        return _SPARK[len(_SPARK) // 2] * len(finite)
    top = len(_SPARK) - 1
    return "".join(_SPARK[round((v - low) / span * top)] for v in finite)


def duration_text(seconds: float) -> str:
    """``1:02:03``, ``2:03`` or ``5 s``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"
