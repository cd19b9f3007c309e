"""The ``grpo`` provider's settings: a task with its defaults applied, mapped onto TRL's config.

:class:`Settings` applies ``GrpoTask``'s documented defaults (and fits the default batch to the
dataset and the number of processes); :func:`training_args` turns a job and its settings into
TRL's ``GRPOConfig``, with the DataLoader workers started by :func:`worker_start_method`.

Defaults (``DEFAULT_*``): the settings that make the offline tiny VLM learn a colour question in
under 200 steps on a CPU (``bench/grpo_learning.py``; LoRA: ``bench/grpo_lora.py``), set in
:mod:`trainer_service.providers.defaults`; see the README for why each is what it is.

Gradient checkpointing is the task's switch (``GrpoTask.gradient_checkpointing``), off by
default on every device: it trades about a fifth more step time for activation memory, which
only pays when a batch does not fit otherwise, and a default that depended on the device would
make the same task train at different speeds for no reason a user can see.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from dataclasses import dataclass

from trl import GRPOConfig

from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.defaults import GRPO
from trainer_service.providers.grpo.hyperparameters import (
    DEFAULT_TEMPERATURE,
    default_learning_rate,
    initial_beta,
)
from trainwire.v1 import episode_pb2

# The defaults are the settings that learn (README, "GRPO that learns"; measured by
# bench/grpo_learning.py): a user who sets only model, dataset, reward and steps sees learning.
DEFAULT_NUM_GENERATIONS = GRPO.num_generations
#: Prompts per optimizer step when batch_size is 0 (batch = this x num_generations).
DEFAULT_PROMPTS_PER_STEP = GRPO.prompts_per_step
DEFAULT_MAX_COMPLETION_LENGTH = GRPO.max_completion_length
DEFAULT_NUM_WORKERS = GRPO.dataloader_num_workers
# Largest memo: rows of one generation batch; capped so big batches of big images stay bounded.
_MAX_MEMO_ROWS = 64
#: LoRA rank when ``LoraConfig.rank`` is 0, and the largest allowed.
DEFAULT_LORA_RANK = GRPO.lora.rank
MAX_LORA_RANK = 256


@dataclass(frozen=True)
class LoraSettings:
    """A ``LoraConfig`` with its defaults applied (see ``LoraConfig`` in episode.proto).

    Attributes:
        rank: The adapters' rank, 1..256 (0 in the task: 16).
        alpha: The scaling alpha, > 0 (0 in the task: 2 x rank).
        dropout: Dropout on the adapters' input, in [0, 1).
        target_modules: Module names as peft matches them (a name or a dotted suffix); empty:
            every linear layer of the language model, found in the loaded model
            (:func:`.lora.language_model_linears`).
    """

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def from_task(cls, task: episode_pb2.GrpoTask) -> LoraSettings | None:
        """The task's LoRA settings; ``None`` for full fine-tuning (``lora`` unset).

        Raises:
            ProviderError: A value out of range (``INVALID_ARGUMENT`` naming the field; the
                request checks refuse these first).
        """
        if not task.HasField("lora"):
            return None
        lora = task.lora
        rank = lora.rank or DEFAULT_LORA_RANK
        problems = []
        if not 1 <= rank <= MAX_LORA_RANK:
            problems.append(f"task.grpo.lora.rank {lora.rank}: need 1..{MAX_LORA_RANK}")
        if lora.alpha != 0 and not (math.isfinite(lora.alpha) and lora.alpha > 0):
            problems.append(f"task.grpo.lora.alpha {lora.alpha}: need a finite value > 0")
        if not (math.isfinite(lora.dropout) and 0 <= lora.dropout < 1):
            problems.append(f"task.grpo.lora.dropout {lora.dropout}: need [0, 1)")
        if problems:
            raise ProviderError(
                "The LoRA settings are out of range: " + "; ".join(problems) + ".",
                code="INVALID_ARGUMENT",
                reason="BAD_SETTINGS",
            )
        return cls(
            rank=rank,
            alpha=lora.alpha or GRPO.lora.alpha_per_rank * rank,
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
        )


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
    lora: LoraSettings | None = None
    gradient_checkpointing: bool = False
    #: One weight per reward function (empty: all 1), as TRL's ``reward_weights``.
    reward_weights: tuple[float, ...] = ()

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
        accumulation = task.gradient_accumulation_steps or GRPO.gradient_accumulation_steps
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
            learning_rate=task.learning_rate or default_learning_rate(task),
            beta=initial_beta(task),
            temperature=task.temperature or DEFAULT_TEMPERATURE,
            gradient_accumulation_steps=accumulation,
            num_workers=workers,
            prefetch_factor=prefetch,
            lora=LoraSettings.from_task(task),
            gradient_checkpointing=task.gradient_checkpointing,
            reward_weights=tuple(task.reward_weights),
        )

    @property
    def memo_rows(self) -> int:
        """Distinct rows in one generation batch (the memo size that decodes each row once)."""
        unique = self.batch_size * self.gradient_accumulation_steps // self.num_generations
        return max(1, min(_MAX_MEMO_ROWS, unique))


# Modules the DataLoader workers need where they start from a fork server (a process with gRPC),
# imported once in it rather than per worker (the cyclic collector paused meanwhile, the result
# frozen: ``preload_begin``/``preload_end``).
WORKER_PRELOAD = [
    "trainer_service.providers.grpo.preload_begin",
    "torch",
    "datasets",
    "PIL.Image",
    "trainer_service.providers.grpo.lazy_images",
    "trainer_service.providers.grpo.loader_parts",
    "trainer_service.providers.grpo.preload_end",
]


def worker_start_method() -> str | None:
    """How DataLoader workers start: forked from this process when it has never loaded gRPC,
    else from a fork server (where the platform has one; else its default).

    A job's rank never loads gRPC (it speaks to its trainer over a pipe), so its workers fork
    from it: no interpreter to start and no modules to import, and each worker is the rank's
    own child. A process that loaded gRPC (the trainer, a test that trains in its own process)
    may have gRPC's threads running, and a child forked beside them can crash (seen here:
    workers died with SIGSEGV); there the workers fork from a fork server, a fresh interpreter
    with no such threads that imports :data:`WORKER_PRELOAD` once.
    """
    methods = multiprocessing.get_all_start_methods()
    if "grpc" not in sys.modules and "fork" in methods:
        return "fork"
    if "forkserver" not in methods:
        return None
    multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
    return "forkserver"


def training_args(
    job: TrainJob, settings: Settings, output_dir: str, use_cpu: bool, bf16: bool
) -> GRPOConfig:
    """TRL's config for the job (one optimizer step per episode, logged every step; gradient
    checkpointing as the task says, see the module docstring)."""
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
        reward_weights=list(settings.reward_weights) or None,
        seed=job.config.seed,
        data_seed=job.config.seed,
        use_cpu=use_cpu,
        bf16=bf16,
        # transformers 5 renamed gradient checkpointing; both names are given so that TRL's
        # default for the old one (True) cannot win, and TRL (which reads the old name to enable
        # a LoRA model's input gradients) sees the same value.
        gradient_checkpointing=settings.gradient_checkpointing,
        activation_checkpointing=settings.gradient_checkpointing,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
