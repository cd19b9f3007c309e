"""The ``trainwire`` commands that create, list, get, control and draw runs (``watch`` is in
``trainwire.cli._follow``). Each takes the client, the parsed arguments and the output and
returns the exit code; server errors propagate to ``main`` as ``TrainwireError``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainwire.cli import _format
from trainwire.cli._follow import cmd_watch, history
from trainwire.cli._output import EXIT_OK, CliError, Output
from trainwire.client import (
    EpisodeView,
    GatewayClient,
    Run,
    Unimplemented,
    grpo_task,
    imitation_task,
    state_name,
    train_config,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2

if TYPE_CHECKING:
    from trainwire.v1.gateway_service_pb2 import CurveBucket

_LOGGER = logging.getLogger(__name__)


def created(client: GatewayClient, args: argparse.Namespace, out: Output, run: Run) -> int:
    """Says a run was created (its id alone with ``--quiet``) and watches it with ``--watch``."""
    if args.quiet and not out.json:
        print(run.id, flush=True)
    else:
        out.result(f"created {_format.run_line(run)}", _format.run_json(run))
    if args.watch:
        args.run_id, args.after, args.idle_timeout, args.scalars = run.id, 0, 30.0, False
        return cmd_watch(client, args, out)
    return EXIT_OK


def _create(
    client: GatewayClient, args: argparse.Namespace, out: Output, task: episode_pb2.TrainTask
) -> int:
    run = client.create_run(
        task,
        train_config(args.episodes, args.seed, args.checkpoint_every, args.keep_checkpoints),
        speed=args.speed,
        episodes_per_second=args.rate,
        request_id=args.request_id,
        display_name=args.name,
        labels=dict(args.labels),
    )
    return created(client, args, out, run)


def cmd_create_imitation(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    task = imitation_task(
        clip=args.clip,
        rig=args.rig,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        avatar_id=args.avatar,
    )
    return _create(client, args, out, task)


def grpo_task_of(args: argparse.Namespace) -> episode_pb2.TrainTask:
    """The task ``runs create grpo`` asks for: ``--reward NAME[=WEIGHT],...`` sends weights
    only when one is given (then a reward without one weighs 1); ``--*-column`` names the
    dataset's columns."""
    rewards: list[tuple[str, float | None]] = args.reward
    # Weights go only when one is given; then a reward without one weighs 1.
    weighted = any(weight is not None for _, weight in rewards)
    columns = {
        role: getattr(args, f"{role}_column")
        for role in ("prompt", "images", "solution")
        if getattr(args, f"{role}_column")
    }
    return grpo_task(
        model=args.model,
        dataset=args.dataset,
        reward_functions=[name for name, _ in rewards],
        reward_weights=[1.0 if w is None else w for _, w in rewards] if weighted else [],
        columns=columns,
        num_generations=args.num_generations,
        batch_size=args.batch_size,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        beta=args.beta,
        temperature=args.temperature,
        gradient_accumulation_steps=args.grad_accum,
        dataloader_num_workers=args.workers,
        dataloader_prefetch_factor=args.prefetch,
        num_processes=args.processes,
        lora=_lora_of(args),
        gradient_checkpointing=args.gradient_checkpointing,
    )


def _lora_of(args: argparse.Namespace) -> episode_pb2.LoraConfig | None:
    """``--lora`` or any ``--lora-*`` flag asks for LoRA; zeros and empties are the
    defaults."""
    targets = [name.strip() for name in args.lora_targets.split(",") if name.strip()]
    if not (args.lora or args.lora_rank or args.lora_alpha or args.lora_dropout or targets):
        return None
    return episode_pb2.LoraConfig(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        dropout=args.lora_dropout,
        target_modules=targets,
    )


