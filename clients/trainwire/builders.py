"""Request builders: ``TrainTask`` and ``TrainConfig`` without touching protobuf oneofs by hand,
the requests both clients send (``CreateRun``, ``UpdateRun``), checked here against the contract
before they leave, and the ``Run.State`` names people type and read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

from google.protobuf import field_mask_pb2

from trainwire.contract import (
    FieldViolation,
    check_display_name,
    check_hyperparameters,
    check_labels,
    check_run_id,
    display_run_id,
)
from trainwire.errors import InvalidRequest
from trainwire.v1 import episode_pb2, gateway_service_pb2

if TYPE_CHECKING:
    from trainwire.motion import ClipSpec, RigSpec

__all__ = [
    "TERMINAL_STATES",
    "ForkFrom",
    "Run",
    "RunState",
    "create_run_request",
    "fork_source",
    "grpo_task",
    "hyperparameters_request",
    "imitation_task",
    "parse_state",
    "state_name",
    "train_config",
    "update_run_request",
]

Run = gateway_service_pb2.Run
#: A ``Run.State`` value (an int at run time).
RunState: TypeAlias = "gateway_service_pb2.Run.State.ValueType"
#: Where a fork starts: a ``ForkSource``, or ``(run_id, episode)`` (episode 0: the latest
#: checkpoint), or a run id alone (its latest checkpoint).
ForkFrom: TypeAlias = "gateway_service_pb2.ForkSource | tuple[str, int] | str"

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
    reward_weights: Sequence[float] = (),
    columns: Mapping[str, str] | None = None,
    lora: episode_pb2.LoraConfig | None = None,
    gradient_checkpointing: bool = False,
) -> episode_pb2.TrainTask:
    """Builds a GRPO ``TrainTask``; zeros and ``None`` leave the trainer's defaults.

    Args:
        model: Model directory, relative to the trainer's data root.
        dataset: The dataset, relative to the trainer's data root: a JSONL or Parquet file, or
            a directory written by ``datasets``' ``save_to_disk``.
        reward_functions: Reward function names (built-in, or ``MODULE:FUNCTION`` of a
            trainer's ``--reward-module``); empty for ``exact_match`` and ``format``.
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
        reward_weights: One weight per reward function (empty: all 1).
        columns: Dataset column names by role (``prompt``, ``images``, ``solution``) where
            they differ from the defaults.
        lora: Train LoRA adapters with this config instead of every weight (an empty
            ``LoraConfig()``: rank 16, alpha 2 x rank, every linear layer of the language
            model); ``None``: full fine-tuning.
        gradient_checkpointing: Recompute activations in the backward pass, trading compute
            for memory.
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
        reward_weights=list(reward_weights),
        gradient_checkpointing=gradient_checkpointing,
    )
    if lora is not None:
        task.lora.CopyFrom(lora)
    if columns:
        task.columns.CopyFrom(episode_pb2.DatasetColumns(**columns))
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


def fork_source(fork_from: ForkFrom) -> gateway_service_pb2.ForkSource:
    """``fork_from`` as a ``ForkSource`` message (see ``ForkFrom``)."""
    if isinstance(fork_from, gateway_service_pb2.ForkSource):
        return fork_from
    if isinstance(fork_from, str):
        return gateway_service_pb2.ForkSource(run_id=fork_from)
    run_id, episode = fork_from
    return gateway_service_pb2.ForkSource(run_id=run_id, episode=episode)


def _quoted(run_id: str) -> str:
    """``'abc'`` for a valid run id (as the gateway's messages quote it), else a short safe
    prefix of it."""
    return display_run_id(run_id) if check_run_id(run_id) else repr(run_id)


def _refuse(message: str, violations: Sequence[FieldViolation]) -> None:
    if violations:
        first = violations[0]
        raise InvalidRequest(
            f"{message}: {first.field}: {first.description}", field_violations=violations
        )


