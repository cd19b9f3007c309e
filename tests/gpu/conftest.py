"""Fixtures of the GPU checks: the device they train on and a data root with the tiny VLM and a
colour dataset that it learns (helpers: ``tests/gpu/harness.py``).

Every test here needs a CUDA GPU and is skipped without one, with one exception for developers:
``TRAINWIRE_GPU_TESTS_ON_CPU=1`` runs the tests whose checks hold on any device (the ``device``
fixture) on the CPU instead, so their logic can be tried on a machine without a GPU. Tests of
what only a GPU has (bf16, GPU memory, ``nvidia-smi``, ``GetCapabilities.gpus``) take the
``cuda`` fixture and stay skipped there.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.gpu.harness import COLOURS_FILE, MODEL_DIR, job_device


@pytest.fixture
def device() -> str:
    """``cuda:0`` (or ``cpu`` under ``TRAINWIRE_GPU_TESTS_ON_CPU=1``); skips otherwise."""
    found = job_device()
    if found is None:
        pytest.skip("needs a CUDA GPU")
    return found


@pytest.fixture
def cuda() -> str:
    """``cuda:0``; skips without a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda:0"


@pytest.fixture(scope="session")
def gpu_data_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A trainer data root: the tiny VLM at MODEL_DIR, 64 colour rows at COLOURS_FILE."""
    from trainer_service.tools import make_demo_dataset, make_tiny_vlm

    root = tmp_path_factory.mktemp("gpu-data-root")
    make_tiny_vlm.build(root / MODEL_DIR)
    make_demo_dataset.build((root / COLOURS_FILE).parent, rows=64)
    return root