def cmd_create_grpo(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    return _create(client, args, out, grpo_task_of(args))


def cmd_list(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    runs = client.list_runs(
        state=args.state, limit=args.limit or None, filter=args.filter, order_by=args.order_by
    )
    if out.json:
        out.result("", _format.to_dict(gateway_service_pb2.ListRunsResponse(runs=runs)))
    elif runs:
        out.result(_format.runs_table(runs), None)
    else:
        which = f" in state {state_name(args.state)}" if args.state else ""
        found = " found by the filter" if args.filter else ""
        out.info(f"no runs{which}{found}")
    return EXIT_OK


def cmd_get(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    run = client.get_run(args.run_id)
    out.result(_format.run_details(run), _format.run_json(run))
    return EXIT_OK


def cmd_delete(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    run = client.delete_run(args.run_id)
    out.result(f"deleted run {run.id}", _format.run_json(run))
    return EXIT_OK


def cmd_checkpoints(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    checkpoints = client.list_checkpoints(args.run_id)
    reply = gateway_service_pb2.ListCheckpointsResponse(checkpoints=checkpoints)
    out.result(_format.checkpoints_table(args.run_id, checkpoints), _format.to_dict(reply))
    return EXIT_OK


def cmd_download(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    try:
        record = client.download_checkpoint(
            args.run_id, args.out, episode=args.episode, merged=args.merged
        )
    except FileExistsError as exc:
        raise CliError(f"--out: {exc}") from None
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    what = "checkpoint merged into its base model" if args.merged else "checkpoint"
    out.result(
        f"run {args.run_id}: {what} at episode {record.episode} "
        f"({_format.size_text(record.size_bytes)}, SHA-256 {record.sha256}) extracted into "
        f"{args.out}",
        {"checkpoint": _format.to_dict(record), "out": str(args.out)},
    )
    return EXIT_OK


_CONTROL_VERBS = {"pause": "paused", "resume": "resumed", "stop": "stopped"}


def cmd_control(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    method = {"pause": client.pause_run, "resume": client.resume_run, "stop": client.stop_run}
    run = method[args.action](args.run_id)
    out.result(f"{_CONTROL_VERBS[args.action]}: {_format.run_line(run)}", _format.run_json(run))
    return EXIT_OK


def cmd_speed(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    run = client.set_run_speed(args.run_id, args.speed)
    out.result(f"speed set: {_format.run_line(run)}", _format.run_json(run))
    return EXIT_OK


def _curve(
    client: GatewayClient, run_id: str, buckets: int, metrics: Sequence[str]
) -> Sequence[CurveBucket]:
    """The run's curve in about ``buckets`` buckets; from a gateway that predates
    ``GetRunCurve``, its replayed history, one bucket per episode."""
    try:
        return client.get_run_curve(run_id, buckets=buckets, metrics=metrics).buckets
    except Unimplemented:
        from trainwire import render

        _LOGGER.info("run %s: the gateway has no GetRunCurve; replaying its history", run_id)
        scalars = history(client, run_id, EpisodeView.EPISODE_VIEW_SCALARS)
        return render.episode_buckets(scalars)


def cmd_plot(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    from trainwire import render

    run_ids = list(dict.fromkeys(args.run_ids))
    if len(run_ids) > 1:
        return _plot_overlay(client, args, out, run_ids)
    run = client.get_run(run_ids[0])
    buckets = _curve(client, run.id, render.curve_buckets(), args.metrics)
    if not buckets:
        raise CliError(f"run {run.id} has no episodes yet; nothing to plot")
    title = f"run {run.id} - {_format.task_summary(run)}"
    try:
        render.plot_buckets(
            buckets, args.out, title=title, window=args.window, metrics=args.metrics
        )
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from exc
    episodes = buckets[-1].last_episode
    out.result(
        f"wrote {args.out} ({episodes} episodes of run {run.id})",
        {"runId": run.id, "out": args.out, "episodes": episodes},
    )
    return EXIT_OK


def _plot_overlay(
    client: GatewayClient, args: argparse.Namespace, out: Output, run_ids: Sequence[str]
) -> int:
    """``plot RUN RUN...``: every run's curve on one chart, one colour each."""
    from trainwire import render

    runs = [client.get_run(run_id) for run_id in run_ids]
    curves = [_curve(client, run.id, render.curve_buckets(), args.metrics) for run in runs]
    empty = [run.id for run, buckets in zip(runs, curves, strict=True) if not buckets]
    if len(empty) == len(runs):
        raise CliError(f"runs {', '.join(empty)} have no episodes yet; nothing to plot")
    for run_id in empty:
        out.info(f"run {run_id} has no episodes yet; it is in the legend only")
    kinds = {_format.task_summary(run) for run in runs}
    title = f"{len(runs)} runs - {kinds.pop()}" if len(kinds) == 1 else f"{len(runs)} runs"
    try:
        render.plot_overlay(
            [(_format.run_name(run), buckets) for run, buckets in zip(runs, curves, strict=True)],
            args.out,
            title=title,
            window=args.window,
            metrics=args.metrics,
        )
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from exc
    episodes = [buckets[-1].last_episode if buckets else 0 for buckets in curves]
    out.result(
        f"wrote {args.out} (runs "
        + ", ".join(f"{run.id} ({n} episodes)" for run, n in zip(runs, episodes, strict=True))
        + ")",
        {
            "out": args.out,
            "runs": [
                {"runId": run.id, "episodes": n} for run, n in zip(runs, episodes, strict=True)
            ],
        },
    )
    return EXIT_OK


def cmd_avatar(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    from trainwire import motion, render

    run = client.get_run(args.run_id)
    if run.task.WhichOneof("kind") != "imitation":
        raise CliError(
            f"run {run.id} is a {run.task.WhichOneof('kind') or 'task-less'} run; "
            "avatar needs an imitation run"
        )
    detail = render.last_motion(history(client, args.run_id))
    if detail is None:
        raise CliError(
            f"run {run.id} has no learned motion yet (imitation runs send one every 10th "
            "episode and on the last)"
        )
    try:
        rig = motion.rig_from_task(run.task.imitation)
        clip = motion.clip_from_task(run.task.imitation)
    except KeyError as exc:
        raise CliError(f"run {run.id}: unknown built-in rig or clip {exc}") from exc
    try:
        if args.gif:
            render.avatar_gif(rig, clip, detail.angles, args.out)
        else:
            render.avatar_strip(rig, clip, detail.angles, args.out, poses=args.poses)
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CliError(f"run {run.id}: {exc}") from exc
    out.result(
        f"wrote {args.out} (learned motion of run {run.id}, {detail.frame_count} frames)",
        {"runId": run.id, "out": args.out, "frames": detail.frame_count},
    )
    return EXIT_OK
