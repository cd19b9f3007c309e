"""Builds TRL's GRPOTrainer for a job: model, processor, lazy dataset, precision and seeds.

:func:`build_trainer` loads everything a job needs (errors surface as :class:`ProviderError`
with a plain message) and returns a :class:`LazyGRPOTrainer`, ready to train; every rank of a
job (:mod:`.worker`) builds it the same way.

Data path: ``datasets.Dataset.from_dict({"_i": range(n)}).with_transform(RowTransform(lazy))`` —
TRL accepts only ``datasets`` datasets, and this one holds nothing but indices, so images are
decoded lazily, per batch, in the DataLoader workers (see :mod:`.lazy_images`). Opening the
dataset parses no row.

Seeding: ``config.seed`` seeds Python, NumPy and torch before the model is loaded and is TRL's
``seed``/``data_seed`` (the ``RepeatSampler`` index stream and sampling during generation). The
training DataLoader draws its worker seeds from a generator of its own, so the number of
workers does not change the stream: 0 and N workers train on the same rows and sample the same
completions, epoch after epoch.

LoRA (``GrpoTask.lora``, :mod:`.lora`): the model loaded is the task's base model, and TRL wraps
it with the job's adapters (``peft_config``), so that its reference (beta above 0) is that base
model with the adapters disabled. Gradient checkpointing is the task's switch (:mod:`.settings`);
with adapters TRL makes the inputs require gradients, which checkpointed frozen layers need.

Resuming (``job.resume``): the weights come from the checkpoint's ``model/`` (every tensor of
the model, none left over, or :class:`CheckpointUnusable`; a LoRA job loads its base model from
the task and every adapter tensor from the checkpoint), the processor from the task's model;
``LazyGRPOTrainer.train(resume_from_checkpoint=<checkpoint>/trainer)`` then restores the rest
the way ``Trainer`` does (see :mod:`.checkpoint`), any file that does not load being
:class:`CheckpointUnusable` too. Each epoch's order depends on the epoch alone
(:mod:`.sampler`), so the resumed job trains on the rows the uninterrupted one would have.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    PrinterCallback,
    ProcessorMixin,
    set_seed,
)
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from trainer_service.core.provider import CheckpointUnusable, ProviderError, TrainJob
from trainer_service.providers.grpo import checkpoint, lora
from trainer_service.providers.grpo import checkpoint_files as files
from trainer_service.providers.grpo.lazy_images import (
    Columns,
    LazyImageDataset,
    RowTransform,
    resolve_cache_dir,
)
from trainer_service.providers.grpo.library_output import WorkerLogging, route_library_output
from trainer_service.providers.grpo.lifeline import WorkerWatchdog
from trainer_service.providers.grpo.loader_parts import WorkerSeed, collate_rows
from trainer_service.providers.grpo.reward_modules import (
    RewardFunction,
    RewardModuleError,
    load_reward_modules,
)
from trainer_service.providers.grpo.rewards import CompletionTap, build_reward_functions
from trainer_service.providers.grpo.sampler import EpochSampler
from trainer_service.providers.grpo.settings import Settings, training_args
from trainer_service.providers.grpo.step_metrics import CudaMemory, StepMeter
from trainer_service.providers.grpo.validation import resolve_in_roots


def _resolve(job: TrainJob, requested: str, what: str) -> pathlib.Path:
    path = resolve_in_roots(job.data_roots, requested)
    if path is None:  # validate() rejects these first; re-checked in case the tree changed
        raise ProviderError(
            f"The {what} path {requested!r} leads outside the trainer's data roots.",
            code="INVALID_ARGUMENT",
            reason="PATH_OUTSIDE_ROOT",
        )
    return path


def load_dataset(job: TrainJob, provenance_key: str | None = None) -> LazyImageDataset:
    """Opens the task's dataset lazily (no row is parsed, no image decoded here): a JSONL file,
    a ``.parquet`` file or a ``save_to_disk`` directory, with the task's column names.

    Raises:
        ProviderError: Missing or unreadable dataset, one without rows, or one whose schema
            lacks a column the task names. Bad rows are reported when read (see :mod:`.rows`).
    """
    task = job.task.grpo
    path = _resolve(job, task.dataset_path, "dataset")
    if not path.exists():
        raise ProviderError(
            f"The dataset file {task.dataset_path!r} was not found on the trainer.",
            detail=str(path),
            reason="DATASET_NOT_FOUND",
        )
    columns = task.columns
    return LazyImageDataset.open(
        path,
        data_root=job.data_roots,
        cache_dir=resolve_cache_dir(job.image_cache_dir),
        provenance_key=provenance_key,
        columns=Columns(columns.prompt, columns.images, columns.solution),
    )


def load_rewards(job: TrainJob) -> dict[str, RewardFunction]:
    """The reward functions of the trainer's reward modules (imported in this process).

    Raises:
        ProviderError: A module that imported in the trainer does not import here.
    """
    try:
        return load_reward_modules(job.reward_modules)
    except RewardModuleError as exc:
        raise ProviderError(
            "The trainer's reward modules could not be imported in the training process.",
            detail=str(exc),
            code="INTERNAL",
            reason="REWARD_MODULE_FAILED",
        ) from exc


def task_model_dir(job: TrainJob) -> pathlib.Path:
    """The task's model directory, resolved in the data roots.

    Raises:
        ProviderError: It is outside them, or not a directory.
    """
    task = job.task.grpo
    path = _resolve(job, task.model_path, "model")
    if not path.is_dir():
        raise ProviderError(
            f"The model directory {task.model_path!r} was not found on the trainer.",
            detail=str(path),
            reason="MODEL_NOT_FOUND",
        )
    return path


def load_model(job: TrainJob, dtype: torch.dtype) -> tuple[Any, ProcessorMixin]:
    """Loads the vision-language model and its processor from local files only (the weights
    from ``job.resume``'s checkpoint when it has one, unless the job trains LoRA adapters: then
    the task's model is the base, and the adapter is loaded once TRL wrapped it).

    Raises:
        ProviderError: Missing directory, unloadable files, or not a vision-language model.
        CheckpointUnusable: The checkpoint's weights do not load into the task's model.
    """
    task = job.task.grpo
    path = task_model_dir(job)
    try:
        processor = AutoProcessor.from_pretrained(
            path, local_files_only=True, padding_side="left", truncation_side="left"
        )
        model = None
        if job.resume is None or task.HasField("lora"):
            model = AutoModelForImageTextToText.from_pretrained(
                path, local_files_only=True, dtype=dtype
            )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ProviderError(
            f"The model in {task.model_path!r} could not be loaded.",
            detail=f"{path}: {type(exc).__name__}: {exc}",
            reason="MODEL_UNLOADABLE",
        ) from exc
    if (
        not isinstance(processor, ProcessorMixin)
        or getattr(processor, "image_processor", None) is None
    ):
        raise ProviderError(
            f"The model in {task.model_path!r} is not a vision-language model (it has no image "
            "processor); the grpo provider trains on image+text rows.",
            detail=f"{path}: processor {type(processor).__name__}",
            reason="MODEL_NOT_MULTIMODAL",
        )
    if model is None:
        assert job.resume is not None
        model = _restored_model(job.resume.directory / files.MODEL_DIR, dtype)
    return model, processor


def _restored_model(model_dir: pathlib.Path, dtype: torch.dtype) -> Any:
    """The checkpoint's model, every tensor loaded from it (``from_pretrained`` alone would
    leave a missing or misnamed tensor at its initial value and only warn).

    Raises:
        CheckpointUnusable: It does not load, or not every tensor fits.
    """
    try:
        loaded: Any = AutoModelForImageTextToText.from_pretrained(
            model_dir, local_files_only=True, dtype=dtype, output_loading_info=True
        )
        model, info = loaded
    except Exception as exc:  # safetensors, JSON and shape errors alike: the files are bad
        raise CheckpointUnusable(f"its model does not load ({type(exc).__name__}: {exc})") from exc
    misfits = {
        kind: list(info.get(kind) or ())
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if any(misfits.values()):
        raise CheckpointUnusable(f"its weights do not fit the model: {misfits}")
    return model


class LazyGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with a reproducible, quiet training DataLoader, holding its lazy dataset, and
    checkpoints that resume at their step with the same rows.

    Reproducible: a ``DataLoader`` draws a base seed for its workers each time it makes an
    iterator, from the process-wide torch RNG unless it has a ``generator``. Loading inline,
    it makes a new iterator every epoch; with persistent workers it makes one and resets it.
    Those extra draws would move the global RNG, which also drives completion sampling, so 0
    and 2 workers would sample different completions from the first step of epoch 2 on. With a
    generator of its own (seeded from ``seed``) the loader leaves the global RNG alone in both
    modes. Each epoch's order is the sampler's for that epoch (:class:`.sampler.EpochSampler`).

    Quiet: workers set their logging up like the trainer's (:class:`WorkerLogging`).

    Light workers: a rank's workers fork from it (:func:`.settings.worker_start_method`); where
    they start from a fork server instead, the loader's collate and worker-seeding functions are
    :mod:`.loader_parts`' (not TRL's and transformers'), so a worker imports only what its fork
    server holds.

    Checkpoints: :meth:`save_checkpoint` (:mod:`.checkpoint`); resuming is
    ``train(resume_from_checkpoint=<checkpoint>/trainer)`` on a trainer built for
    ``job.resume`` (see the module docstring).

    Attributes:
        lazy_dataset: The rows behind ``train_dataset``.
        model_fingerprint: The task model's fingerprint (``checkpoint_files``).
        model_path: The task's model path as it named it (a LoRA checkpoint records its base).
        update_steps_per_epoch: Optimizer steps in one pass over the data (once the training
            DataLoader exists).
    """

    lazy_dataset: LazyImageDataset | None = None
    model_fingerprint: str = ""
    model_path: str = ""
    update_steps_per_epoch: int = 0
    #: Times each generation (seconds and completion tokens; :mod:`.step_metrics`).
    step_meter: StepMeter | None = None

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        completion_ids, *rest = super()._generate_single_turn(*args, **kwargs)
        if self.step_meter is not None:
            tokens = sum(len(ids) for ids in completion_ids)
            self.step_meter.generated(time.perf_counter() - started, tokens)
        return (completion_ids, *rest)

    def _get_train_sampler(self, dataset: Any = None) -> EpochSampler:
        sampler = super()._get_train_sampler(dataset)
        assert isinstance(sampler, RepeatSampler)
        return EpochSampler(sampler)

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        generator = torch.Generator()
        generator.manual_seed(self.args.seed)
        # accelerate wraps the torch DataLoader; its __iter__ uses the wrapped one's generator.
        base = getattr(loader, "base_dataloader", loader)
        base.generator = generator
        base.collate_fn = collate_rows
        if base.num_workers > 0:
            # In a job's process group, workers also exit when their rank is gone (lifeline).
            seed = WorkerSeed(base.num_workers, self.args.process_index)
            base.worker_init_fn = WorkerWatchdog.wrap(WorkerLogging.like_this_process(seed))
        accumulation = self.args.gradient_accumulation_steps
        self.update_steps_per_epoch = max(1, -(-len(loader) // accumulation))
        return loader

    def save_checkpoint(
        self, directory: pathlib.Path, best_reward: float | None, last_reward: float | None
    ) -> int:
        """Writes a checkpoint of the current step (every rank calls it; see
        :func:`.checkpoint.save`); returns the bytes written."""
        extra = {
            "best_reward": best_reward,
            "last_reward": last_reward,
            "model_fingerprint": self.model_fingerprint,
            "model_path": self.model_path,
        }
        return checkpoint.save(self, directory, extra)

    # -- live hyperparameters ---------------------------------------------------------------

    def set_hyperparameters(
        self,
        learning_rate: float | None = None,
        temperature: float | None = None,
        beta: float | None = None,
    ) -> None:
        """Trains the next step with these values (``None``: unchanged); called at a step
        boundary, on every rank alike.

        The learning rate is the peak of the schedule: the scheduler's base rates move, and
        the optimizer's rates become base x the schedule's current factor, so the decay goes
        on from the new peak. The temperature changes sampling and the temperature the fused
        LM head divides the logits by when it scores completions (policy and reference).
        """
        if learning_rate is not None:
            set_learning_rate(self.optimizer, self.lr_scheduler, learning_rate)
        if temperature is not None:
            self.temperature = temperature
            generation_config = getattr(self, "generation_config", None)
            if generation_config is not None:
                generation_config.temperature = temperature
            generation_kwargs = getattr(self, "generation_kwargs", None)
            if generation_kwargs is not None:
                generation_kwargs["temperature"] = temperature
            policy = self.accelerator.unwrap_model(self.model)
            if lora.is_lora(policy):  # TRL fused the head of the model under the adapters
                policy = policy.get_base_model()
            for model in (policy, self.ref_model):
                if model is not None:
                    set_fused_head_temperature(model, temperature)
        if beta is not None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            if beta > 0 and self.ref_model is None and not lora.is_lora(unwrapped):
                # The trainer refuses this before it reaches a rank (hyperparameters.py).
                raise ValueError("beta > 0 needs a reference model, and this job has none")
            self.beta = beta

    def sampling_hyperparameters(self) -> dict[str, float]:
        """The temperature and beta the next step uses (the episode metrics)."""
        return {"temperature": float(self.temperature), "beta": float(self.beta)}

    def live_hyperparameters(self) -> dict[str, float]:
        """Every live hyperparameter (the learning rate as the schedule's peak), as a
        checkpoint records them."""
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        base_lrs = getattr(scheduler, "base_lrs", None)
        optimizer = self.optimizer
        assert optimizer is not None, "called once training started"
        rate = base_lrs[0] if base_lrs else optimizer.param_groups[0]["lr"]
        return {"learning_rate": float(rate), **self.sampling_hyperparameters()}

    # -- resuming ----------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights were loaded from the checkpoint's model/ when this trainer was built,
        # strictly (Trainer's own load would accept missing tensors with a warning).
        return

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except Exception as exc:
            raise CheckpointUnusable(
                f"its optimizer or scheduler state does not load ({type(exc).__name__}: {exc})"
            ) from exc
        if checkpoint is not None:
            # The states bring the learning rate the checkpoint was written with; the task's
            # is the run's now (changed while it was parked, or a fork's).
            set_learning_rate(self.optimizer, self.lr_scheduler, self.args.learning_rate)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        try:
            super()._load_rng_state(checkpoint)
        except Exception as exc:
            raise CheckpointUnusable(
                f"its RNG state does not load ({type(exc).__name__}: {exc})"
            ) from exc


def set_learning_rate(optimizer: Any, lr_scheduler: Any, learning_rate: float) -> None:
    """Makes ``learning_rate`` the peak of a running schedule: a ``LambdaLR`` (Trainer's
    schedules) gets it as its base rates and the optimizer base x its current factor; any other
    scheduler leaves the optimizer's rates at ``learning_rate``. Rates already equal are left
    alone (a resumed run continues bit for bit)."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate wraps it
    groups = optimizer.param_groups
    lambdas = getattr(scheduler, "lr_lambdas", None)
    base_lrs = getattr(scheduler, "base_lrs", None)
    if lambdas is None or base_lrs is None:
        for group in groups:
            group["lr"] = learning_rate
        return
    if all(base == learning_rate for base in base_lrs):
        return
    scheduler.base_lrs = [learning_rate] * len(base_lrs)
    for group, factor in zip(groups, lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def set_fused_head_temperature(model: Any, temperature: float) -> None:
    """Sets the temperature TRL's fused LM head divides the logits by (``add_fused_lm_head``
    keeps it in the patched ``forward``'s closure; without a fused head there is nothing to
    set).

    Raises:
        RuntimeError: The model's forward is TRL's fused one but holds no temperature (a TRL
            this code does not know).
    """
    forward = getattr(model, "forward", None)
    function = getattr(forward, "__func__", forward)
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != "_fused_forward":
        return
    closure = getattr(function, "__closure__", None)
    if "temperature" not in code.co_freevars or closure is None:
        raise RuntimeError("TRL's fused LM head keeps its temperature out of reach")
    closure[code.co_freevars.index("temperature")].cell_contents = temperature


def world_size() -> int:
    """Processes training together: torch.distributed's world size, 1 when not initialised."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return 1


def use_cuda_device(device: str) -> None:
    """Makes ``cuda:N`` the calling thread's current device (Trainer places the model there)."""
    index = torch.device(device).index
    if index is not None:
        torch.cuda.set_device(index)


def _precision(device: str) -> tuple[bool, bool, torch.dtype]:
    """(use_cpu, bf16, load dtype) for a job device string."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ProviderError(
                "This trainer has no usable GPU.", detail=f"device {device!r}", code="UNAVAILABLE"
            )
        use_cuda_device(device)
        bf16 = torch.cuda.is_bf16_supported()
        # Mixed precision keeps fp32 master weights; autocast does the bf16 compute.
        return False, bf16, torch.float32
    torch.set_num_threads(1)  # a small box stalls badly with more
    return True, False, torch.float32


def build_trainer(
    job: TrainJob,
    callbacks: Sequence[Any] = (),
    *,
    output_dir: str,
    tap: CompletionTap | None = None,
    provenance_key: str | None = None,
) -> LazyGRPOTrainer:
    """Loads everything and builds the GRPOTrainer for ``job`` (does not train).

    Args:
        job: The job.
        callbacks: Extra trainer callbacks (the streaming callback).
        output_dir: Trainer scratch directory (nothing is saved there: ``save_strategy="no"``;
            checkpoints go where the job says, see :meth:`LazyGRPOTrainer.save_checkpoint`).
        tap: Receives each scored batch (every reward function is tapped).
        provenance_key: Passed to :class:`LazyImageDataset` (diagnostics and tests).

    Raises:
        ProviderError: The model or dataset cannot be used.
        CheckpointUnusable: ``job.resume``'s weights do not load.
    """
    route_library_output()  # before any model or dataset code draws a bar or warns
    custom_rewards = load_rewards(job)  # before seeding: the modules' imports may draw numbers
    use_cpu, bf16, dtype = _precision(job.device)
    set_seed(job.config.seed)
    job.set_phase("loading dataset")
    lazy = load_dataset(job, provenance_key=provenance_key)
    settings = Settings.from_task(job.task.grpo, rows=len(lazy), processes=world_size())
    lazy.set_memo_rows(settings.memo_rows)
    job.set_phase("loading model")
    model, processor = load_model(job, dtype)
    train_dataset = Dataset.from_dict({"_i": list(range(len(lazy)))}).with_transform(
        RowTransform(lazy)
    )
    reward_funcs: list[Any] = list(
        build_reward_functions(
            settings.reward_functions, settings.max_completion_length, tap, custom_rewards
        )
    )
    args = training_args(job, settings, output_dir, use_cpu, bf16)
    peft_config = lora.lora_config(settings.lora, model) if settings.lora is not None else None
    try:
        with lora.quiet_wrapping():
            trainer = LazyGRPOTrainer(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                processing_class=processor,
                callbacks=list(callbacks),
                peft_config=peft_config,
            )
    except (ValueError, TypeError) as exc:
        raise ProviderError(
            "The GRPO settings do not fit this model or dataset.",
            detail=f"{type(exc).__name__}: {exc}",
            code="INVALID_ARGUMENT",
            reason="BAD_SETTINGS",
        ) from exc
    # With tqdm off, Trainer prints every log dict to stdout; episodes carry the metrics instead.
    trainer.remove_callback(PrinterCallback)
    trainer.lazy_dataset = lazy
    trainer.step_meter = StepMeter(memory=None if use_cpu else CudaMemory(job.device))
    if tap is not None:
        tap.set_weights(trainer.reward_weights.tolist())
    trainer.model_fingerprint = files.model_fingerprint(task_model_dir(job))
    trainer.model_path = job.task.grpo.model_path
    if peft_config is not None and job.resume is not None:
        lora.load_adapter(trainer.model, job.resume.directory / files.MODEL_DIR)
    return trainer
