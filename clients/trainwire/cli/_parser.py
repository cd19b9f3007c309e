"""The ``trainwire`` command line's arguments: one parser, subcommands with their handlers.

Every command has a summary (its line in its parent's help), a description and one to three
examples (``trainwire.cli._help``); the global flags are the root's, accepted before or after a
command and named once in each command's help. The run argument is ``RUN`` everywhere, the
learning rate ``--learning-rate``/``--lr``; a flag left out states its default as the value a
run then gets (``trainwire.cli._defaults``), never as the 0 the request carries.

Converters raise ``ArgumentTypeError`` so a bad value reads ``argument --rate: 'x' is not a
number``, never an internal function's name.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
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
from trainwire.cli._completion import SHELLS, cmd_completion
from trainwire.cli._defaults import (
    DEFAULT_EPISODE_RATE,
    DEFAULT_GRPO_CHECKPOINT_EVERY,
    DEFAULT_GRPO_LEARNING_RATE,
    DEFAULT_GRPO_LORA_BETA,
    DEFAULT_GRPO_LORA_LEARNING_RATE,
    DEFAULT_GRPO_LORA_RANK,
    DEFAULT_GRPO_MAX_COMPLETION_LENGTH,
    DEFAULT_GRPO_PROMPTS_PER_STEP,
    DEFAULT_GRPO_TEMPERATURE,
    DEFAULT_GRPO_WORKERS,
    DEFAULT_IMITATION_CHECKPOINT_EVERY,
    DEFAULT_IMITATION_GROUP_SIZE,
    DEFAULT_IMITATION_LEARNING_RATE,
    DEFAULT_KEEP_CHECKPOINTS,
    SEARCH_FIELDS,
)
from trainwire.cli._experiments import (
    cmd_compare,
    cmd_fork,
    cmd_label,
    cmd_rename,
    cmd_set,
)
from trainwire.cli._follow import cmd_watch
from trainwire.cli._help import CommandParser
from trainwire.cli._output import DEFAULT_GATEWAY, DEFAULT_TIMEOUT
from trainwire.client import parse_state
from trainwire.contract import (
    BUILTIN_CLIPS,
    BUILTIN_RIG_BONES,
    DEFAULT_GRPO_GENERATIONS,
    DEFAULT_RIG,
    MAX_EPISODES,
    MAX_KEEP_CHECKPOINTS,
    REWARD_FUNCTIONS,
)

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


#: The connection and output flags: every command accepts them, before or after its name.
GLOBAL_GROUP = "Global flags (before or after the command)"


def _common_options(suppress: bool) -> argparse.ArgumentParser:
    """The connection and output flags, accepted before or after the command.

    The root parser shows them with their help (``suppress=False``). A subcommand gets them with
    their help suppressed (its help names them once, under "Inherited flags") and their defaults
    suppressed too, so a value given before the command survives.
    """
    parser = argparse.ArgumentParser(add_help=False)
    default: Callable[[Any], Any] = (lambda _: argparse.SUPPRESS) if suppress else (lambda v: v)

    def shown(text: str) -> str:
        return argparse.SUPPRESS if suppress else text

    group = parser.add_argument_group(GLOBAL_GROUP)
    group.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        default=default(os.environ.get("TRAINWIRE_GATEWAY") or DEFAULT_GATEWAY),
        help=shown(f"gateway address (default: $TRAINWIRE_GATEWAY, else {DEFAULT_GATEWAY})"),
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help=shown(
            "machine-readable output: the protobuf JSON mapping of the RPC's response, as "
            "grpcurl and the HTTP API print it (watch: one WatchRunResponse per line)"
        ),
    )
    group.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=default(DEFAULT_TIMEOUT),
        help=shown(f"deadline of each call to the gateway (default: {DEFAULT_TIMEOUT:g})"),
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
            help=shown(f"{text} (default: ${env})"),
        )
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help=shown(
            "log what the client does to stderr; on an error, its gRPC code, details and "
            "google.rpc details"
        ),
    )
    return parser


class _Tree:
    """Adds commands with the shared global flags, a summary, a description and examples."""

    def __init__(self) -> None:
        self.common = _common_options(suppress=True)

    def add(
        self,
        commands: Any,
        name: str,
        summary: str,
        description: str,
        examples: Sequence[tuple[str, str]],
    ) -> CommandParser:
        parser: CommandParser = commands.add_parser(
            name,
            parents=[self.common],
            help=summary,
            description=description,
            examples=examples,
        )
        return parser


def _run_argument(parser: argparse.ArgumentParser, text: str = "the run's id") -> None:
    parser.add_argument("run_id", metavar="RUN", help=text)


def _learning_rate(group: Any, text: str, **kwargs: Any) -> None:
    """``--learning-rate``/``--lr``, spelled and ordered alike on every command."""
    group.add_argument(
        "--learning-rate",
        "--lr",
        dest="learning_rate",
        type=_number,
        metavar="LR",
        help=text,
        **kwargs,
    )


def _run_options(
    parser: argparse.ArgumentParser, default_episodes: int, checkpoint_every: int
) -> None:
    group = parser.add_argument_group("run options")
    group.add_argument(
        "--episodes",
        type=_integer,
        default=default_episodes,
        metavar="N",
        help=f"episodes (optimizer steps for grpo) to train, 1..{MAX_EPISODES} "
        f"(default: {default_episodes})",
    )
    group.add_argument(
        "--rate",
        type=_number,
        default=0.0,
        metavar="R",
        help="episodes published per second, 0.01..10000; negative: unpaced, as fast as they "
        f"train (default: the gateway's --episode-rate, {DEFAULT_EPISODE_RATE:g} unless its "
        "operator set another)",
    )
    group.add_argument(
        "--speed",
        type=_number,
        default=0.0,
        metavar="S",
        help="playback speed, a multiplier of --rate, 0.1..20 (default: 1)",
    )
    group.add_argument(
        "--seed", type=_integer, default=0, metavar="N", help="random seed (default: 0)"
    )
    group.add_argument(
        "--checkpoint-every",
        type=_integer,
        default=0,
        metavar="N",
        help="write a checkpoint every N episodes, and always at the end "
        f"(default: {checkpoint_every})",
    )
    group.add_argument(
        "--keep-checkpoints",
        type=_integer,
        default=0,
        metavar="K",
        help=f"keep the latest K checkpoints, 1..{MAX_KEEP_CHECKPOINTS} "
        f"(default: {DEFAULT_KEEP_CHECKPOINTS})",
    )
    group.add_argument(
        "--name", default="", metavar="NAME", help="a display name for people (default: none)"
    )
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


def _create_commands(tree: _Tree, runs: Any) -> None:
    create = tree.add(
        runs,
        "create",
        "create a run",
        "Create a training run of one kind (imitation or grpo) on the gateway, which places it "
        "on a trainer with a free slot. Prints the run; --watch follows it live.",
        [
            ("an avatar learns the wave clip", "trainwire runs create imitation --clip wave"),
            (
                "fine-tune a local model with GRPO and watch it",
                "trainwire runs create grpo --model models/tiny-vlm "
                "--dataset data/colours.jsonl --watch",
            ),
        ],
    )
    kinds = create.add_subparsers(dest="kind", metavar="KIND", required=True, title="kinds")

    imitation = tree.add(
        kinds,
        "imitation",
        "an avatar learns to imitate a motion clip",
        "Create an imitation run: an avatar rig learns to imitate a built-in motion clip "
        "(a policy gradient on the trainer's CPU or GPU).",
        [
            ("a 200-episode run on the wave clip", "trainwire runs create imitation --clip wave"),
            (
                "a longer, unpaced run with a label, printing only its id",
                "trainwire runs create imitation --clip walk --episodes 2000 --rate -1 "
                "--label team=motion -q",
            ),
        ],
    )
    imitation.add_argument(
        "--clip",
        required=True,
        metavar="CLIP",
        help=f"built-in clip to imitate: {', '.join(BUILTIN_CLIPS)}",
    )
    imitation.add_argument(
        "--rig",
        default=DEFAULT_RIG,
        metavar="RIG",
        help=f"built-in rig: {', '.join(BUILTIN_RIG_BONES)} (default: {DEFAULT_RIG})",
    )
    imitation.add_argument(
        "--group-size",
        type=_integer,
        default=0,
        metavar="N",
        help=f"motions per episode, 2..1024 (default: {DEFAULT_IMITATION_GROUP_SIZE})",
    )
    _learning_rate(
        imitation,
        f"Adam learning rate, in (0, 1] (default: {DEFAULT_IMITATION_LEARNING_RATE:g})",
        default=0.0,
    )
    imitation.add_argument(
        "--avatar", default="", metavar="ID", help="free-form avatar id (default: none)"
    )
    _run_options(imitation, 200, DEFAULT_IMITATION_CHECKPOINT_EVERY)
    imitation.set_defaults(handler=cmd_create_imitation)

    grpo = tree.add(
        kinds,
        "grpo",
        "fine-tune a vision-language model with GRPO",
        "Create a GRPO run on a local model and a prepared dataset (paths relative to the "
        "trainer's first --data-root, or absolute paths inside any of its --data-root "
        "directories). A flag left out takes the default its help states.",
        [
            (
                "the tiny offline VLM on the colour dataset, the trainer's defaults",
                "trainwire runs create grpo --model models/tiny-vlm --dataset data/colours.jsonl",
            ),
            (
                "LoRA adapters, weighted rewards, 100 steps",
                "trainwire runs create grpo --model models/qwen --dataset data/train.parquet "
                "--lora --reward exact_match=2,format --episodes 100",
            ),
        ],
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
        "missing one is 1) (default: exact_match,format)",
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
    for flag, kind, meta, text, said in (
        (
            "--num-generations",
            _integer,
            "N",
            "completions sampled per prompt, 2..64",
            str(DEFAULT_GRPO_GENERATIONS),
        ),
        (
            "--batch-size",
            _integer,
            "N",
            "per-device batch size in completions, 1..1024, a multiple of --num-generations",
            f"{DEFAULT_GRPO_PROMPTS_PER_STEP} prompts' completions, "
            f"{DEFAULT_GRPO_PROMPTS_PER_STEP} x --num-generations; one prompt per dataset row "
            "when the dataset has fewer rows",
        ),
        (
            "--max-completion-length",
            _integer,
            "TOKENS",
            "longest completion, 1..4096 tokens",
            str(DEFAULT_GRPO_MAX_COMPLETION_LENGTH),
        ),
        (
            "--learning-rate",
            _number,
            "LR",
            "learning rate, in (0, 1]",
            f"{DEFAULT_GRPO_LEARNING_RATE:g}; with LoRA {DEFAULT_GRPO_LORA_LEARNING_RATE:g}",
        ),
        (
            "--temperature",
            _number,
            "T",
            "sampling temperature, in (0, 10]",
            f"{DEFAULT_GRPO_TEMPERATURE:g}",
        ),
        ("--grad-accum", _integer, "STEPS", "gradient accumulation steps, 1..1024", "1"),
        (
            "--processes",
            _integer,
            "N",
            "processes the job trains on, 1..64, one trainer slot (one GPU on a GPU trainer) "
            "each; --batch-size is per process",
            "1",
        ),
    ):
        if flag == "--learning-rate":
            _learning_rate(grpo, f"{text} (default: {said})", default=0)
            continue
        grpo.add_argument(
            flag, type=kind, default=0, metavar=meta, help=f"{text} (default: {said})"
        )
    grpo.add_argument(
        "--beta",
        type=_number,
        default=None,
        metavar="B",
        help="KL coefficient, >= 0; above 0 loads a reference model (default: 0; with LoRA "
        f"{DEFAULT_GRPO_LORA_BETA:g})",
    )
    grpo.add_argument(
        "--workers",
        type=_integer,
        default=None,
        metavar="N",
        help=f"image-decoding dataloader worker processes, 0..32 (default: {DEFAULT_GRPO_WORKERS})",
    )
    grpo.add_argument(
        "--prefetch",
        type=_integer,
        default=None,
        metavar="N",
        help="batches each worker prefetches, 1..64; not with --workers 0 (default: 2, "
        "PyTorch's DataLoader default)",
    )
    grpo.add_argument(
        "--lora",
        action="store_true",
        help="train LoRA adapters instead of every weight (implied by any --lora-* flag); "
        "the download is then the adapter in peft's format, or the merged model with "
        "`trainwire runs download --merged` (default: off, full fine-tuning)",
    )
    grpo.add_argument(
        "--lora-rank",
        type=_integer,
        default=0,
        metavar="R",
        help=f"rank of the adapters, 1..256 (default: {DEFAULT_GRPO_LORA_RANK})",
    )
    grpo.add_argument(
        "--lora-alpha",
        type=_number,
        default=0.0,
        metavar="A",
        help="LoRA scaling alpha, > 0 (default: 2 x --lora-rank)",
    )
    grpo.add_argument(
        "--lora-dropout",
        type=_number,
        default=0.0,
        metavar="P",
        help="dropout on the adapters' input, in [0, 1) (default: 0)",
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
    _run_options(grpo, 20, DEFAULT_GRPO_CHECKPOINT_EVERY)
    grpo.set_defaults(handler=cmd_create_grpo)


def _runs_commands(tree: _Tree, commands: Any) -> None:
    runs = tree.add(
        commands,
        "runs",
        "create, list, show, fork and delete runs",
        "Manage runs: create them, list and search them, show one, list and download its "
        "checkpoints, label, rename, fork and delete them.",
        [
            ("the newest runs", "trainwire runs list"),
            ("one run in full", "trainwire runs get RUN"),
        ],
    )
    runs_commands = runs.add_subparsers(
        dest="runs_command", metavar="SUBCOMMAND", required=True, title="subcommands"
    )
    _create_commands(tree, runs_commands)

    listing = tree.add(
        runs_commands,
        "list",
        "list runs, newest first",
        "List runs, newest first unless --order-by says otherwise, those --state and --filter "
        "find only: id, kind, state, episode, best reward and name, one run a line.",
        [
            ("every run", "trainwire runs list"),
            ("the running ones", "trainwire runs list --state running"),
            (
                "the five best finished runs of the vision team",
                "trainwire runs list --filter 'state = STATE_DONE AND labels.team = vision' "
                "--order-by 'best_reward desc' --limit 5",
            ),
        ],
    )
    listing.add_argument(
        "--state",
        type=_state,
        default=0,
        metavar="STATE",
        help="only runs in this state: pending, running, paused, done, stopped or error "
        "(default: every state)",
    )
    listing.add_argument(
        "--filter",
        default="",
        metavar="EXPR",
        help="only runs this AIP-160 filter finds, e.g. 'state = STATE_DONE AND best_reward "
        f"> 0.8 AND labels.team = vision'; the fields: {SEARCH_FIELDS} (default: none)",
    )
    listing.add_argument(
        "--order-by",
        default="",
        metavar="KEYS",
        help='sort by these fields (AIP-132), e.g. "best_reward desc, create_time" '
        "(default: newest first)",
    )
    listing.add_argument(
        "--limit",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="at most N runs (default: every run)",
    )
    listing.set_defaults(handler=cmd_list)

    get = tree.add(
        runs_commands,
        "get",
        "show one run",
        "Show one run in full: its state, progress, rewards, task, config, labels and lineage.",
        [
            ("a run", "trainwire runs get RUN"),
            ("the same as JSON, for jq", "trainwire runs get RUN --json"),
        ],
    )
    _run_argument(get)
    get.set_defaults(handler=cmd_get)

    delete = tree.add(
        runs_commands,
        "delete",
        "delete a finished run",
        "Delete a finished run (done, stopped or error): its episodes and its checkpoints. "
        "An active run is refused: stop it first.",
        [
            ("delete a run", "trainwire runs delete RUN"),
            (
                "stop a running run, then delete it",
                "trainwire stop RUN && trainwire runs delete RUN",
            ),
        ],
    )
    _run_argument(delete)
    delete.set_defaults(handler=cmd_delete)

    checkpoints = tree.add(
        runs_commands,
        "checkpoints",
        "list a run's checkpoints, oldest first",
        "List a run's checkpoints, oldest first: the episode each was written at, its size "
        "and SHA-256. Fork or download one by its episode.",
        [
            ("a run's checkpoints", "trainwire runs checkpoints RUN"),
            ("as JSON", "trainwire runs checkpoints RUN --json"),
        ],
    )
    _run_argument(checkpoints)
    checkpoints.set_defaults(handler=cmd_checkpoints)

    download = tree.add(
        runs_commands,
        "download",
        "download a checkpoint, check its SHA-256 and extract it",
        "Download a checkpoint of a run (the trained model and its training state), check its "
        "SHA-256 and extract it into a new directory.",
        [
            ("the latest checkpoint", "trainwire runs download RUN --out model/"),
            (
                "the one of episode 500, a LoRA run's adapter merged into its base model",
                "trainwire runs download RUN --episode 500 --merged --out merged/",
            ),
        ],
    )
    _run_argument(download)
    download.add_argument(
        "--episode",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="the checkpoint's episode, see `trainwire runs checkpoints RUN` (default: the latest)",
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
        "with transformers alone (default: off, model/ is the adapter, for peft)",
    )
    download.set_defaults(handler=cmd_download)

    label = tree.add(
        runs_commands,
        "label",
        "set or remove a run's labels",
        "Set (KEY=VALUE) or remove (KEY-) labels of a run, active or finished; the other "
        "labels stay. Prints the run.",
        [
            ("set two labels", "trainwire runs label RUN team=vision stage=sweep"),
            ("remove one", "trainwire runs label RUN stage-"),
        ],
    )
    _run_argument(label)
    label.add_argument(
        "changes",
        nargs="+",
        type=_label_change,
        metavar="KEY=VALUE|KEY-",
        help="a label to set, or KEY- to remove one",
    )
    label.set_defaults(handler=cmd_label)

    rename = tree.add(
        runs_commands,
        "rename",
        "change a run's display name",
        "Change the display name of a run, active or finished ('' removes it). Prints the run.",
        [
            ("name a run", "trainwire runs rename RUN 'wave, lr 0.01'"),
            ("remove its name", "trainwire runs rename RUN ''"),
        ],
    )
    _run_argument(rename)
    rename.add_argument("name", metavar="NAME", help="the new display name ('' removes it)")
    rename.set_defaults(handler=cmd_rename)

    fork = tree.add(
        runs_commands,
        "fork",
        "start a new run from a checkpoint of another",
        "Create a run that starts from a checkpoint of RUN (its weights and training state) "
        "with RUN's task, config and labels and the changes given. Its episodes are numbered "
        "from the checkpoint's episode + 1, so its curve continues RUN's. The task kind and "
        "model stay RUN's; the gateway refuses a fork it cannot make (no such checkpoint, "
        "another task) and says why.",
        [
            ("continue from the latest checkpoint", "trainwire runs fork RUN --episodes 400"),
            (
                "branch at episode 120 with a lower learning rate, and watch",
                "trainwire runs fork RUN --episode 120 --learning-rate 1e-4 --episodes 400 --watch",
            ),
        ],
    )
    _run_argument(fork, "the run to fork")
    fork.add_argument(
        "--episode",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="the checkpoint's episode, see `trainwire runs checkpoints RUN` (default: RUN's "
        "latest)",
    )
    changes = fork.add_argument_group("changes (default: RUN's)")
    _learning_rate(changes, "learning rate, in (0, 1]")
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
        help="playback speed, a multiplier of --rate, 0.1..20 (default: 1)",
    )
    fork.add_argument(
        "--name", default="", metavar="NAME", help="a display name for people (default: none)"
    )
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


def _control_commands(tree: _Tree, commands: Any) -> None:
    for name, summary, description, examples in (
        (
            "pause",
            "pause a running run",
            "Pause a running run: publication stops and its trainer holds at its next "
            "episode. A run paused long enough is parked (checkpointed, its slot freed); "
            "resume places it again.",
            [("pause a run", "trainwire pause RUN")],
        ),
        (
            "resume",
            "resume a paused run",
            "Resume a paused run at its paced rate, training and publication alike.",
            [("resume a run and follow it", "trainwire resume RUN && trainwire watch RUN")],
        ),
        (
            "stop",
            "stop a run (its history is kept)",
            "Stop a run for good: its trainer ends the job; its episodes and checkpoints stay "
            "(fork it to go on, delete it to remove them).",
            [("stop a run", "trainwire stop RUN")],
        ),
    ):
        control = tree.add(commands, name, summary, description, examples)
        _run_argument(control)
        control.set_defaults(handler=cmd_control, action=name)

    speed = tree.add(
        commands,
        "speed",
        "set a run's playback speed",
        "Set the playback speed of an active run: a multiplier of its publication rate, "
        "0.1..20, in effect from the next episode.",
        [
            ("publish four times as fast", "trainwire speed RUN 4"),
            ("back to normal", "trainwire speed RUN 1"),
        ],
    )
    _run_argument(speed)
    speed.add_argument("speed", type=_number, metavar="X", help="speed multiplier, 0.1..20")
    speed.set_defaults(handler=cmd_speed)

    live = tree.add(
        commands,
        "set",
        "change a running run's hyperparameters",
        "Change the hyperparameters of a RUNNING or PAUSED run from its next optimizer step. "
        "Its episodes from then on carry the values in effect as metrics (learning_rate, "
        "temperature, beta: see plot --metrics), so the history shows each change where it "
        "happened.",
        [
            ("halve the learning rate", "trainwire set RUN --learning-rate 1.5e-3"),
            ("sample colder, less KL", "trainwire set RUN --temperature 0.7 --beta 0.01"),
        ],
    )
    _run_argument(live)
    _learning_rate(live, "learning rate, in (0, 1]")
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


def _view_commands(tree: _Tree, commands: Any) -> None:
    watch = tree.add(
        commands,
        "watch",
        "follow a run live until it ends",
        "Follow a run live: progress, rate and ETA, state, rewards, a learning curve. Resumes "
        "by itself after a dropped connection. Ctrl+C detaches and leaves the run running. "
        "Exits 0 when the run is DONE, 1 on ERROR, 3 when STOPPED.",
        [
            ("follow a run", "trainwire watch RUN"),
            (
                "its episodes as JSON lines, numbers only, from episode 100",
                "trainwire watch RUN --json --scalars --after 100",
            ),
        ],
    )
    _run_argument(watch)
    watch.add_argument(
        "--after",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="start after episode N (default: replay from the first episode)",
    )
    watch.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="reconnect when nothing (not even a keepalive) arrives for this long (default: 30)",
    )
    watch.add_argument(
        "--scalars",
        action="store_true",
        help="with --json: episodes without their detail (motions, completions), numbers "
        "only; the live view never shows detail, so it always streams them so (default: off)",
    )
    watch.set_defaults(handler=cmd_watch)

    plot = tree.add(
        commands,
        "plot",
        "draw the learning curve of a run, or of several on one chart",
        "Draw a run's learning curve to a PNG: the reward's range (min..max), its rolling mean "
        "and the best reward, from the curve the gateway summarises in one bucket per pixel "
        "column (GetRunCurve), so a run of millions of episodes draws as fast as a short one. "
        "Given several runs, overlays them, one colour each: each run's range as a translucent "
        "band under its rolling mean, a legend of their names, a line per run in each "
        "--metrics panel; a fork's curve continues its parent's.",
        [
            ("one run's curve", "trainwire plot RUN --out curve.png"),
            (
                "two runs overlaid, with their loss",
                "trainwire plot RUN OTHER_RUN --metrics loss --out sweep.png",
            ),
        ],
    )
    plot.add_argument("run_ids", nargs="+", metavar="RUN", help="one run or more")
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

    compare = tree.add(
        commands,
        "compare",
        "compare runs: the config fields that differ, final and best rewards",
        "Compare runs: each run's state, last episode, final and best reward, then the config "
        "fields (task, config, labels, fork lineage) whose values differ between them, a "
        "column per run ('-': not set in that run).",
        [
            ("what differs between two runs", "trainwire compare RUN OTHER_RUN"),
            ("every field of three runs", "trainwire compare RUN_A RUN_B RUN_C --all"),
        ],
    )
    compare.add_argument("run_ids", nargs="+", metavar="RUN", help="two or more runs")
    compare.add_argument(
        "--all",
        action="store_true",
        help="every config field, not only those that differ (default: off)",
    )
    compare.set_defaults(handler=cmd_compare)

    avatar = tree.add(
        commands,
        "avatar",
        "draw an imitation run's learned motion",
        "Draw the motion an imitation run's avatar learned, from its latest episode with a "
        "motion: a strip of poses (PNG), or an animation with --gif.",
        [
            ("a strip of 8 poses", "trainwire avatar RUN --out poses.png"),
            ("an animation", "trainwire avatar RUN --gif --out motion.gif"),
        ],
    )
    _run_argument(avatar)
    avatar.add_argument("--out", required=True, metavar="FILE", help="where to write the picture")
    avatar.add_argument(
        "--gif",
        action="store_true",
        help="an animation (GIF) instead of a strip of poses (default: off)",
    )
    avatar.add_argument(
        "--poses", type=_integer, default=8, metavar="N", help="poses in the strip (default: 8)"
    )
    avatar.set_defaults(handler=cmd_avatar)

    completion = tree.add(
        commands,
        "completion",
        "print a shell completion script (bash or zsh)",
        "Print a script that completes trainwire's commands and flags in bash or zsh. It "
        "needs no gateway. Load it in the shell's start-up file.",
        [
            (
                "bash: completion in every new shell",
                "trainwire completion bash > ~/.local/share/bash-completion/completions/trainwire",
            ),
            ("zsh: load it in ~/.zshrc", 'eval "$(trainwire completion zsh)"'),
        ],
    )
    completion.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")
    completion.set_defaults(local=cmd_completion)


def build_parser() -> CommandParser:
    """The full ``trainwire`` argument parser."""
    parser = CommandParser(
        prog="trainwire",
        description="Create, control and watch Trainwire training runs.",
        parents=[_common_options(suppress=False)],
        examples=[
            (
                "train an avatar and follow it live",
                "trainwire runs create imitation --clip wave --watch",
            ),
            ("list runs on another gateway", "trainwire --gateway gw.example:50051 runs list"),
        ],
        footer="Exit codes: 0 ok; 1 error (or the watched run failed); 2 bad usage;\n"
        "3 the watched run was stopped; 130 interrupted.\n\n"
        "`trainwire COMMAND --help` shows a command's flags and examples.",
    )
    parser.add_argument("--version", action="version", version=f"trainwire {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, title="commands"
    )
    tree = _Tree()
    _runs_commands(tree, commands)
    _control_commands(tree, commands)
    _view_commands(tree, commands)
    return parser
