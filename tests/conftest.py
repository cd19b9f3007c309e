"""Suite-wide settings: one torch thread (two cores are shared), and the repo root importable."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

try:  # torch is optional: the client package and the gateway must work without it
    import torch
except ImportError:  # pragma: no cover - exercised only in a torch-less environment
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(1)
