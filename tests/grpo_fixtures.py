"""Shared GRPO test fixtures: a data root holding the offline tiny VLM and generated datasets.

Import the fixtures into a test module (``from tests.grpo_fixtures import grpo_data_root``) and
build tasks with :func:`tiny_grpo_task`. The model and dataset are built once per session;
:func:`tiny_vlm` copies a tiny VLM built once for the whole run (every xdist worker) into a
module's own data root.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import re
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import pytest

from trainwire.v1 import episode_pb2

if TYPE_CHECKING:
    from trainer_service.core.provider import Checkpoints, RestoredCheckpoint, TrainJob

#: Where the fixtures put things under the data root.
MODEL_DIR = "models/tiny-vlm"
DATASET_FILE = "datasets/demo/train.jsonl"
DATASET_ROWS = 8
#: A 4-row dataset: with one prompt per step an epoch is 4 steps.
FOUR_ROWS_FILE = "datasets/four/train.jsonl"


_RANK_TITLE = re.compile(r"\(GRPO rank (\d+), trainer (\d+)\)")


def rank_in_title(process: psutil.Process) -> int | None:
    """The job rank a GRPO rank process names in its title (``launch.RANK_TITLE``); ``None``
    for another process."""
    found = _RANK_TITLE.search(" ".join(process.cmdline()))
    return int(found.group(1)) if found else None


def tiny_grpo_task(
    model_path: str = MODEL_DIR,
    dataset_path: str = DATASET_FILE,
    *,
    workers: int | None = 2,
    num_generations: int = 2,
    batch_size: int | None = None,
    max_completion_length: int = 8,
    reward_functions: tuple[str, ...] = ("exact_match", "format", "length"),
    **fields: object,
) -> episode_pb2.TrainTask:
    """A ``TrainTask`` running GRPO on the fixtures' tiny VLM: cheap enough for CPU tests.

    Args:
        model_path: Model directory relative to the data root.
        dataset_path: Dataset file relative to the data root.
        workers: ``dataloader_num_workers`` (``None`` leaves it unset: the default 2).
        num_generations: Completions per prompt.
        batch_size: Completions per step (``None``: ``num_generations``, one prompt per step,
            the cheapest; 0 leaves it unset: the provider's default).
        max_completion_length: Token limit per completion.
        reward_functions: Reward function names.
        **fields: Any other ``GrpoTask`` field.
    """
    grpo = episode_pb2.GrpoTask(
        model_path=model_path,
        dataset_path=dataset_path,
        reward_functions=list(reward_functions),
        num_generations=num_generations,
        batch_size=num_generations if batch_size is None else batch_size,
        max_completion_length=max_completion_length,
        **fields,  # type: ignore[arg-type]
    )
    if workers is not None:
        grpo.dataloader_num_workers = workers
    return episode_pb2.TrainTask(grpo=grpo)


# Each module importing the fixture gets its own FixtureDef (conftest.py is not ours to extend),
# so the build is cached here: once per session (keyed by the session's tmp_path_factory).
_BUILT: dict[int, pathlib.Path] = {}
_BUILD_LOCK = threading.Lock()


def tiny_vlm(
    tmp_path_factory: pytest.TempPathFactory, target: pathlib.Path, **options: object
) -> pathlib.Path:
    """``make_tiny_vlm.build(target, **options)``, as a copy of the one build of those options
    that every xdist worker of the run shares (the build is deterministic: the same options give
    the same files, ``tests/unit/test_grpo_tools.py``). Returns ``target``."""
    from trainer_service.tools import make_tiny_vlm

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    key = ",".join(f"{name}={value}" for name, value in sorted(options.items())) or "default"
    cache = shared / "tiny-vlm-builds" / key
    cache.parent.mkdir(parents=True, exist_ok=True)
    with (cache.parent / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not cache.exists():
            building = cache.with_name(f"{key}.building")
            shutil.rmtree(building, ignore_errors=True)
            make_tiny_vlm.build(building, **options)  # type: ignore[arg-type]
            building.rename(cache)
    shutil.copytree(cache, target)
    return target


@pytest.fixture(scope="session")
def grpo_data_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A trainer data root: the tiny VLM at MODEL_DIR, demo datasets at DATASET_FILE and
    FOUR_ROWS_FILE."""
    from trainer_service.tools import make_demo_dataset

    with _BUILD_LOCK:
        root = _BUILT.get(id(tmp_path_factory))
        if root is None:
            root = tmp_path_factory.mktemp("grpo-data-root")
            tiny_vlm(tmp_path_factory, root / MODEL_DIR)
            make_demo_dataset.build((root / DATASET_FILE).parent, rows=DATASET_ROWS)
            make_demo_dataset.build((root / FOUR_ROWS_FILE).parent, rows=4, seed=1)
            _BUILT[id(tmp_path_factory)] = root
        return root


def make_job(
    data_root: pathlib.Path,
    task: episode_pb2.TrainTask,
    *,
    max_episodes: int = 3,
    seed: int = 7,
    run_id: str = "run-grpo-test",
    image_cache_dir: pathlib.Path | None = None,
    stop_event: threading.Event | None = None,
    set_phase: Callable[[str], None] | None = None,
    checkpoints: Checkpoints | None = None,
    resume: RestoredCheckpoint | None = None,
) -> TrainJob:
    """A ``TrainJob`` for the grpo provider on CPU (no checkpoints unless given)."""
    from trainer_service.core.provider import NoCheckpoints, TrainJob

    return TrainJob(
        run_id=run_id,
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=max_episodes, seed=seed),
        device="cpu",
        data_root=data_root,
        image_cache_dir=image_cache_dir,
        stop_event=stop_event or threading.Event(),
        set_phase=set_phase or (lambda phase: None),
        checkpoints=checkpoints or NoCheckpoints(),
        resume=resume,
    )
