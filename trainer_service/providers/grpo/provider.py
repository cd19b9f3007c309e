"""The ``grpo`` provider's training run: model and data loading, GRPOTrainer, episode streaming.

:func:`run` is a generator. It loads the model, processor and lazy dataset in the calling thread
(errors surface as :class:`ProviderError` with a plain message), then runs
``GRPOTrainer.train()`` in a worker thread and yields the episodes that
:class:`~.callback.StreamingCallback` hands over, one per optimizer step, as steps complete.
Closing the generator (the consumer went away) or setting ``job.stop_event`` stops training after
the current step; the worker thread is always joined before the generator returns.

Data path: ``datasets.Dataset.from_dict({"_i": range(n)}).with_transform(RowTransform(lazy))`` —
TRL accepts only ``datasets`` datasets, and this one holds nothing but indices, so images are
decoded lazily, per batch, in the DataLoader workers (see :mod:`.lazy_images`). Opening the
dataset parses no row; while training starts, a background thread checks every row and fails
the job (naming the line and image) if one is bad.

Seeding: ``config.seed`` seeds Python, NumPy and torch before the model is loaded and is TRL's
``seed``/``data_seed`` (the ``RepeatSampler`` index stream and sampling during generation). The
training DataLoader draws its worker seeds from a generator of its own, so the number of
workers does not change the stream: 0 and N workers train on the same rows and sample the same
completions, epoch after epoch.

Defaults (``DEFAULT_*``): the settings that make the offline tiny VLM learn a colour question in
under 200 steps on a CPU (``bench/grpo_learning.py``); see the README for why each is what it is.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import pathlib
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
from trl import GRPOConfig, GRPOTrainer

from trainer_service.core.provider import EpisodeCounter, ProviderError, TrainJob
from trainer_service.providers.grpo.callback import EpisodeHandoff, StreamingCallback, _End
from trainer_service.providers.grpo.lazy_images import (
    DatasetError,
    LazyImageDataset,
    RowTransform,
    resolve_cache_dir,
)
from trainer_service.providers.grpo.library_output import WorkerLogging, route_library_output
from trainer_service.providers.grpo.lifeline import WorkerWatchdog
from trainer_service.providers.grpo.rewards import CompletionTap, build_reward_functions
from trainer_service.providers.grpo.validation import resolve_under_root
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

# The defaults are the settings that learn (README, "GRPO that learns"; measured by
# bench/grpo_learning.py): a user who sets only model, dataset, reward and steps sees learning.
DEFAULT_NUM_GENERATIONS = 8
#: Prompts per optimizer step when batch_size is 0 (batch = this x num_generations).
DEFAULT_PROMPTS_PER_STEP = 16
DEFAULT_MAX_COMPLETION_LENGTH = 16
DEFAULT_LEARNING_RATE = 3e-3
DEFAULT_TEMPERATURE = 1.0
DEFAULT_NUM_WORKERS = 2
#: What a user reads when a GPU ran out of memory.
OUT_OF_MEMORY_ADVICE = (
    "The GPU ran out of memory; try a smaller batch_size or max_completion_length."
)
# Largest memo: rows of one generation batch; capped so big batches of big images stay bounded.
_MAX_MEMO_ROWS = 64


@dataclass(frozen=True)
class Settings:
    """A GrpoTask with its defaults applied (see ``GrpoTask`` in episode.proto)."""

    reward_functions: tuple[str, ...]
    num_generations: int
    batch_size: int
    max_completion_length: int
    learning_rate: float
    beta: float
    temperature: float
    gradient_accumulation_steps: int
    num_workers: int
    prefetch_factor: int | None

    @classmethod
    def from_task(
        cls, task: episode_pb2.GrpoTask, rows: int | None = None, processes: int = 1
    ) -> Settings:
        """Applies the proto's documented defaults.

        Args:
            task: The task.
            rows: The dataset's row count, when known. A step's prompts are distinct rows, so
                the default batch takes at most ``rows`` of them (across all processes).
            processes: Processes training together; ``batch_size`` is per process.

        Raises:
            ProviderError: A batch_size the task sets needs more distinct rows than ``rows``.
        """
        generations = task.num_generations or DEFAULT_NUM_GENERATIONS
        accumulation = task.gradient_accumulation_steps or 1
        processes = max(1, processes)
        prompts = DEFAULT_PROMPTS_PER_STEP
        if rows is not None and not task.batch_size:
            prompts = max(1, min(prompts, rows // (accumulation * processes)))
        batch_size = task.batch_size or prompts * generations
        needed = batch_size * accumulation * processes // generations
        if rows is not None and needed > rows:
            across = f" x {processes} processes" if processes > 1 else ""
            raise ProviderError(
                f"Each step samples {needed} distinct dataset rows (batch_size {batch_size} x "
                f"gradient_accumulation_steps {accumulation}{across} / num_generations "
                f"{generations}), but the dataset has {rows}.",
                code="INVALID_ARGUMENT",
                reason="BAD_SETTINGS",
            )
        workers = (
            task.dataloader_num_workers
            if task.HasField("dataloader_num_workers")
            else DEFAULT_NUM_WORKERS
        )
        prefetch = (
            task.dataloader_prefetch_factor
            if task.HasField("dataloader_prefetch_factor") and workers > 0
            else None
        )
        return cls(
            reward_functions=tuple(task.reward_functions),
            num_generations=generations,
            batch_size=batch_size,
            max_completion_length=task.max_completion_length or DEFAULT_MAX_COMPLETION_LENGTH,
            learning_rate=task.learning_rate or DEFAULT_LEARNING_RATE,
            beta=task.beta if task.HasField("beta") else 0.0,
            temperature=task.temperature or DEFAULT_TEMPERATURE,
            gradient_accumulation_steps=accumulation,
            num_workers=workers,
            prefetch_factor=prefetch,
        )

    @property
    def memo_rows(self) -> int:
        """Distinct rows in one generation batch (the memo size that decodes each row once)."""
        unique = self.batch_size * self.gradient_accumulation_steps // self.num_generations
        return max(1, min(_MAX_MEMO_ROWS, unique))


def _resolve(job: TrainJob, relative: str, what: str) -> pathlib.Path:
    path = resolve_under_root(job.data_root, relative)
    if path is None:  # validate() rejects these first; re-checked in case the tree changed
        raise ProviderError(
            f"The {what} path {relative!r} leads outside the trainer's data root.",
            code="INVALID_ARGUMENT",
            reason="PATH_OUTSIDE_ROOT",
        )
    return path


def load_dataset(job: TrainJob, provenance_key: str | None = None) -> LazyImageDataset:
    """Opens the task's JSONL dataset lazily (no row is parsed, no image decoded here).

    Raises:
        ProviderError: Missing or unreadable file, or one without rows. Bad rows are reported
            when read (see :mod:`.rows`).
    """
    task = job.task.grpo
    path = _resolve(job, task.dataset_path, "dataset")
    if not path.is_file():
        raise ProviderError(
            f"The dataset file {task.dataset_path!r} was not found on the trainer.",
            detail=str(path),
            reason="DATASET_NOT_FOUND",
        )
    return LazyImageDataset.from_jsonl(
        path,
        data_root=job.data_root,
        cache_dir=resolve_cache_dir(job.image_cache_dir),
        provenance_key=provenance_key,
    )


def load_model(job: TrainJob, dtype: torch.dtype) -> tuple[Any, ProcessorMixin]:
    """Loads the vision-language model and its processor from local files only.

    Raises:
        ProviderError: Missing directory, unloadable files, or not a vision-language model.
    """
    task = job.task.grpo
    path = _resolve(job, task.model_path, "model")
    if not path.is_dir():
        raise ProviderError(
            f"The model directory {task.model_path!r} was not found on the trainer.",
            detail=str(path),
            reason="MODEL_NOT_FOUND",
        )
    try:
        processor = AutoProcessor.from_pretrained(
            path, local_files_only=True, padding_side="left", truncation_side="left"
        )
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
    return model, processor


# Modules the DataLoader workers need, imported once in the fork server rather than per worker.
_WORKER_PRELOAD = ["torch", "datasets", "PIL.Image", "trainer_service.providers.grpo.lazy_images"]


def worker_start_method() -> str | None:
    """How DataLoader workers start: ``forkserver`` where available, else the platform default.

    Never plain ``fork``: the trainer is a gRPC server, and forking a process with live gRPC
    (and torch) threads can crash the child (seen here: workers died with SIGSEGV). The fork
    server is a fresh interpreter with no such threads; workers fork from it.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    multiprocessing.get_context("forkserver").set_forkserver_preload(_WORKER_PRELOAD)
    return "forkserver"


