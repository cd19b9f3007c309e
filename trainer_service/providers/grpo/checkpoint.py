"""Writing a GRPO checkpoint from the ranks of a job (the layout is :mod:`.checkpoint_files`).

Every rank calls :func:`save` at the same step boundary (the trainer asks all of them, see
:mod:`.worker`): each contributes its RNG states (gathered to rank 0 over torch.distributed, so
ranks need not share a disk), and rank 0 writes the directory. The files under ``trainer/`` are
the ones ``Trainer.train(resume_from_checkpoint=...)`` reads, in its own formats: the optimizer
and scheduler ``state_dict``s, ``trainer_state.json`` and one ``rng_state`` file per rank (the
dict ``Trainer._save_rng_state`` writes: ``python``, ``numpy``, ``cpu``, and ``cuda`` where
there is one). The trainer state is saved without its log history, which grows with every step
and which resuming does not need. A LoRA job's ``model/`` is its adapter in PEFT's format and the
record of its base model (:func:`.lora.save_adapter`), and its optimizer state covers the
adapter's parameters only (the only ones it trains).

A checkpoint is taken in a step's ``on_log`` (after its collectives, before the next step draws
anything), and every optimizer step of this provider generates its own completions
(``steps_per_generation`` = ``gradient_accumulation_steps``, ``num_iterations`` = 1), so nothing
buffered is lost at a step boundary.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trainer_service.providers.grpo import checkpoint_files as files
from trainer_service.providers.grpo import lora


def rng_states() -> dict[str, Any]:
    """This process's RNG states, as ``Trainer._load_rng_state`` restores them."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        cuda = torch.cuda.random
        states["cuda"] = cuda.get_rng_state_all() if distributed else cuda.get_rng_state()
    return states


def _gather_rng_states() -> list[dict[str, Any]] | None:
    """Every rank's RNG states on rank 0 (``None`` on the others)."""
    states = rng_states()
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return [states]
    rank, world = distributed.get_rank(), distributed.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    distributed.gather_object(states, gathered, dst=0)
    return gathered


def save(trainer: Any, directory: pathlib.Path, extra: Mapping[str, Any]) -> int:
    """Writes a checkpoint of ``trainer`` at its current step into ``directory`` (every rank
    calls this; rank 0 writes).

    Args:
        trainer: The job's ``LazyGRPOTrainer``.
        directory: An empty directory (rank 0's view; other ranks only send their RNG states).
        extra: Rank 0's part of ``trainwire.json`` besides what the trainer knows:
            ``best_reward``, ``last_reward``, ``model_fingerprint`` and ``model_path`` (the
            task's, recorded as a LoRA adapter's base).

    Returns:
        Bytes written (0 on ranks other than 0).

    Raises:
        OSError: Rank 0 could not write (a full disk): nothing was committed, training may go
            on.
    """
    gathered = _gather_rng_states()
    if gathered is None:
        return 0
    state = trainer.state
    model_dir = directory / files.MODEL_DIR
    state_dir = directory / files.STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = lora.is_lora(model)
    fingerprint = str(extra["model_fingerprint"])
    if adapter:
        model_dir.mkdir(parents=True, exist_ok=True)
        lora.save_adapter(model, model_dir, str(extra.get("model_path") or ""), fingerprint)
    else:
        model.save_pretrained(model_dir, safe_serialization=True)
    trainer.processing_class.save_pretrained(model_dir)
    torch.save(trainer.optimizer.state_dict(), state_dir / files.OPTIMIZER)
    torch.save(trainer.lr_scheduler.state_dict(), state_dir / files.SCHEDULER)
    for rank, states in enumerate(gathered):
        torch.save(states, state_dir / files.rng_file(rank, len(gathered)))
    dataclasses.replace(state, log_history=[]).save_to_json(str(state_dir / files.TRAINER_STATE))
    per_epoch = max(1, int(getattr(trainer, "update_steps_per_epoch", 0) or 1))
    content = files.record(
        step=state.global_step,
        best_reward=extra.get("best_reward"),
        last_reward=extra.get("last_reward"),
        world_size=len(gathered),
        seed=trainer.args.seed,
        epoch=state.global_step // per_epoch,
        batches_done=state.global_step % per_epoch,
        model_fingerprint=fingerprint,
        hyperparameters=trainer.live_hyperparameters(),
        lora=adapter,
    )
    (directory / files.RECORD).write_text(json.dumps(content, indent=1), encoding="utf-8")
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
