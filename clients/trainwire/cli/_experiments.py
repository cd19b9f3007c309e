"""The ``trainwire`` commands that treat runs as experiments: ``runs label``, ``runs rename``,
``runs fork`` and ``compare`` (``plot RUN RUN...`` is in ``trainwire.cli._commands``). Each takes
the client, the parsed arguments and the output and returns the exit code; server errors
propagate to ``main`` as ``TrainwireError``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from trainwire.cli import _compare, _format
from trainwire.cli._commands import created
from trainwire.cli._output import EXIT_OK, CliError, Output
from trainwire.client import GatewayClient, Run
from trainwire.v1 import episode_pb2

#: A label change as the command line gives it: ``(key, value)`` sets, ``(key, None)`` removes.
LabelChange = tuple[str, str | None]


def apply_label_changes(
    labels: Mapping[str, str], changes: Iterable[LabelChange]
) -> dict[str, str]:
    """``labels`` with ``changes`` applied in order (removing an absent key is a no-op)."""
    out = dict(labels)
    for key, value in changes:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def cmd_label(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    # UpdateRun replaces the whole set: read it, change it, send it back. A concurrent label
    # edit between the two calls is lost (the gateway has no etag to refuse it with).
    run = client.get_run(args.run_id)
    labels = apply_label_changes(run.labels, args.changes)
    run = client.update_run(args.run_id, labels=labels)
    out.result(_format.run_details(run), _format.run_json(run))
    return EXIT_OK


def cmd_rename(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    run = client.update_run(args.run_id, display_name=args.name)
    out.result(_format.run_details(run), _format.run_json(run))
    return EXIT_OK


def _only(kind: str | None, wanted: str, flag: str, run: Run) -> None:
    if kind != wanted:
        what = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" if kind else "a task-less"
        raise CliError(f"{flag} applies to {wanted} runs; run {run.id} is {what} run")


def fork_task(parent: Run, args: argparse.Namespace) -> episode_pb2.TrainTask:
    """The parent's task with the command line's changes (a flag left out keeps its value).

    Raises:
        CliError: a flag the parent's task kind has no such setting for.
    """
    task = episode_pb2.TrainTask()
    task.CopyFrom(parent.task)
    kind = task.WhichOneof("kind")
    if args.learning_rate is not None:
        if kind == "imitation":
            task.imitation.learning_rate = args.learning_rate
        elif kind == "grpo":
            task.grpo.learning_rate = args.learning_rate
        else:
            raise CliError(f"run {parent.id} has no task to change the learning rate of")
    if args.group_size is not None:
        _only(kind, "imitation", "--group-size", parent)
        task.imitation.group_size = args.group_size
    for flag, name in (
        ("--temperature", "temperature"),
        ("--beta", "beta"),
        ("--num-generations", "num_generations"),
    ):
        value = getattr(args, name)
        if value is not None:
            _only(kind, "grpo", flag, parent)
            setattr(task.grpo, name, value)
    return task


def fork_config(parent: Run, args: argparse.Namespace) -> episode_pb2.TrainConfig:
    """The parent's config with ``--episodes`` and ``--seed`` applied."""
    config = episode_pb2.TrainConfig()
    config.CopyFrom(parent.config)
    if args.episodes is not None:
        config.max_episodes = args.episodes
    if args.seed is not None:
        config.seed = args.seed
    return config


def cmd_fork(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    parent = client.get_run(args.run_id)
    run = client.create_run(
        fork_task(parent, args),
        fork_config(parent, args),
        speed=args.speed,
        episodes_per_second=parent.episodes_per_second if args.rate is None else args.rate,
        request_id=args.request_id,
        display_name=args.name,
        labels=apply_label_changes(parent.labels, args.labels),
        fork_from=(parent.id, args.episode),
    )
    return created(client, args, out, run)


#: ``set``'s flags by the hyperparameter they change, in the order they are said.
_LIVE = (("learning_rate", "--learning-rate"), ("temperature", "--temperature"), ("beta", "--beta"))


def live_values(run: Run) -> dict[str, float]:
    """The live hyperparameters a run's task holds (what ``set`` can change), by name."""
    kind = run.task.WhichOneof("kind")
    if kind == "imitation":
        return {"learning_rate": run.task.imitation.learning_rate}
    if kind == "grpo":
        grpo = run.task.grpo
        values = {"learning_rate": grpo.learning_rate, "temperature": grpo.temperature}
        if grpo.HasField("beta"):
            values["beta"] = grpo.beta
        return values
    return {}


def cmd_set(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    given = {name: getattr(args, name) for name, _ in _LIVE if getattr(args, name) is not None}
    if not given:
        raise CliError(f"give at least one of {', '.join(flag for _, flag in _LIVE)}")
    run = client.set_run_hyperparameters(args.run_id, **given)
    now = live_values(run)
    said = ", ".join(f"{name} {now.get(name, value):g}" for name, value in given.items())
    out.result(f"set {said}: {_format.run_line(run)}", _format.run_json(run))
    return EXIT_OK


def distinct_runs(run_ids: Iterable[str], least: int) -> list[str]:
    """The run ids in order, each once.

    Raises:
        CliError: fewer than ``least`` distinct runs.
    """
    unique = list(dict.fromkeys(run_ids))
    if len(unique) < least:
        raise CliError(f"give at least {least} different runs (got {', '.join(unique)})")
    return unique


def cmd_compare(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    runs = [client.get_run(run_id) for run_id in distinct_runs(args.run_ids, 2)]
    rows = _compare.field_rows(runs)
    if not args.all:
        rows = _compare.differing(rows)
    out.result(_compare.compare_text(runs, rows, every=args.all), _compare.compare_json(runs, rows))
    return EXIT_OK