def training_args(
    job: TrainJob, settings: Settings, output_dir: str, use_cpu: bool, bf16: bool
) -> GRPOConfig:
    """TRL's config for the job (one optimizer step per episode, logged every step)."""
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=job.config.max_episodes,
        per_device_train_batch_size=settings.batch_size,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate,
        beta=settings.beta,
        temperature=settings.temperature,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        dataloader_num_workers=settings.num_workers,
        dataloader_prefetch_factor=settings.prefetch_factor,
        # Workers outlive an epoch: no re-fork (and no cold memo) every pass over a small set.
        dataloader_persistent_workers=settings.num_workers > 0,
        dataloader_multiprocessing_context=(
            worker_start_method() if settings.num_workers > 0 else None
        ),
        seed=job.config.seed,
        data_seed=job.config.seed,
        use_cpu=use_cpu,
        bf16=bf16,
        # transformers 5 renamed gradient checkpointing; TRL's default (True) would use the alias.
        gradient_checkpointing=False,
        activation_checkpointing=not use_cpu,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )


class LazyGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with a reproducible, quiet training DataLoader, holding its lazy dataset.

    Reproducible: a ``DataLoader`` draws a base seed for its workers each time it makes an
    iterator, from the process-wide torch RNG unless it has a ``generator``. Loading inline,
    it makes a new iterator every epoch; with persistent workers it makes one and resets it.
    Those extra draws moved the global RNG, which also drives completion sampling, so 0 and 2
    workers sampled different completions from the first step of epoch 2 on. With a generator
    of its own (seeded from ``seed``) the loader leaves the global RNG alone in both modes.

    Quiet: workers set their logging up like the trainer's (:class:`WorkerLogging`).

    Attributes:
        lazy_dataset: The rows behind ``train_dataset``.
    """

    lazy_dataset: LazyImageDataset | None = None

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        generator = torch.Generator()
        generator.manual_seed(self.args.seed)
        # accelerate wraps the torch DataLoader; its __iter__ uses the wrapped one's generator.
        base = getattr(loader, "base_dataloader", loader)
        base.generator = generator
        if base.num_workers > 0:
            # In a job's process group, workers also exit when their rank is gone (lifeline).
            base.worker_init_fn = WorkerWatchdog.wrap(
                WorkerLogging.like_this_process(base.worker_init_fn)
            )
        return loader


def world_size() -> int:
    """Processes training together: torch.distributed's world size, 1 when not initialised."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return 1