def create_run_request(
    task: episode_pb2.TrainTask,
    config: episode_pb2.TrainConfig | None = None,
    *,
    speed: float = 0.0,
    episodes_per_second: float = 0.0,
    request_id: str = "",
    display_name: str = "",
    labels: Mapping[str, str] | None = None,
    fork_from: ForkFrom | None = None,
) -> gateway_service_pb2.CreateRunRequest:
    """A ``CreateRunRequest`` (see ``GatewayClient.create_run``); its labels and fork source
    checked as the gateway checks them.

    Raises:
        InvalidRequest: a bad label or fork source (every one in ``field_violations``).
    """
    request = gateway_service_pb2.CreateRunRequest(
        task=task,
        config=config,
        speed=speed,
        episodes_per_second=episodes_per_second,
        request_id=request_id,
        display_name=display_name,
        labels=dict(labels or {}),
    )
    violations = check_labels(request.labels)
    if fork_from is not None:
        request.fork_from.CopyFrom(fork_source(fork_from))
        violations += check_run_id(request.fork_from.run_id, "fork_from.run_id")
        if request.fork_from.episode < 0:
            violations.append(
                FieldViolation(
                    "fork_from.episode",
                    f"{request.fork_from.episode}; need >= 0 (0: the latest checkpoint)",
                )
            )
    _refuse("cannot create the run", violations)
    return request


def update_run_request(
    run_id: str,
    *,
    display_name: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> gateway_service_pb2.UpdateRunRequest:
    """An ``UpdateRunRequest`` whose field mask names exactly the fields given (``None``: left
    as they are); ``labels`` replaces the run's whole label set (``{}`` removes them all).

    Raises:
        ValueError: neither ``display_name`` nor ``labels`` (an empty mask would set both).
        InvalidRequest: a bad run id, display name, label key or value, checked as the gateway
            checks them (every one in ``field_violations``).
    """
    if display_name is None and labels is None:
        raise ValueError("give display_name, labels or both to update")
    run = gateway_service_pb2.Run(id=run_id)
    paths = []
    violations = check_run_id(run_id, "run.id")
    if display_name is not None:
        run.display_name = display_name
        paths.append("display_name")
        violations += check_display_name(display_name, "run.display_name")
    if labels is not None:
        run.labels.update(labels)
        paths.append("labels")
        violations += check_labels(run.labels, "run.labels")
    _refuse(f"cannot update run {_quoted(run_id)}", violations)
    return gateway_service_pb2.UpdateRunRequest(
        run=run, update_mask=field_mask_pb2.FieldMask(paths=paths)
    )


def hyperparameters_request(
    run_id: str,
    *,
    learning_rate: float | None = None,
    temperature: float | None = None,
    beta: float | None = None,
) -> gateway_service_pb2.SetRunHyperparametersRequest:
    """A ``SetRunHyperparametersRequest`` that sets exactly the values given (``None``: left as
    it is), each checked against its range as the gateway checks it (which of them the run's
    task kind has, the gateway checks).

    Raises:
        ValueError: no value given.
        InvalidRequest: a value that is not finite or out of its range.
    """
    if learning_rate is None and temperature is None and beta is None:
        raise ValueError("give learning_rate, temperature or beta to set")
    violations = check_hyperparameters(
        "", learning_rate=learning_rate, temperature=temperature, beta=beta
    )
    _refuse(f"cannot set the hyperparameters of run {_quoted(run_id)}", violations)
    return gateway_service_pb2.SetRunHyperparametersRequest(
        run_id=run_id, learning_rate=learning_rate, temperature=temperature, beta=beta
    )


def run_curve_request(
    run_id: str, buckets: int, metrics: Sequence[str], first_episode: int, last_episode: int
) -> gateway_service_pb2.GetRunCurveRequest:
    """A ``GetRunCurveRequest`` (see ``GatewayClient.get_run_curve``).

    Raises:
        TypeError: ``metrics`` is one string, which would otherwise be sent as its letters.
    """
    if isinstance(metrics, str):
        raise TypeError(f"metrics must be a sequence of names, got the string {metrics!r}")
    return gateway_service_pb2.GetRunCurveRequest(
        run_id=run_id,
        buckets=buckets,
        metrics=list(metrics),
        first_episode=first_episode,
        last_episode=last_episode,
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
