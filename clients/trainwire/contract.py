"""The Trainwire contract: stream rules for episodes and validation of training requests.

Both services and every client apply the same checks, so a stream that passes here passes
everywhere. Stream rules (each named by the ``ContractViolation.rule`` it raises):

1. ``sequence``: the first episode is 1 and each next one is the previous + 1;
   ``max_episodes``: never above the run's ``TrainConfig.max_episodes``.
2. ``finite``: reward, best_reward and every metric are finite; ``best_reward``: best_reward is
   the running maximum of reward (the first episode's equals its reward).
3. ``done``: done is set on the last episode only and nothing follows it; a stream that ends
   (``finish``) or reaches ``max_episodes`` without done is a violation too.
4. ``detail_kind``: the detail matches the task kind; ``detail_size``: it stays within its limits
   (imitation: 1..240 frames x 1..32 joints, finite angles; grpo: at most 8 completions of at
   most 4 KiB of UTF-8 each, and at most 8 samples whose texts are at most 4 KiB of UTF-8 each
   and whose image is at most 16 KiB); ``detail_format``: a sample's ``image_type`` is set
   exactly when it has an image, is one of ``SAMPLE_IMAGE_TYPES`` and names the format the
   image's bytes start with; a sample's ``reward`` and ``rewards`` are finite (``finite``).

Request validation (``check_task``, ``check_train_request``, ``check_create_run``) returns every
bad field at once as ``FieldViolation`` s, ready for a ``google.rpc.BadRequest``.

This is the public module: import every name from here. It re-exports them from the modules
that own them:

- ``trainwire._contract_base``: the limits (``MAX_*``, ``MIN_*``), the built-in names
  (``BUILTIN_RIG_BONES``, ``BUILTIN_CLIPS``, ``REWARD_FUNCTIONS``, ``TASK_KINDS``...),
  ``ContractViolation``, ``FieldViolation`` and ``task_kind``;
- ``trainwire._contract_stream``: ``StreamChecker``, the stream rules above;
- ``trainwire._contract_requests``: request validation (``check_*``, ``bad_request``,
  ``describe_violations``, ``display_run_id``);
- ``trainwire._contract_fork``: what a fork may change (``fork_differences``,
  ``FORK_FIELDS``).

These modules depend on protobuf and the generated messages only (no grpc calls, no torch).
"""

from __future__ import annotations

from trainwire._contract_base import (
    BUILTIN_CLIPS,
    BUILTIN_RIG_BONES,
    DEFAULT_GRPO_GENERATIONS,
    DEFAULT_GRPO_PROCESSES,
    DEFAULT_REWARD_FUNCTIONS,
    DEFAULT_RIG,
    MAX_ABS_ANGLE,
    MAX_BONE_LENGTH,
    MAX_BONES,
    MAX_COMPLETION_BYTES,
    MAX_COMPLETIONS,
    MAX_DISPLAY_NAME_LENGTH,
    MAX_EPISODE_RATE,
    MAX_EPISODES,
    MAX_FRAMES,
    MAX_GROUP_SIZE,
    MAX_GRPO_PROCESSES,
    MAX_ID_LENGTH,
    MAX_JOINTS,
    MAX_KEEP_CHECKPOINTS,
    MAX_NAME_LENGTH,
    MAX_RUN_ID_LENGTH,
    MAX_SAMPLE_IMAGE_BYTES,
    MAX_SAMPLE_TEXT_BYTES,
    MAX_SAMPLES,
    MIN_BONE_LENGTH,
    MIN_EPISODE_RATE,
    REWARD_FUNCTIONS,
    SAMPLE_IMAGE_TYPES,
    TASK_KINDS,
    ContractViolation,
    FieldViolation,
    task_kind,
)
from trainwire._contract_fork import FORK_FIELDS, fork_differences
from trainwire._contract_requests import (
    LIVE_HYPERPARAMETERS,
    bad_request,
    check_create_run,
    check_display_name,
    check_episode_rate,
    check_hyperparameters,
    check_labels,
    check_run_id,
    check_task,
    check_train_request,
    describe_violations,
    display_run_id,
    is_custom_reward,
)
from trainwire._contract_stream import StreamChecker

__all__ = [
    "BUILTIN_CLIPS",
    "BUILTIN_RIG_BONES",
    "DEFAULT_GRPO_GENERATIONS",
    "DEFAULT_GRPO_PROCESSES",
    "DEFAULT_REWARD_FUNCTIONS",
    "DEFAULT_RIG",
    "FORK_FIELDS",
    "LIVE_HYPERPARAMETERS",
    "MAX_ABS_ANGLE",
    "MAX_BONES",
    "MAX_BONE_LENGTH",
    "MAX_COMPLETIONS",
    "MAX_COMPLETION_BYTES",
    "MAX_DISPLAY_NAME_LENGTH",
    "MAX_EPISODES",
    "MAX_EPISODE_RATE",
    "MAX_FRAMES",
    "MAX_GROUP_SIZE",
    "MAX_GRPO_PROCESSES",
    "MAX_ID_LENGTH",
    "MAX_JOINTS",
    "MAX_KEEP_CHECKPOINTS",
    "MAX_NAME_LENGTH",
    "MAX_RUN_ID_LENGTH",
    "MAX_SAMPLES",
    "MAX_SAMPLE_IMAGE_BYTES",
    "MAX_SAMPLE_TEXT_BYTES",
    "MIN_BONE_LENGTH",
    "MIN_EPISODE_RATE",
    "REWARD_FUNCTIONS",
    "SAMPLE_IMAGE_TYPES",
    "TASK_KINDS",
    "ContractViolation",
    "FieldViolation",
    "StreamChecker",
    "bad_request",
    "check_create_run",
    "check_display_name",
    "check_episode_rate",
    "check_hyperparameters",
    "check_labels",
    "check_run_id",
    "check_task",
    "check_train_request",
    "describe_violations",
    "display_run_id",
    "fork_differences",
    "is_custom_reward",
    "task_kind",
]
