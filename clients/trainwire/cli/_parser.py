"""The ``trainwire`` command line's arguments: one parser, subcommands with their handlers.

Converters raise ``ArgumentTypeError`` so a bad value reads ``argument --rate: 'x' is not a
number``, never an internal function's name.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from trainwire import __version__
from trainwire.cli._commands import (
    cmd_avatar,
    cmd_checkpoints,
    cmd_control,
    cmd_create_grpo,
    cmd_create_imitation,
    cmd_delete,
    cmd_download,
    cmd_get,
    cmd_list,
    cmd_plot,
    cmd_speed,
)
from trainwire.cli._experiments import (
    cmd_compare,
    cmd_fork,
    cmd_label,
    cmd_rename,
    cmd_set,
)
from trainwire.cli._follow import cmd_watch
from trainwire.cli._output import DEFAULT_GATEWAY, DEFAULT_TIMEOUT
from trainwire.client import parse_state
from trainwire.contract import BUILTIN_CLIPS, BUILTIN_RIG_BONES, MAX_EPISODES, REWARD_FUNCTIONS

# argparse names a converter that raises ValueError in its message ("invalid _positive_float
# value"); these raise ArgumentTypeError, whose text is shown as it is.


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _rewards(text: str) -> list[tuple[str, float | None]]:
    """``--reward NAME[=WEIGHT],...``: each reward's name and weight (None: not given)."""
    rewards: list[tuple[str, float | None]] = []
    for part in text.split(","):
        name, equals, weight = part.partition("=")
        name = name.strip()
        if not name:
            if equals or part.strip():
                raise argparse.ArgumentTypeError(f"{part.strip()!r} names no reward function")
            continue
        value = None
        if equals:
            value = _number(weight.strip())
            if not math.isfinite(value):
                raise argparse.ArgumentTypeError(f"the weight of {name} is {weight.strip()}")
        rewards.append((name, value))
    return rewards


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


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return value


