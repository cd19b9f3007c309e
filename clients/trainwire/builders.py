"""Request builders: ``TrainTask`` and ``TrainConfig`` without touching protobuf oneofs by hand,
and the ``Run.State`` names people type and read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from trainwire.v1 import episode_pb2, gateway_service_pb2

if TYPE_CHECKING:
    from trainwire.motion import ClipSpec, RigSpec

__all__ = [
    "TERMINAL_STATES",
    "Run",
    "RunState",
    "grpo_task",
    "imitation_task",
    "parse_state",
    "state_name",
    "train_config",
]

Run = gateway_service_pb2.Run
#: A ``Run.State`` value (an int at run time).
RunState: TypeAlias = "gateway_service_pb2.Run.State.ValueType"

#: The states a run never leaves.
TERMINAL_STATES: frozenset[RunState] = frozenset(
    {Run.State.STATE_DONE, Run.State.STATE_STOPPED, Run.State.STATE_ERROR}
)


def imitation_task(
    *,
    clip: str | episode_pb2.Clip | ClipSpec = "wave",
    rig: str | episode_pb2.Rig | RigSpec = "stickman",
    group_size: int = 0,
    learning_rate: float = 0.0,
    avatar_id: str = "",
) -> episode_pb2.TrainTask:
    """Builds an imitation ``TrainTask``.

    Args:
        clip: A built-in clip name (``wave``, ``walk``, ``jump``), a ``Clip`` message or a
            ``trainwire.motion.ClipSpec``.
        rig: A built-in rig name (``stickman``), a ``Rig`` message or a ``RigSpec``.
        group_size: Motions sampled per episode; 0 for the default.
        learning_rate: Adam learning rate; 0 for the default.
        avatar_id: Free-form id of the avatar.
    """
    task = episode_pb2.ImitationTask(
        avatar_id=avatar_id, group_size=group_size, learning_rate=learning_rate
    )
    if isinstance(rig, str):
        task.rig_name = rig
    elif isinstance(rig, episode_pb2.Rig):
        task.rig.CopyFrom(rig)
    else:
        from trainwire.motion import rig_to_proto

        task.rig.CopyFrom(rig_to_proto(rig))
    if isinstance(clip, str):
        task.clip_name = clip
    elif isinstance(clip, episode_pb2.Clip):
        task.clip.CopyFrom(clip)
    else:
        from trainwire.motion import clip_to_proto

        task.clip.CopyFrom(clip_to_proto(clip))
    return episode_pb2.TrainTask(imitation=task)


def grpo_task(
    *,
    model: str,
    dataset: str,
    reward_functions: Sequence[str] = (),
    num_generations: int = 0,
    batch_size: int = 0,
    max_completion_length: int = 0,
    learning_rate: float = 0.0,
    beta: float | None = None,
    temperature: float = 0.0,
    gradient_accumulation_steps: int = 0,
    dataloader_num_workers: int | None = None,
    dataloader_prefetch_factor: int | None = None,
    num_processes: int = 0,
) -> episode_pb2.TrainTask:
    """Builds a GRPO ``TrainTask``; zeros and ``None`` leave the trainer's defaults.

    Args:
        model: Model directory, relative to the trainer's data root.
        dataset: JSONL dataset file, relative to the trainer's data root.
        reward_functions: Reward function names; empty for ``exact_match`` and ``format``.
        num_generations: Completions per prompt.
        batch_size: Per-device batch size in completions.
        max_completion_length: Maximum completion length in tokens.
        learning_rate: Learning rate.
        beta: KL coefficient (``None``: no reference model).
        temperature: Sampling temperature.
        gradient_accumulation_steps: Gradient accumulation steps.
        dataloader_num_workers: Image-decoding worker processes.
        dataloader_prefetch_factor: Batches each worker prefetches.
        num_processes: Processes (one trainer slot, and one GPU where there are GPUs, each)
            the job trains on; ``batch_size`` is per process.
    """
    task = episode_pb2.GrpoTask(
        model_path=model,
        dataset_path=dataset,
        reward_functions=list(reward_functions),
        num_generations=num_generations,
        batch_size=batch_size,
        max_completion_length=max_completion_length,
        learning_rate=learning_rate,
        temperature=temperature,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_processes=num_processes,
    )
    if beta is not None:
        task.beta = beta
    if dataloader_num_workers is not None:
        task.dataloader_num_workers = dataloader_num_workers
    if dataloader_prefetch_factor is not None:
        task.dataloader_prefetch_factor = dataloader_prefetch_factor
    return episode_pb2.TrainTask(grpo=task)


def train_config(
    max_episodes: int = 200, seed: int = 0, checkpoint_every: int = 0, keep_checkpoints: int = 0
) -> episode_pb2.TrainConfig:
    """Builds a ``TrainConfig`` (``max_episodes`` in 1..5000; a checkpoint every
    ``checkpoint_every`` episodes, the latest ``keep_checkpoints`` kept; 0: the defaults)."""
    return episode_pb2.TrainConfig(
        max_episodes=max_episodes,
        seed=seed,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
    )


def state_name(state: RunState) -> str:
    """``Run.State`` value to a short lower-case name: ``STATE_RUNNING`` -> ``running``."""
    return Run.State.Name(state).removeprefix("STATE_").lower()


def parse_state(name: str) -> RunState:
    """Short or full state name (``running``, ``STATE_RUNNING``) to its ``Run.State`` value.

    Raises:
        ValueError: an unknown state name.
    """
    full = name.strip().upper()
    if not full.startswith("STATE_"):
        full = "STATE_" + full
    try:
        value = Run.State.Value(full)
    except ValueError:
        names = ", ".join(state_name(v) for v in Run.State.values() if v)
        raise ValueError(f"unknown run state {name!r}; one of: {names}") from None
    return value
