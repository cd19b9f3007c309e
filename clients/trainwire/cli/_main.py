"""The ``trainwire`` command line: argument parsing, the commands, and exit codes.

Every command talks to the gateway through ``trainwire.client.GatewayClient`` (a deadline on every
call). Server errors become one ``error: CODE: message`` line on stderr and a non-zero exit,
never a traceback. rich (the live view) and Pillow (pictures) are imported only by the commands
that draw, so the rest works with the bare client install.

Exit codes: 0 success (``watch``: the run is DONE); 1 a server error, a failed run (ERROR) or a
local problem; 2 bad usage; 3 ``watch`` saw the run STOPPED; 130 interrupted (Ctrl+C detaches
from a watched run without stopping it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainwire import __version__
from trainwire.cli import _format
from trainwire.client import (
    GatewayClient,
    Reconnect,
    Run,
    TrainwireError,
    WatchEvent,
    WatchStream,
    grpo_task,
    imitation_task,
    parse_state,
    state_name,
    train_config,
)
from trainwire.contract import BUILTIN_CLIPS, BUILTIN_RIG_BONES, REWARD_FUNCTIONS
from trainwire.v1 import episode_pb2, gateway_service_pb2

_LOGGER = logging.getLogger(__name__)

DEFAULT_GATEWAY = "localhost:50051"
DEFAULT_TIMEOUT = 10.0
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A local problem worth one ``error:`` line (missing extra, unwritable file, ...)."""


class _Output:
    """Where a command writes: results to stdout, diagnostics to stderr, JSON or text."""

    def __init__(self, json_mode: bool) -> None:
        self.json = json_mode

    def result(self, text: str, data: Any) -> None:
        print(_format.dumps(data) if self.json else text, flush=True)

    def info(self, text: str) -> None:
        if not self.json:
            print(text, file=sys.stderr, flush=True)


# -- arguments ---------------------------------------------------------------------------------


# argparse names a converter that raises ValueError in its message ("invalid _positive_float
# value"); these raise ArgumentTypeError, whose text is shown as it is.


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not > 0")
    return value


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _state(text: str) -> int:
    try:
        return parse_state(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _common_options(suppress: bool) -> argparse.ArgumentParser:
    """The connection and output options, accepted before or after the command.

    Every subcommand's help shows them too; there their defaults are suppressed so a value
    given before the command survives (so no help text says ``%(default)s``).
    """
    parser = argparse.ArgumentParser(add_help=False)
    default: Callable[[Any], Any] = (lambda _: argparse.SUPPRESS) if suppress else (lambda v: v)
    group = parser.add_argument_group("connection and output (before or after the command)")
    group.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        default=default(os.environ.get("TRAINWIRE_GATEWAY") or DEFAULT_GATEWAY),
        help=f"gateway address (default: $TRAINWIRE_GATEWAY, else {DEFAULT_GATEWAY})",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="machine-readable output: the protobuf JSON mapping of the RPC's response, as "
        "grpcurl and the HTTP API print it (watch: one WatchRunResponse per line)",
    )
    group.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=default(DEFAULT_TIMEOUT),
        help=f"deadline of each call to the gateway (default: {DEFAULT_TIMEOUT:g})",
    )
    for flag, env, meta, text in (
        ("--ca", "TRAINWIRE_CA", "FILE", "PEM CA to verify a TLS gateway with (turns TLS on)"),
        ("--cert", "TRAINWIRE_CERT", "FILE", "PEM client certificate (mutual TLS; with --key)"),
        ("--key", "TRAINWIRE_KEY", "FILE", "PEM private key of --cert"),
        (
            "--token",
            "TRAINWIRE_TOKEN",
            "TOKEN",
            "bearer token for a gateway with --auth-tokens (prefer the variable: arguments "
            "show in ps)",
        ),
    ):
        group.add_argument(
            flag,
            metavar=meta,
            default=default(os.environ.get(env) or None),
            help=f"{text} (default: ${env})",
        )
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="log what the client does to stderr; on an error, its gRPC code, details and "
        "google.rpc details",
    )
    return parser