def _use_cuda_device(device: str) -> None:
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
        _use_cuda_device(device)
        bf16 = torch.cuda.is_bf16_supported()
        # Mixed precision keeps fp32 master weights; autocast does the bf16 compute.
        return False, bf16, torch.float32
    torch.set_num_threads(1)  # a small box stalls badly with more (measured on 2 cores)
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
        output_dir: Trainer scratch directory (nothing is saved there: ``save_strategy="no"``).
        tap: Receives each scored batch's completions.
        provenance_key: Passed to :class:`LazyImageDataset` (diagnostics and tests).

    Raises:
        ProviderError: The model or dataset cannot be used.
    """
    route_library_output()  # before any model or dataset code draws a bar or warns
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
        build_reward_functions(settings.reward_functions, settings.max_completion_length, tap)
    )
    args = training_args(job, settings, output_dir, use_cpu, bf16)
    try:
        trainer = LazyGRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processor,
            callbacks=list(callbacks),
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
    return trainer


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` and yields one episode per optimizer step as steps complete.

    Raises:
        ProviderError: Model/dataset problems (plain user messages) and bad image rows.
    """
    counter = EpisodeCounter(job.config.max_episodes)
    handoff = EpisodeHandoff()
    tap = CompletionTap()
    callback = StreamingCallback(counter, handoff, job.stop_event, tap)
    with tempfile.TemporaryDirectory(prefix=f"grpo-{job.run_id}-") as scratch:
        # Held in a dict so the finally below can drop the last reference (GPU memory).
        held = {"trainer": build_trainer(job, [callback], output_dir=scratch, tap=tap)}
        if job.stop_event.is_set():
            return
        job.set_phase("training")

        def train() -> None:
            try:
                if job.device.startswith("cuda"):
                    _use_cuda_device(job.device)
                else:
                    torch.set_num_threads(1)
                held["trainer"].train()
            except BaseException as exc:  # handed to the consumer, which re-raises it
                handoff.finish(exc)
            else:
                handoff.finish()

        lazy = held["trainer"].lazy_dataset
        scan_stop = threading.Event()

        def check_rows() -> None:
            # The first batch does not wait for this; a bad row anywhere still fails the job
            # within seconds rather than when training first reads it.
            try:
                checked = lazy.check_rows(scan_stop) if lazy is not None else 0
            except DatasetError as exc:
                handoff.finish(exc)
            else:
                _LOGGER.debug("run %s: %d dataset rows checked", job.run_id, checked)

        worker = threading.Thread(target=train, name=f"grpo-{job.run_id}", daemon=True)
        scanner = threading.Thread(target=check_rows, name=f"grpo-rows-{job.run_id}", daemon=True)
        worker.start()
        scanner.start()
        _LOGGER.info("run %s: GRPO training started (%d steps)", job.run_id, counter.max_episodes)
        try:
            while True:
                item = handoff.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise translate_error(item.error) from item.error
                    break
                yield item
        finally:
            scan_stop.set()
            handoff.close()
            worker.join()
            scanner.join()
            held.clear()
            if job.device.startswith("cuda"):
                gc.collect()  # model and optimizer sit in reference cycles
                torch.cuda.empty_cache()
            _LOGGER.info(
                "run %s: GRPO training ended after %d steps", job.run_id, callback.last_step
            )
        if not counter.finished and not job.stop_event.is_set():
            raise ProviderError(
                "Training ended before the requested number of steps.",
                detail=f"{counter.episode} of {counter.max_episodes} steps",
                code="INTERNAL",
                reason="ENDED_EARLY",
            )


def translate_error(error: BaseException) -> BaseException:
    """Turns a training failure into what the consumer should see: a ``ProviderError`` with a
    plain message where one is known (a dataset row, running out of memory), else ``error``."""
    if isinstance(error, DatasetError) and "Original Traceback" in error.user_message:
        # Raised in a DataLoader worker: torch re-raised it with the worker's traceback as the
        # message. The user gets the original message (its last line); the log gets the rest.
        last = error.user_message.strip().splitlines()[-1]
        message = last.split("DatasetError: ", 1)[-1]
        return DatasetError(message, detail=error.user_message)
    if isinstance(error, ProviderError):
        return error
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return ProviderError(
            OUT_OF_MEMORY_ADVICE,
            detail=str(error),
            code="RESOURCE_EXHAUSTED",
            reason="OUT_OF_MEMORY",
        )
    if isinstance(error, MemoryError):
        return ProviderError(
            "The training process ran out of memory; try a smaller batch_size or "
            "max_completion_length.",
            detail=f"MemoryError: {error}",
            code="RESOURCE_EXHAUSTED",
            reason="OUT_OF_MEMORY",
        )
    return error
