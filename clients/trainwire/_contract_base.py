"""The contract's shared vocabulary: its limits, built-in names and violation types.

The numeric limits and built-in names (rigs, clips, reward functions, task kinds) bound both the
stream rules (``trainwire._contract_stream``) and request validation
(``trainwire._contract_requests``); ``ContractViolation`` is what a broken stream raises and
``FieldViolation`` what a bad request field produces. Import these names from
``trainwire.contract``, which re-exports them.

This module depends on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwire.v1 import episode_pb2

MAX_EPISODES = 10_000_000
#: The most checkpoints a run may keep (``TrainConfig.keep_checkpoints``).
MAX_KEEP_CHECKPOINTS = 100
MAX_FRAMES = 240
MAX_JOINTS = 32
MAX_BONES = MAX_JOINTS
MAX_COMPLETIONS = 8
MAX_COMPLETION_BYTES = 4096
#: GrpoDetail.samples: at most this many per episode, each image a thumbnail of at most
#: MAX_SAMPLE_IMAGE_BYTES in one of SAMPLE_IMAGE_TYPES, each text at most MAX_SAMPLE_TEXT_BYTES
#: of UTF-8.
MAX_SAMPLES = 8
MAX_SAMPLE_IMAGE_BYTES = 16 * 1024
MAX_SAMPLE_TEXT_BYTES = 4096
SAMPLE_IMAGE_TYPES: tuple[str, ...] = ("image/webp", "image/png", "image/jpeg")
MAX_GROUP_SIZE = 1024
MAX_ID_LENGTH = 128
MAX_RUN_ID_LENGTH = 64
MAX_NAME_LENGTH = 64
MAX_DISPLAY_NAME_LENGTH = 200
# The trainer's defaults that the checks need without a trainer: whether a batch is a multiple of
# num_generations, how many reward weights a task needs, whether a fork changes more than its
# hyperparameters, how many slots a job takes. A trainer says its own in
# GetCapabilitiesResponse.provider_defaults; tests/unit/test_provider_defaults.py holds these to
# what it says.
#: GrpoTask.num_generations when 0.
DEFAULT_GRPO_GENERATIONS = 8
#: GrpoTask.reward_functions when empty.
DEFAULT_REWARD_FUNCTIONS: tuple[str, ...] = ("exact_match", "format")
#: GrpoTask.max_completion_length when 0.
DEFAULT_GRPO_MAX_COMPLETION_LENGTH = 16
#: GrpoTask.gradient_accumulation_steps when 0.
DEFAULT_GRPO_GRADIENT_ACCUMULATION_STEPS = 1
#: GrpoTask.num_processes when 0: the processes, and trainer slots, a job takes.
DEFAULT_GRPO_PROCESSES = 1
#: LoraConfig.rank when 0.
DEFAULT_LORA_RANK = 16
#: LoraConfig.alpha when 0: this many times the rank.
DEFAULT_LORA_ALPHA_PER_RANK = 2.0
#: Most processes one GRPO job may train on (GrpoTask.num_processes; one slot each).
MAX_GRPO_PROCESSES = 64
#: Physical ranges: what passes here trains (outside them rewards overflow or never end).
MIN_BONE_LENGTH = 1e-3
MAX_BONE_LENGTH = 1e3
MAX_ABS_ANGLE = 4 * math.pi
MIN_EPISODE_RATE = 0.01
MAX_EPISODE_RATE = 10_000.0

BUILTIN_RIG_BONES: dict[str, int] = {"stickman": 11}
DEFAULT_RIG = "stickman"
BUILTIN_CLIPS: tuple[str, ...] = ("wave", "walk", "jump")
REWARD_FUNCTIONS: tuple[str, ...] = ("exact_match", "format", "length")
TASK_KINDS: tuple[str, ...] = ("imitation", "grpo")


class ContractViolation(Exception):
    """An episode stream broke a rule of the contract.

    Attributes:
        rule: Which rule: ``sequence``, ``max_episodes``, ``finite``, ``best_reward``, ``done``,
            ``detail_kind``, ``detail_size`` or ``detail_format``.
        episode: The offending episode's number (``None`` for a stream-level problem).
        field: The offending field (``reward``, ``metrics[loss]``, ``detail.imitation.angles``...).
        run_id: The run the stream belongs to, when the checker knows it.
    """

    def __init__(
        self,
        rule: str,
        message: str,
        *,
        episode: int | None = None,
        field: str | None = None,
        run_id: str = "",
    ) -> None:
        self.rule = rule
        self.episode = episode
        self.field = field
        self.run_id = run_id
        self.reason = message
        where = [f"rule {rule}"]
        if run_id:
            where.append(f"run {run_id}")
        if episode is not None:
            where.append(f"episode {episode}")
        if field:
            where.append(f"field {field}")
        super().__init__(f"{', '.join(where)}: {message}")


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field: its path (``task.imitation.group_size``) and what is wrong."""

    field: str
    description: str


def task_kind(task: episode_pb2.TrainTask) -> str:
    """Returns the task's provider kind: ``imitation``, ``grpo`` or ``""`` when unset."""
    return task.WhichOneof("kind") or ""
