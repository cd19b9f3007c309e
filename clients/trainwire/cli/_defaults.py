"""The defaults the command line's help states, as numbers a user can check.

A run created with a flag left out sends 0 (or nothing), and the gateway or the trainer applies
its default; the help says which value that is, never the sentinel. The values live in the
services (the client package cannot import them); ``tests/unit/test_cli_help.py`` holds each
equal to the service's own constant, so a changed default fails a test until the help follows.
"""

from __future__ import annotations

#: The gateway's ``--episode-rate`` default: episodes published per second of a paced run.
DEFAULT_EPISODE_RATE = 20.0
#: Checkpoints kept per run (``TrainConfig.keep_checkpoints`` 0).
DEFAULT_KEEP_CHECKPOINTS = 3
#: The fields ``ListRuns``'s filter and order_by read.
SEARCH_FIELDS = (
    "best_reward, clip, create_time, creator, display_name, end_time, episode, id, kind, "
    "learning_rate, model, reward, seed, start_time, state, labels.KEY"
)

DEFAULT_IMITATION_GROUP_SIZE = 16
DEFAULT_IMITATION_LEARNING_RATE = 0.03
DEFAULT_IMITATION_CHECKPOINT_EVERY = 500

DEFAULT_GRPO_CHECKPOINT_EVERY = 50
#: Prompts per optimizer step when the batch size is left out.
DEFAULT_GRPO_PROMPTS_PER_STEP = 16
DEFAULT_GRPO_MAX_COMPLETION_LENGTH = 16
DEFAULT_GRPO_LEARNING_RATE = 3e-3
DEFAULT_GRPO_LORA_LEARNING_RATE = 1e-2
DEFAULT_GRPO_TEMPERATURE = 1.0
DEFAULT_GRPO_LORA_BETA = 0.04
DEFAULT_GRPO_WORKERS = 2
DEFAULT_GRPO_LORA_RANK = 16
