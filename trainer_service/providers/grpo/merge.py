"""Merging a LoRA checkpoint into its base model, for a merged download.

:func:`merge_checkpoint` is the trainer's side (no torch): it reads the checkpoint's record and
its base model's (``model/base_model.json``), finds that base model in the trainer's data
roots, checks that it is still the model the adapter was trained on (its fingerprint), then runs
the merge in a child process, ``python -m trainer_service.providers.grpo.merge`` (:func:`main`,
which calls :func:`.lora.merge_into_base`), on the CPU: a merge holds a whole model in memory,
and the trainer process never loads the training stack. The child dies with the trainer
(``PR_SET_PDEATHSIG``), and is killed when the caller stops waiting. The merged directory holds
``model/`` (the merged model and the processor) and the checkpoint's ``trainwire.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from trainer_service.core.provider import CheckpointUnusable, ProviderError
from trainer_service.providers.grpo import checkpoint_files, launch
from trainer_service.providers.grpo.validation import resolve_in_roots

_LOGGER = logging.getLogger(__name__)

#: The module the child runs.
MODULE = "trainer_service.providers.grpo.merge"
#: The longest a merge may take (loading, merging and saving a model on the CPU).
MERGE_TIMEOUT_S = 3600.0
#: The child's exit status when the adapter does not fit its base model.
EXIT_UNUSABLE = 3
_POLL_S = 0.1
_TAIL_BYTES = 4000


def _unreadable(why: str) -> ProviderError:
    return ProviderError(
        f"This checkpoint cannot be merged: {why}.",
        code="FAILED_PRECONDITION",
        reason="BAD_TASK",
    )


def _base_model(
    checkpoint_dir: pathlib.Path, data_roots: Sequence[pathlib.Path]
) -> tuple[str, pathlib.Path]:
    """The base model's path as the task named it, and its directory on this trainer.

    Raises:
        ProviderError: Not a LoRA checkpoint, no record of its base, or the base model is not
            on this trainer (or is another model now).
    """
    try:
        content = checkpoint_files.read_record(checkpoint_dir)
    except CheckpointUnusable as exc:
        raise _unreadable(str(exc)) from exc
    if not checkpoint_files.is_lora_checkpoint(content):
        raise _unreadable("it holds a whole model, not a LoRA adapter (download it without merged)")
    record_path = checkpoint_dir / checkpoint_files.MODEL_DIR / checkpoint_files.BASE_RECORD
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        model_path = str(record["model_path"])
        fingerprint = str(record["model_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _unreadable(f"its {checkpoint_files.BASE_RECORD} is missing or unreadable") from exc
    base_dir = resolve_in_roots(data_roots, model_path)
    if base_dir is None or not base_dir.is_dir():
        raise ProviderError(
            f"The base model {model_path!r} of this LoRA checkpoint is not on this trainer.",
            detail=str(base_dir),
            code="FAILED_PRECONDITION",
            reason="MODEL_NOT_FOUND",
        )
    try:
        found = checkpoint_files.model_fingerprint(base_dir)
    except (OSError, ValueError):
        found = ""
    if found != fingerprint:
        raise ProviderError(
            f"The base model {model_path!r} on this trainer is not the model this LoRA "
            "checkpoint was trained on.",
            detail=f"{base_dir}: fingerprint {found or 'unreadable'}, recorded {fingerprint}",
            code="FAILED_PRECONDITION",
            reason="MODEL_NOT_FOUND",
        )
    return model_path, base_dir


def merge_checkpoint(
    checkpoint_dir: pathlib.Path,
    out_dir: pathlib.Path,
    data_roots: Sequence[pathlib.Path],
    stop: threading.Event,
    timeout_s: float = MERGE_TIMEOUT_S,
) -> None:
    """Writes ``checkpoint_dir``'s adapter merged into its base model into ``out_dir``
    (``model/`` and ``trainwire.json``).

    Raises:
        ProviderError: ``FAILED_PRECONDITION`` when the checkpoint is not a LoRA one, its base
            model is not here or the adapter does not fit it; ``CANCELLED`` when ``stop`` was
            set; ``INTERNAL`` when the merge failed otherwise (the log has its output).
    """
    model_path, base_dir = _base_model(checkpoint_dir, data_roots)
    env = launch.rank_env(
        {
            "CUDA_VISIBLE_DEVICES": "",
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TQDM_DISABLE": "1",
            "HF_HUB_OFFLINE": "1",
        },
        0,
        1,
    )
    command = [
        sys.executable,
        "-m",
        MODULE,
        "--adapter",
        str(checkpoint_dir / checkpoint_files.MODEL_DIR),
        "--base",
        str(base_dir),
        "--out",
        str(out_dir / checkpoint_files.MODEL_DIR),
        "--parent-pid",
        str(os.getpid()),
    ]
    with tempfile.TemporaryFile() as output:
        child = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output
        )
        deadline = time.monotonic() + timeout_s
        while child.poll() is None:
            if stop.is_set() or time.monotonic() > deadline:
                child.kill()
                child.wait()
                if stop.is_set():
                    raise ProviderError("The merge was cancelled.", code="CANCELLED")
                raise ProviderError(
                    f"Merging the adapter into its base model {model_path!r} took longer than "
                    f"{timeout_s:g} s.",
                    code="INTERNAL",
                )
            time.sleep(_POLL_S)
        output.seek(max(0, output.seek(0, os.SEEK_END) - _TAIL_BYTES))
        tail = output.read().decode("utf-8", "replace").strip()
    if child.returncode == EXIT_UNUSABLE:
        raise ProviderError(
            f"This LoRA checkpoint does not fit its base model {model_path!r}: "
            f"{tail.splitlines()[-1] if tail else 'no detail'}",
            code="FAILED_PRECONDITION",
            reason="BAD_TASK",
        )
    if child.returncode != 0:
        how = (
            f"signal {signal.Signals(-child.returncode).name}"
            if child.returncode < 0
            else f"exit status {child.returncode}"
        )
        raise ProviderError(
            "Merging the adapter into its base model failed.",
            detail=f"{how}: {tail}",
            code="INTERNAL",
        )
    if tail:
        _LOGGER.debug("merge of %s: %s", checkpoint_dir, tail)
    shutil.copyfile(checkpoint_dir / checkpoint_files.RECORD, out_dir / checkpoint_files.RECORD)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: merges ``--adapter`` into ``--base`` and saves the result in ``--out``."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--adapter", type=pathlib.Path, required=True)
    parser.add_argument("--base", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    from trainer_service.providers.grpo.lifeline import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the trainer died before the signal was armed
    from trainer_service.providers.grpo import lora

    try:
        lora.merge_into_base(args.base, args.adapter, args.out)
    except CheckpointUnusable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNUSABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
