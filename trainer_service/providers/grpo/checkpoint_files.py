"""What a GRPO checkpoint directory holds, and the checks of one that need no torch.

A checkpoint taken after optimizer step ``n``::

    model/                      the trained model and its processor (``save_pretrained``):
                                ``from_pretrained`` loads it with plain transformers classes;
                                a LoRA job's: the adapter in PEFT's format
                                (adapter_config.json, adapter_model.safetensors:
                                ``PeftModel.from_pretrained(base, model_dir)``), the processor,
                                and base_model.json (the base model's path as the task named
                                it, and its fingerprint)
    trainer/                    the training state, as ``Trainer.train(resume_from_checkpoint=)``
                                reads it: optimizer.pt, scheduler.pt, trainer_state.json
                                (global step; the log history is left out), rng_state.pth (one
                                process) or rng_state_<rank>.pth (each rank's)
    trainwire.json              written last: the step, best and last reward, the processes, the
                                seed and the data position, the task model's fingerprint, and
                                whether ``model/`` is a LoRA adapter (``lora``)

The data position is not stored as rows: each epoch's order is a pure function of the seed and
the epoch (:mod:`.sampler`), so the global step names it (``epoch``, ``batches_done`` are in
``trainwire.json`` for people and checks).

:func:`check_resume` runs in the trainer before any rank starts: a checkpoint with a file
missing, for another number of processes, from another model or another step, or a LoRA adapter
for a full fine-tuning job (or the other way round), raises :class:`CheckpointUnusable` at once.
What only loading shows (a truncated weights file, an optimizer state of other shapes) the ranks
report the same way, before the first episode.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint

#: The model and processor, loadable with ``from_pretrained``.
MODEL_DIR = "model"
#: The training state, as ``Trainer.train(resume_from_checkpoint=...)`` reads it.
STATE_DIR = "trainer"
#: Trainwire's own record, written last.
RECORD = "trainwire.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
#: Bumped when the layout changes in a way an older reader would misread.
FORMAT = 1
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
#: A LoRA checkpoint's ``model/``: the adapter (PEFT's names) and the record of its base model.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_RECORD = "base_model.json"


def rng_file(rank: int, world_size: int) -> str:
    """The name ``Trainer._load_rng_state`` reads for ``rank`` of ``world_size`` processes."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def model_fingerprint(model_dir: pathlib.Path) -> str:
    """The sha256 of a model directory's ``config.json``, parsed and written canonically (so a
    re-indented file keeps its fingerprint).

    Raises:
        OSError: The file is missing or unreadable.
        ValueError: It is not JSON.
    """
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def record(
    *,
    step: int,
    best_reward: float | None,
    last_reward: float | None,
    world_size: int,
    seed: int,
    epoch: int,
    batches_done: int,
    model_fingerprint: str,
    hyperparameters: Mapping[str, float] | None = None,
    lora: bool = False,
) -> dict[str, Any]:
    """The content of ``trainwire.json`` (``hyperparameters``: the live ones in effect, for
    people; a resumed job trains with its task's; ``lora``: ``model/`` is an adapter)."""
    return {
        "format": FORMAT,
        "step": step,
        "best_reward": best_reward,
        "last_reward": last_reward,
        "world_size": world_size,
        "seed": seed,
        "data_position": {"epoch": epoch, "batches_done": batches_done},
        "model_fingerprint": model_fingerprint,
        "hyperparameters": dict(hyperparameters or {}),
        "lora": lora,
    }


def is_lora_checkpoint(content: Mapping[str, Any]) -> bool:
    """Whether a checkpoint whose ``trainwire.json`` is ``content`` holds a LoRA adapter."""
    return content.get("lora") is True


def read_record(directory: pathlib.Path) -> dict[str, Any]:
    """A checkpoint's ``trainwire.json``.

    Raises:
        CheckpointUnusable: It is missing, unreadable, or not of this format.
    """
    try:
        content = json.loads((directory / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointUnusable(f"its {RECORD} is missing or unreadable ({exc})") from exc
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise CheckpointUnusable(f"it is not a GRPO checkpoint of format {FORMAT}")
    return content


def check_resume(
    resume: RestoredCheckpoint,
    task_model_dir: pathlib.Path | None,
    processes: int,
    lora: bool = False,
) -> Mapping[str, Any]:
    """Checks that ``resume`` is a complete GRPO checkpoint that fits this job; returns its
    record (``trainwire.json``).

    Args:
        resume: The checkpoint.
        task_model_dir: The task's model directory (resolved): the checkpoint must have been
            trained from a model with the same configuration. ``None`` (or a directory without
            a readable ``config.json``) skips that check: the rank reports the task's model as
            it always does.
        processes: The job's processes in all (its world size, on however many trainers):
            each needs its own RNG state, and the batches are split among them.
        lora: The job trains LoRA adapters: the checkpoint must hold one (and a full fine-tuning
            job a whole model).

    Raises:
        CheckpointUnusable: Why it does not fit.
    """
    directory = resume.directory
    content = read_record(directory)
    if is_lora_checkpoint(content) != lora:
        raise CheckpointUnusable(
            "it holds a LoRA adapter, and this job trains every weight"
            if not lora
            else "it holds a whole model, and this job trains LoRA adapters"
        )
    if content.get("step") != resume.episode:
        raise CheckpointUnusable(
            f"it was taken after step {content.get('step')}, not {resume.episode}"
        )
    if content.get("world_size") != processes:
        raise CheckpointUnusable(
            f"it was written by {content.get('world_size')} processes; this job has {processes}"
        )
    model = directory / MODEL_DIR
    state = directory / STATE_DIR
    weights = [model / name for name in ADAPTER_FILES] if lora else [model / "config.json"]
    needed = [
        *weights,
        state / OPTIMIZER,
        state / SCHEDULER,
        state / TRAINER_STATE,
        *(state / rng_file(rank, processes) for rank in range(processes)),
    ]
    missing = [str(path.relative_to(directory)) for path in needed if not path.is_file()]
    if not lora and not any((model / name).is_file() for name in _WEIGHTS):
        missing.append(f"{MODEL_DIR}/{_WEIGHTS[0]}")
    if missing:
        raise CheckpointUnusable(f"files are missing: {', '.join(missing)}")
    try:
        step = json.loads((state / TRAINER_STATE).read_text(encoding="utf-8"))["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointUnusable(f"its {TRAINER_STATE} is unreadable ({exc})") from exc
    if step != resume.episode:
        raise CheckpointUnusable(f"its trainer state is at step {step}, not {resume.episode}")
    fingerprint = None
    if task_model_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            fingerprint = model_fingerprint(task_model_dir)
    if fingerprint is not None and content.get("model_fingerprint") != fingerprint:
        raise CheckpointUnusable("it was trained from another model than this task's")
    return content
