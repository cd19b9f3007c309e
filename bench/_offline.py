"""The environment the ML benchmarks run in, set up by importing this module first (the
benchmarks run as scripts, so ``bench/`` is on ``sys.path``): the Hugging Face libraries offline
(nothing may download), tokenizers on one thread, the repository importable. Each variable keeps
a value the caller already set."""

from __future__ import annotations

import os
import pathlib
import sys

ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ROOT = pathlib.Path(__file__).resolve().parents[1]

for _name, _value in ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