def _names(text: str) -> list[str]:
    """``a, b,,c`` as ``["a", "b", "c"]``."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _label(text: str) -> tuple[str, str]:
    """``key=value`` (the value may be empty) as ``(key, value)``."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _label_change(text: str) -> tuple[str, str | None]:
    """``key=value`` sets a label; ``key-`` removes it (``(key, None)``). A label key never
    ends with ``-``, so the two cannot be confused."""
    if "=" not in text and text.endswith("-") and len(text) > 1:
        return text[:-1], None
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is neither KEY=VALUE (set) nor KEY- (remove)")
    return _label(text)


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
            "--server-name",
            "TRAINWIRE_SERVER_NAME",
            "NAME",
            "check the gateway's TLS certificate against this name instead of the host in "
            "--gateway (a gateway dialled by IP address or through a tunnel)",
        ),
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
        help=f"episodes (optimizer steps for grpo) to train, 1..{MAX_EPISODES} "
        "(default: %(default)s)",
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
    group.add_argument(
        "--checkpoint-every",
        type=_integer,
        default=0,
        metavar="N",
        help="write a checkpoint every N episodes, and always at the end (default: 0, the "
        "provider's: imitation 500, grpo 50)",
    )
    group.add_argument(
        "--keep-checkpoints",
        type=_integer,
        default=0,
        metavar="K",
        help="keep the latest K checkpoints, 1..100 (default: 0, i.e. 3)",
    )
    group.add_argument("--name", default="", help="a display name for people (default: none)")
    group.add_argument(
        "--label",
        dest="labels",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label for people and searches, repeatable (Kubernetes label rules: a key is "
        "an optional DNS-subdomain prefix and '/' and a name of at most 63 of A-Z a-z 0-9 _ . "
        "-, starting and ending with a letter or digit; a value the same, or empty) "
        "(default: none)",
    )
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
        "--learning-rate",
        "--lr",
        type=_number,
        default=0.0,
        metavar="LR",
        help="Adam learning rate (default: 0, the provider's)",
    )
    imitation.add_argument("--avatar", default="", help="free-form avatar id")
    _run_options(imitation, 200)
    imitation.set_defaults(handler=cmd_create_imitation)

    grpo = kinds.add_parser(
        "grpo",
        parents=[common],
        help="fine-tune a vision-language model with GRPO",
        description="Create a GRPO run on a local model and a prepared JSONL dataset "
        "(paths relative to the trainer's first --data-root, or absolute paths inside any "
        "of its --data-root directories).",
    )
    grpo.add_argument("--model", required=True, metavar="DIR", help="model directory")
    grpo.add_argument(
        "--dataset",
        required=True,
        metavar="PATH",
        help="the dataset: a .jsonl or .parquet file, or a directory written by datasets' "
        "save_to_disk",
    )
    grpo.add_argument(
        "--reward",
        type=_rewards,
        default=[],
        metavar="NAME[=WEIGHT],...",
        help=f"comma-separated reward functions: built-in ({', '.join(REWARD_FUNCTIONS)}) or "
        "MODULE:FUNCTION of a trainer's --reward-module, each with an optional weight (a "
        "missing one is 1); default: exact_match,format",
    )
    for role, default in (
        ("prompt", "prompt"),
        ("images", "images, else image, else image_paths"),
        ("solution", "solution"),
    ):
        grpo.add_argument(
            f"--{role}-column",
            default="",
            metavar="NAME",
            help=f"the dataset's {role} column (default: {default})",
        )
    trainers = (
        "0: the trainer's default, which the gateway's GET /v1/trainers and the web page's "
        "Trainers card list"
    )
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
        (
            "--processes",
            _integer,
            "N",
            "processes the job trains on, 1..64, one trainer slot (one GPU on a GPU trainer) "
            "each; --batch-size is per process",
        ),
    ):
        # --lr as fork and set spell it, for a sweep's create, fork and set to read alike.
        aliases = ("--lr",) if flag == "--learning-rate" else ()
        grpo.add_argument(
            flag,
            *aliases,
            type=kind,
            default=0,
            metavar=meta,
            help=f"{text} (default: {trainers})",
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
    grpo.add_argument(
        "--lora",
        action="store_true",
        help="train LoRA adapters instead of every weight (implied by any --lora-* flag); "
        "the download is then the adapter in peft's format, or the merged model with "
        "`runs download --merged` (default: off, full fine-tuning)",
    )
    grpo.add_argument(
        "--lora-rank",
        type=_integer,
        default=0,
        metavar="R",
        help="rank of the adapters, 1..256 (default: 16)",
    )
    grpo.add_argument(
        "--lora-alpha",
        type=_number,
        default=0.0,
        metavar="A",
        help="LoRA scaling alpha, > 0 (default: 2 x rank)",
    )
    grpo.add_argument(
        "--lora-dropout",
        type=_number,
        default=0.0,
        metavar="P",
        help="dropout on the adapters' input, in [0, 1) (default: none)",
    )
    grpo.add_argument(
        "--lora-targets",
        default="",
        metavar="NAME,...",
        help="comma-separated module names to adapt, as peft matches them, e.g. "
        "q_proj,v_proj (default: every linear layer of the language model)",
    )
    grpo.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass: less memory, more compute (default: off)",
    )
    _run_options(grpo, 20)
    grpo.set_defaults(handler=cmd_create_grpo)

    listing = runs_commands.add_parser("list", parents=[common], help="list runs, newest first")
    listing.add_argument(
        "--state", type=_state, default=0, help="only runs in this state (e.g. running, done)"
    )
    listing.add_argument(
        "--filter",
        default="",
        metavar="EXPR",
        help="only runs this AIP-160 filter finds, e.g. 'state = STATE_DONE AND best_reward "
        "> 0.8 AND labels.team = vision' (the fields: README, Searching runs)",
    )
    listing.add_argument(
        "--order-by",
        default="",
        metavar="KEYS",
        help='sort by these fields (AIP-132), e.g. "best_reward desc, create_time" '
        "(default: newest first)",
    )
    listing.add_argument(
        "--limit", type=_non_negative_int, default=0, metavar="N", help="at most N runs"
    )
    listing.set_defaults(handler=cmd_list)

    get = runs_commands.add_parser("get", parents=[common], help="show one run")
    get.add_argument("run_id", metavar="ID")
    get.set_defaults(handler=cmd_get)

    delete = runs_commands.add_parser("delete", parents=[common], help="delete a finished run")
    delete.add_argument("run_id", metavar="ID")
    delete.set_defaults(handler=cmd_delete)

    checkpoints = runs_commands.add_parser(
        "checkpoints", parents=[common], help="list a run's checkpoints, oldest first"
    )
    checkpoints.add_argument("run_id", metavar="ID")
    checkpoints.set_defaults(handler=cmd_checkpoints)

    download = runs_commands.add_parser(
        "download",
        parents=[common],
        help="download a checkpoint (the trained model and its training state), check its "
        "SHA-256 and extract it",
    )
    download.add_argument("run_id", metavar="ID")
    download.add_argument(
        "--episode",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="the checkpoint's episode (default: 0, the latest)",
    )
    download.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="a directory that does not exist yet (or is empty) to extract it into",
    )
    download.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run's adapter merged into its base model by a trainer: model/ then loads "
        "with transformers alone (without it, model/ is the adapter, for peft)",
    )
    download.set_defaults(handler=cmd_download)

    label = runs_commands.add_parser(
        "label",
        parents=[common],
        help="set or remove a run's labels",
        description="Set (KEY=VALUE) or remove (KEY-) labels of a run, active or finished; "
        "the other labels stay. Prints the run.",
    )
    label.add_argument("run_id", metavar="ID")
    label.add_argument(
        "changes",
        nargs="+",
        type=_label_change,
        metavar="KEY=VALUE|KEY-",
        help="a label to set, or KEY- to remove one",
    )
    label.set_defaults(handler=cmd_label)

    rename = runs_commands.add_parser(
        "rename", parents=[common], help="change a run's display name"
    )
    rename.add_argument("run_id", metavar="ID")
    rename.add_argument("name", metavar="NAME", help="the new display name ('' removes it)")
    rename.set_defaults(handler=cmd_rename)

    fork = runs_commands.add_parser(
        "fork",
        parents=[common],
        help="start a new run from a checkpoint of another",
        description="Create a run that starts from a checkpoint of RUN (its weights and "
        "training state) with RUN's task, config and labels and the changes given. Its "
        "episodes are numbered from the checkpoint's episode + 1, so its curve continues "
        "RUN's. The task kind and model stay RUN's; the gateway refuses a fork it cannot make "
        "(no such checkpoint, another task) and says why.",
    )
    fork.add_argument("run_id", metavar="RUN")
    fork.add_argument(
        "--episode",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="the checkpoint's episode (default: 0, RUN's latest; see runs checkpoints)",
    )
    changes = fork.add_argument_group("changes (default: RUN's)")
    changes.add_argument(
        "--lr",
        "--learning-rate",
        dest="learning_rate",
        type=_number,
        metavar="X",
        help="learning rate",
    )
    changes.add_argument(
        "--temperature", type=_number, metavar="T", help="sampling temperature (grpo)"
    )
    changes.add_argument("--beta", type=_number, metavar="B", help="KL coefficient (grpo)")
    changes.add_argument(
        "--num-generations", type=_integer, metavar="N", help="completions per prompt (grpo)"
    )
    changes.add_argument(
        "--group-size", type=_integer, metavar="N", help="motions per episode (imitation)"
    )
    changes.add_argument(
        "--episodes", type=_positive_int, metavar="N", help="the fork's max_episodes"
    )
    changes.add_argument("--seed", type=_integer, metavar="N", help="random seed")
    changes.add_argument(
        "--rate",
        type=_number,
        metavar="R",
        help="episodes published per second (negative: unpaced)",
    )
    changes.add_argument(
        "--label",
        dest="labels",
        type=_label_change,
        action="append",
        default=[],
        metavar="KEY=VALUE|KEY-",
        help="set (KEY=VALUE) or remove (KEY-) one of the labels RUN's fork starts with; "
        "repeatable",
    )
    fork.add_argument(
        "--speed",
        type=_number,
        default=0.0,
        metavar="S",
        help="playback speed, 0.1..20 (default: 0, i.e. 1)",
    )
    fork.add_argument("--name", default="", help="a display name for people (default: none)")
    fork.add_argument(
        "--request-id",
        default="",
        metavar="ID",
        help="idempotency key: repeating a fork with it returns the same run (default: none)",
    )
    fork.add_argument(
        "-q", "--quiet", action="store_true", help="print only the new run's id (scripts)"
    )
    fork.add_argument(
        "--watch", action="store_true", help="watch the new run live right after creating it"
    )
    fork.set_defaults(handler=cmd_fork)

    for name, help_text in (
        ("pause", "pause a running run"),
        ("resume", "resume a paused run"),
        ("stop", "stop a run (its history is kept)"),
    ):
        control = commands.add_parser(name, parents=[common], help=help_text)
        control.add_argument("run_id", metavar="ID")
        control.set_defaults(handler=cmd_control, action=name)

    speed = commands.add_parser("speed", parents=[common], help="set a run's playback speed")
    speed.add_argument("run_id", metavar="ID")
    speed.add_argument("speed", type=_number, metavar="X", help="speed multiplier, 0.1..20")
    speed.set_defaults(handler=cmd_speed)

    live = commands.add_parser(
        "set",
        parents=[common],
        help="change a running run's hyperparameters",
        description="Change the hyperparameters of a RUNNING or PAUSED run from its next "
        "optimizer step. Its episodes from then on carry the values in effect as metrics "
        "(learning_rate, temperature, beta: see plot --metrics), so the history shows each "
        "change where it happened.",
    )
    live.add_argument("run_id", metavar="ID")
    live.add_argument(
        "--lr",
        "--learning-rate",
        dest="learning_rate",
        type=_number,
        metavar="X",
        help="learning rate, in (0, 1]",
    )
    live.add_argument(
        "--temperature", type=_number, metavar="T", help="sampling temperature (grpo), in (0, 10]"
    )
    live.add_argument(
        "--beta",
        type=_number,
        metavar="B",
        help="KL coefficient (grpo), in [0, 10]; above 0 only for a run started with beta > 0",
    )
    live.set_defaults(handler=cmd_set)

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
    watch.add_argument(
        "--scalars",
        action="store_true",
        help="with --json: episodes without their detail (motions, completions), numbers "
        "only; the live view never shows detail, so it always streams them so",
    )
    watch.set_defaults(handler=cmd_watch)

    plot = commands.add_parser(
        "plot",
        parents=[common],
        help="draw the learning curve of a run, or of several on one chart",
        description="Draw a run's learning curve to a PNG: the reward's range (min..max), its "
        "rolling mean and the best reward, from the curve the gateway summarises in one bucket "
        "per pixel column (GetRunCurve), so a run of millions of episodes draws as fast as a "
        "short one. Given several runs, overlays them, one colour each: each run's range as a "
        "translucent band under its rolling mean, a legend of their names, a line per run in "
        "each --metrics panel; a fork's curve continues its parent's.",
    )
    plot.add_argument("run_ids", nargs="+", metavar="ID")
    plot.add_argument("--out", required=True, metavar="FILE.png", help="where to write the PNG")
    plot.add_argument(
        "--window",
        type=_positive_int,
        default=None,
        metavar="N",
        help="episodes in the rolling mean of the reward (default: a twentieth of the run, "
        "3..50); on a run longer than the plot is wide each point is already the mean of its "
        "pixel column's episodes, and a window below that changes nothing",
    )
    plot.add_argument(
        "--metrics",
        type=_names,
        default=[],
        metavar="A,B",
        help="metrics of the run's episodes (e.g. loss) to draw under the reward, their mean "
        "per bucket, one panel each (default: none)",
    )
    plot.set_defaults(handler=cmd_plot)

    compare = commands.add_parser(
        "compare",
        parents=[common],
        help="compare runs: the config fields that differ, final and best rewards",
        description="Compare runs: each run's state, last episode, final and best reward, then "
        "the config fields (task, config, labels, fork lineage) whose values differ between "
        "them, a column per run ('-': not set in that run).",
    )
    compare.add_argument("run_ids", nargs="+", metavar="ID", help="two or more runs")
    compare.add_argument(
        "--all", action="store_true", help="every config field, not only those that differ"
    )
    compare.set_defaults(handler=cmd_compare)

    avatar = commands.add_parser(
        "avatar", parents=[common], help="draw an imitation run's learned motion"
    )
    avatar.add_argument("run_id", metavar="ID")
    avatar.add_argument("--out", required=True, metavar="FILE", help="where to write the picture")
    avatar.add_argument(
        "--gif", action="store_true", help="an animation (GIF) instead of a strip of poses"
    )
    avatar.add_argument("--poses", type=_integer, default=8, metavar="N", help="poses in the strip")
    avatar.set_defaults(handler=cmd_avatar)
    return parser