def _run_options(parser: argparse.ArgumentParser, default_episodes: int) -> None:
    group = parser.add_argument_group("run options")
    group.add_argument(
        "--episodes",
        type=_integer,
        default=default_episodes,
        metavar="N",
        help="episodes (optimizer steps for grpo) to train, 1..5000 (default: %(default)s)",
    )
    group.add_argument(
        "--rate",
        type=_number,
        default=0.0,
        metavar="R",
        help="episodes published per second; 0: the gateway's --episode-rate; negative: "
        "unpaced (default: 0)",
    )
    group.add_argument(
        "--speed",
        type=_number,
        default=0.0,
        metavar="S",
        help="playback speed, 0.1..20 (default: 0, i.e. 1)",
    )
    group.add_argument(
        "--seed", type=_integer, default=0, metavar="N", help="random seed (default: 0)"
    )
    group.add_argument("--name", default="", help="a display name for people (default: none)")
    group.add_argument(
        "--request-id",
        default="",
        metavar="ID",
        help="idempotency key: repeating a create with it returns the same run (default: none)",
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", help="print only the new run's id (scripts)"
    )
    group.add_argument(
        "--watch", action="store_true", help="watch the new run live right after creating it"
    )


def build_parser() -> argparse.ArgumentParser:
    """The full ``trainwire`` argument parser."""
    common = _common_options(suppress=True)
    parser = argparse.ArgumentParser(
        prog="trainwire",
        description="Create, control and watch Trainwire training runs.",
        parents=[_common_options(suppress=False)],
        epilog="exit codes: 0 ok; 1 error (or the watched run failed); 2 bad usage; "
        "3 the watched run was stopped; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"trainwire {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    runs = commands.add_parser("runs", parents=[common], help="create, list, show and delete runs")
    runs_commands = runs.add_subparsers(dest="runs_command", metavar="SUBCOMMAND", required=True)

    create = runs_commands.add_parser("create", parents=[common], help="create a run")
    kinds = create.add_subparsers(dest="kind", metavar="KIND", required=True)
    imitation = kinds.add_parser(
        "imitation",
        parents=[common],
        help="an avatar learns to imitate a motion clip",
        description="Create an imitation run: an avatar rig learns to imitate a motion clip.",
    )
    imitation.add_argument(
        "--clip", required=True, help=f"built-in clip to imitate: {', '.join(BUILTIN_CLIPS)}"
    )
    imitation.add_argument(
        "--rig", default="stickman", help=f"built-in rig: {', '.join(BUILTIN_RIG_BONES)}"
    )
    imitation.add_argument(
        "--group-size", type=_integer, default=0, metavar="N", help="motions per episode, 2..1024"
    )
    imitation.add_argument(
        "--learning-rate", type=_number, default=0.0, metavar="LR", help="Adam learning rate"
    )
    imitation.add_argument("--avatar", default="", help="free-form avatar id")
    _run_options(imitation, 200)
    imitation.set_defaults(handler=_cmd_create_imitation)

    grpo = kinds.add_parser(
        "grpo",
        parents=[common],
        help="fine-tune a vision-language model with GRPO",
        description="Create a GRPO run on a local model and a prepared JSONL dataset "
        "(paths relative to the trainer's --data-root).",
    )
    grpo.add_argument("--model", required=True, metavar="DIR", help="model directory")
    grpo.add_argument("--dataset", required=True, metavar="FILE", help="JSONL dataset file")
    grpo.add_argument(
        "--reward",
        default="",
        metavar="NAMES",
        help=f"comma-separated reward functions ({', '.join(REWARD_FUNCTIONS)}); "
        "default: exact_match,format",
    )
    trainers = "0: the trainer's default (see GrpoTask in episode.proto)"
    for flag, kind, meta, text in (
        ("--num-generations", _integer, "N", "completions sampled per prompt, 2..64"),
        (
            "--batch-size",
            _integer,
            "N",
            "per-device batch size in completions, 1..1024, a multiple of --num-generations",
        ),
        ("--max-completion-length", _integer, "TOKENS", "longest completion, 1..4096 tokens"),
        ("--learning-rate", _number, "LR", "learning rate, in (0, 1]"),
        ("--temperature", _number, "T", "sampling temperature, in (0, 10]"),
        ("--grad-accum", _integer, "STEPS", "gradient accumulation steps, 1..1024"),
    ):
        grpo.add_argument(
            flag, type=kind, default=0, metavar=meta, help=f"{text} (default: {trainers})"
        )
    grpo.add_argument(
        "--beta",
        type=_number,
        default=None,
        metavar="B",
        help="KL coefficient, >= 0 (default: unset, i.e. 0: no reference model)",
    )
    grpo.add_argument(
        "--workers",
        type=_integer,
        default=None,
        metavar="N",
        help="image-decoding dataloader worker processes, 0..32 (default: unset, the "
        "trainer's default)",
    )
    grpo.add_argument(
        "--prefetch",
        type=_integer,
        default=None,
        metavar="N",
        help="batches each worker prefetches, 1..64 (default: unset, the trainer's default)",
    )
    _run_options(grpo, 20)
    grpo.set_defaults(handler=_cmd_create_grpo)

    listing = runs_commands.add_parser("list", parents=[common], help="list runs, newest first")
    listing.add_argument(
        "--state", type=_state, default=0, help="only runs in this state (e.g. running, done)"
    )
    listing.add_argument(
        "--limit", type=_non_negative_int, default=0, metavar="N", help="at most N runs"
    )
    listing.set_defaults(handler=_cmd_list)

    get = runs_commands.add_parser("get", parents=[common], help="show one run")
    get.add_argument("run_id", metavar="ID")
    get.set_defaults(handler=_cmd_get)

    delete = runs_commands.add_parser("delete", parents=[common], help="delete a finished run")
    delete.add_argument("run_id", metavar="ID")
    delete.set_defaults(handler=_cmd_delete)

    for name, help_text in (
        ("pause", "pause a running run"),
        ("resume", "resume a paused run"),
        ("stop", "stop a run (its history is kept)"),
    ):
        control = commands.add_parser(name, parents=[common], help=help_text)
        control.add_argument("run_id", metavar="ID")
        control.set_defaults(handler=_cmd_control, action=name)

    speed = commands.add_parser("speed", parents=[common], help="set a run's playback speed")
    speed.add_argument("run_id", metavar="ID")
    speed.add_argument("speed", type=_number, metavar="X", help="speed multiplier, 0.1..20")
    speed.set_defaults(handler=_cmd_speed)

    watch = commands.add_parser(
        "watch",
        parents=[common],
        help="follow a run live until it ends",
        description="Follow a run live: progress, rate and ETA, state, rewards, a learning "
        "curve. Resumes by itself after a dropped connection. Ctrl+C detaches and leaves "
        "the run running. Exits 0 when the run is DONE, 1 on ERROR, 3 when STOPPED.",
    )
    watch.add_argument("run_id", metavar="ID")
    watch.add_argument(
        "--after",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="start after episode N (default: replay from the first)",
    )
    watch.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="reconnect when nothing (not even a keepalive) arrives for this long",
    )
    watch.set_defaults(handler=_cmd_watch)

    plot = commands.add_parser("plot", parents=[common], help="draw a run's learning curve")
    plot.add_argument("run_id", metavar="ID")
    plot.add_argument("--out", required=True, metavar="FILE.png", help="where to write the PNG")
    plot.add_argument(
        "--window", type=_integer, default=None, metavar="N", help="episodes in the rolling mean"
    )
    plot.set_defaults(handler=_cmd_plot)

    avatar = commands.add_parser(
        "avatar", parents=[common], help="draw an imitation run's learned motion"
    )
    avatar.add_argument("run_id", metavar="ID")
    avatar.add_argument("--out", required=True, metavar="FILE", help="where to write the picture")
    avatar.add_argument(
        "--gif", action="store_true", help="an animation (GIF) instead of a strip of poses"
    )
    avatar.add_argument("--poses", type=_integer, default=8, metavar="N", help="poses in the strip")
    avatar.set_defaults(handler=_cmd_avatar)
    return parser


# -- commands ------------------------------------------------------------------------------------


def _created(client: GatewayClient, args: argparse.Namespace, out: _Output, run: Run) -> int:
    if args.quiet and not out.json:
        print(run.id, flush=True)
    else:
        out.result(f"created {_format.run_line(run)}", _format.run_json(run))
    if args.watch:
        args.run_id, args.after, args.idle_timeout = run.id, 0, 30.0
        return _cmd_watch(client, args, out)
    return EXIT_OK


def _create(
    client: GatewayClient, args: argparse.Namespace, out: _Output, task: episode_pb2.TrainTask
) -> int:
    run = client.create_run(
        task,
        train_config(args.episodes, args.seed),
        speed=args.speed,
        episodes_per_second=args.rate,
        request_id=args.request_id,
        display_name=args.name,
    )
    return _created(client, args, out, run)


def _cmd_create_imitation(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    task = imitation_task(
        clip=args.clip,
        rig=args.rig,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        avatar_id=args.avatar,
    )
    return _create(client, args, out, task)


def _cmd_create_grpo(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    task = grpo_task(
        model=args.model,
        dataset=args.dataset,
        reward_functions=[r.strip() for r in args.reward.split(",") if r.strip()],
        num_generations=args.num_generations,
        batch_size=args.batch_size,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        beta=args.beta,
        temperature=args.temperature,
        gradient_accumulation_steps=args.grad_accum,
        dataloader_num_workers=args.workers,
        dataloader_prefetch_factor=args.prefetch,
    )
    return _create(client, args, out, task)


def _cmd_list(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    runs = client.list_runs(state=args.state, limit=args.limit or None)
    if out.json:
        out.result("", _format.to_dict(gateway_service_pb2.ListRunsResponse(runs=runs)))
    elif runs:
        out.result(_format.runs_table(runs), None)
    else:
        which = f" in state {state_name(args.state)}" if args.state else ""
        out.info(f"no runs{which}")
    return EXIT_OK


def _cmd_get(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    run = client.get_run(args.run_id)
    out.result(_format.run_details(run), _format.run_json(run))
    return EXIT_OK


def _cmd_delete(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    run = client.delete_run(args.run_id)
    out.result(f"deleted run {run.id}", _format.run_json(run))
    return EXIT_OK


_CONTROL_VERBS = {"pause": "paused", "resume": "resumed", "stop": "stopped"}


def _cmd_control(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    method = {"pause": client.pause_run, "resume": client.resume_run, "stop": client.stop_run}
    run = method[args.action](args.run_id)
    out.result(f"{_CONTROL_VERBS[args.action]}: {_format.run_line(run)}", _format.run_json(run))
    return EXIT_OK


def _cmd_speed(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    run = client.set_run_speed(args.run_id, args.speed)
    out.result(f"speed set: {_format.run_line(run)}", _format.run_json(run))
    return EXIT_OK


def _watch_exit(run: Run) -> int:
    if run.state == Run.State.STATE_DONE:
        return EXIT_OK
    if run.state == Run.State.STATE_STOPPED:
        return EXIT_STOPPED
    return EXIT_ERROR


def _event_json(event: WatchEvent | Reconnect) -> dict[str, Any]:
    """A watch event as the ``WatchRunResponse`` that carries it, in the protobuf JSON mapping
    (batches come as one ``episode`` each); a reconnection, which no message carries, as
    ``{"reconnect": {...}}`` in the same style."""
    if isinstance(event, Reconnect):
        reconnect: dict[str, Any] = {
            "attempt": event.attempt,
            "delay": round(event.delay, 3),
            "reason": event.reason,
            "afterEpisode": str(event.after_episode),  # int64: a string, as in the mapping
        }
        if event.code is not None:
            reconnect["code"] = event.code.name
        return {"reconnect": reconnect}
    response = gateway_service_pb2.WatchRunResponse()
    if isinstance(event, episode_pb2.Episode):
        response.episode.CopyFrom(event)
    elif isinstance(event, gateway_service_pb2.Keepalive):
        response.keepalive.CopyFrom(event)
    elif isinstance(event, gateway_service_pb2.CaughtUp):
        response.caught_up.CopyFrom(event)
    else:
        response.finished.CopyFrom(event)
    return _format.to_dict(response)


@contextlib.contextmanager
def _detach_on_ctrl_c(stream: WatchStream) -> Iterator[threading.Event]:
    """Turns Ctrl+C into ``stream.cancel()``; the yielded event says whether it happened.

    A KeyboardInterrupt raised inside grpc's blocking iteration can leave the call half torn
    down, and closing the channel then hangs; cancelling the call from another thread is the
    supported way out. Only the main thread can install signal handlers; elsewhere (tests
    calling ``main`` from a worker thread) Ctrl+C keeps its default behaviour.
    """
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit
        return

    def on_sigint(signum: int, frame: object) -> None:
        hit.set()
        # Not stream.cancel() here: the handler may have interrupted a lock cancel() takes.
        threading.Thread(target=stream.cancel, name="trainwire-detach", daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def _detached(run_id: str, episode: int) -> int:
    print(
        f"detached from run {run_id} after episode {episode}; it keeps running "
        f"(trainwire watch {run_id} --after {episode} to follow it again)",
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED


def _cmd_watch(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    client.idle_timeout = args.idle_timeout
    if out.json:
        return _watch_json(client, args)
    try:
        from rich.console import Console
        from rich.live import Live

        from trainwire.cli._watch import WatchView
    except ImportError as exc:
        raise CliError(
            "the live view needs rich: pip install 'trainwire[cli]' (or use --json)"
        ) from exc
    run = client.get_run(args.run_id)
    view = WatchView(run, args.after)
    console = Console()
    stream = client.watch(args.run_id, args.after, on_reconnect=view.on_reconnect)
    with (
        _detach_on_ctrl_c(stream) as interrupted,
        Live(console=console, get_renderable=view.render, refresh_per_second=8),
    ):
        for event in stream:
            view.on_event(event)
    if not console.is_terminal:  # rich ends a file's final frame without a newline
        console.line()
    if interrupted.is_set() or view.finished is None:
        return _detached(args.run_id, stream.last_episode)
    return _report_end(view.finished)


def _report_end(run: Run) -> int:
    code = _watch_exit(run)
    if run.state == Run.State.STATE_ERROR:
        print(
            f"error: run {run.id} failed: {_format.clean(run.error_message) or 'no reason given'}",
            file=sys.stderr,
        )
    else:
        print(f"run {run.id} {state_name(run.state)} after episode {run.episode}", file=sys.stderr)
    return code


def _watch_json(client: GatewayClient, args: argparse.Namespace) -> int:
    def emit(event: WatchEvent | Reconnect) -> None:
        print(_format.dumps(_event_json(event)), flush=True)

    stream = client.watch(args.run_id, args.after, on_reconnect=emit)
    finished: Run | None = None
    with _detach_on_ctrl_c(stream) as interrupted:
        for event in stream:
            emit(event)
            if isinstance(event, Run):
                finished = event
    if interrupted.is_set() or finished is None:
        return _detached(args.run_id, stream.last_episode)
    if finished.state == Run.State.STATE_ERROR:
        print(
            f"error: run {finished.id} failed: {_format.clean(finished.error_message)}",
            file=sys.stderr,
        )
    return _watch_exit(finished)


def history(client: GatewayClient, run_id: str) -> Iterator[episode_pb2.Episode]:
    """The run's episodes published so far (the replay up to ``caught_up``, or to the end)."""
    stream = client.watch(run_id)
    with _detach_on_ctrl_c(stream) as interrupted:
        try:
            for event in stream:
                if isinstance(event, episode_pb2.Episode):
                    yield event
                elif isinstance(event, gateway_service_pb2.CaughtUp | Run):
                    return
        finally:
            stream.close()
    if interrupted.is_set():
        raise KeyboardInterrupt


def _cmd_plot(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
    from trainwire import render

    run = client.get_run(args.run_id)
    episodes = list(history(client, args.run_id))
    if not episodes:
        raise CliError(f"run {args.run_id} has no episodes yet; nothing to plot")
    title = f"run {run.id} - {_format.task_summary(run)}"
    try:
        render.plot_curve(episodes, args.out, title=title, window=args.window)
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from exc
    out.result(
        f"wrote {args.out} ({len(episodes)} episodes of run {run.id})",
        {"runId": run.id, "out": args.out, "episodes": len(episodes)},
    )
    return EXIT_OK


def _cmd_avatar(client: GatewayClient, args: argparse.Namespace, out: _Output) -> int:
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


# -- entry point -------------------------------------------------------------------------------


def _read_pem(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise CliError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None


def _client(args: argparse.Namespace) -> GatewayClient:
    """The client of the connection options (TLS with --ca/--cert/--key, a --token)."""
    if (args.cert is None) != (args.key is None):
        raise CliError("--cert and --key go together (TRAINWIRE_CERT, TRAINWIRE_KEY)")
    try:
        return GatewayClient(
            args.gateway,
            timeout=args.timeout,
            root_certificates=_read_pem(args.ca, "--ca"),
            certificate_chain=_read_pem(args.cert, "--cert"),
            private_key=_read_pem(args.key, "--key"),
            token=args.token,
        )
    except ValueError as exc:  # a token of several lines, ...
        raise CliError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``trainwire`` command line; returns the exit code.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    out = _Output(args.json)
    try:
        with _client(args) as client:
            code: int = args.handler(client, args, out)
            return code
    except TrainwireError as exc:
        _LOGGER.debug("call failed", exc_info=True)
        if args.json:
            print(_format.error_json(exc), file=sys.stderr)
        else:
            for line in _format.error_lines(exc, args.gateway, args.timeout):
                print(line, file=sys.stderr)
        if args.verbose:
            for line in _format.error_detail_lines(exc):
                print(line, file=sys.stderr)
        return EXIT_ERROR
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as exc:  # a missing extra (rich, Pillow): say how to install it
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `trainwire watch --json ID | head`: the reader left
        return EXIT_OK
