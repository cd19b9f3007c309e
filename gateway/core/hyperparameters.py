"""Live hyperparameters of a run (``SetRunHyperparameters``): a change, checked against the run's
task kind and written into its task, which always holds the values in effect (the job placed
after a park or a restart trains with them). The values are
:class:`trainwire.hyperparameters.Hyperparameters`."""

from __future__ import annotations

from gateway.core import lifecycle as lc
from gateway.core.errors import IllegalTransition, InvalidRequest, TrainerUnavailable
from gateway.core.runs import RunState, TrainingRun
from gateway.core.trainers import (
    TrainerConnector,
    TrainerError,
    TrainerJobFinished,
    TrainerRefused,
)
from trainwire.contract import describe_violations, task_kind
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2


def check_change(
    change: Hyperparameters, run_id: str, task: episode_pb2.TrainTask, reference_model: bool = True
) -> None:
    """Checks ``change`` against the run's task kind and the ranges of the contract;
    ``reference_model`` False refuses beta above 0 (a grpo job started with beta 0).

    Raises:
        InvalidRequest: naming the field and the run.
    """
    violations = change.violations(task_kind(task), reference_model=reference_model)
    if violations:
        raise InvalidRequest(
            f"cannot change the hyperparameters of run {run_id!r}: "
            f"{describe_violations(violations)}",
            violations,
            run_id,
        )


def applied_to(change: Hyperparameters, task: episode_pb2.TrainTask) -> episode_pb2.TrainTask:
    """A copy of ``task`` with ``change`` (a run's task is shared by its snapshots, so it is
    replaced, never changed in place)."""
    changed = episode_pb2.TrainTask()
    changed.CopyFrom(task)
    kind = changed.WhichOneof("kind")
    target = changed.imitation if kind == "imitation" else changed.grpo
    for name, value in change.as_dict().items():
        setattr(target, name, value)
    return changed


def has_reference_model(
    task: episode_pb2.TrainTask, defaults: trainer_service_pb2.ProviderDefaults | None = None
) -> bool:
    """Whether a new job of ``task`` has a reference model (a grpo job that starts with beta
    above 0, or one that trains LoRA adapters: its base model, adapters disabled; other kinds
    have no beta to check). A task that leaves beta unset starts with the default beta of its
    trainer's grpo provider (``defaults``, as the trainer advertised them); without them, with
    the contract's documented full fine-tuning default, 0 (what a trainer older than
    ``provider_defaults`` does)."""
    if task.WhichOneof("kind") != "grpo":
        return True
    grpo = task.grpo
    if grpo.HasField("lora"):
        return True
    if grpo.HasField("beta"):
        return grpo.beta > 0
    return defaults is not None and defaults.grpo.beta > 0


def job_takes(
    change: Hyperparameters,
    run: TrainingRun,
    state: lc.State,
    defaults: trainer_service_pb2.ProviderDefaults | None = None,
) -> bool:
    """Checks ``change`` for ``run`` in lifecycle ``state``: True when its job must be told
    (it applies from the job's next optimizer step), False when the run has no job (parked, or
    waiting to be placed again) and its task alone takes it (the next job trains with it).

    Raises:
        InvalidRequest: a value the run's kind does not have or its next job cannot take.
        IllegalTransition: the run is not RUNNING or PAUSED, or its job trained its last
            episode.
        TrainerUnavailable: its job is being placed on a trainer.

    ``defaults``: those of the run's trainer's provider (for a task that leaves beta unset).
    """
    check_change(change, run.id, run.task, reference_model=True)
    what = f"cannot change the hyperparameters of run {run.id!r}"
    if run.state not in (RunState.RUNNING, RunState.PAUSED) or lc.over(state):
        raise IllegalTransition(f"{what}: it is {run.state.name}", run.id)
    if run.trainer_episode >= run.config.max_episodes:
        last = f"{what}: its trainer has trained its last episode ({run.trainer_episode})"
        raise IllegalTransition(last, run.id)
    if not isinstance(state, (lc.Running, lc.Placing)) or lc.parked(state):
        check_change(change, run.id, run.task, has_reference_model(run.task, defaults))
        return False
    if isinstance(state, lc.Placing):
        again = f"run {run.id!r} is being placed on a trainer again; try again in a moment"
        raise TrainerUnavailable(again, run.id)
    return True


async def tell_job(
    connector: TrainerConnector,
    trainer: str,
    run_id: str,
    change: Hyperparameters,
    timeout: float,
) -> None:
    """Sends ``change`` to the run's job on ``trainer`` (it applies from its next optimizer
    step).

    Raises:
        InvalidRequest: the job refused a value.
        IllegalTransition: the job has trained its last episode.
        TrainerUnavailable: the trainer did not take it.
    """
    what = f"cannot change the hyperparameters of run {run_id!r}"
    try:
        await connector.set_hyperparameters(trainer, run_id, change, timeout)
    except TrainerRefused as exc:
        raise InvalidRequest(f"{what}: {exc.user_message}", exc.violations, run_id) from None
    except TrainerJobFinished:
        raise IllegalTransition(
            f"{what}: its trainer has trained its last episode", run_id
        ) from None
    except TrainerError as exc:
        raise TrainerUnavailable(
            f"run {run_id!r}: its trainer {trainer} did not take the new hyperparameters "
            f"({exc}); try again",
            run_id,
        ) from None
