"""The grpo provider on the real GRPOTrainer with the offline tiny VLM (CPU, a few tiny steps).

A job's failures are read as the trainer reads them: the job runs in a process of its own
(``process.run``). Properties of the trainer a rank builds (its determinism across DataLoader
workers, where it decodes, its plain errors) are checked at that seam, in this process, with
the builder and the step gate every rank runs (``build.build_trainer``, ``callback.StepGate``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

from tests.fakes.waiting import TIMEOUT
from tests.grpo_fixtures import (
    DATASET_FILE,
    FOUR_ROWS_FILE,
    MODEL_DIR,
    grpo_data_root,
    make_job,
    tiny_grpo_task,
)
from trainer_service.core.provider import EpisodeCounter, ProviderError, TrainJob
from trainer_service.providers.grpo import process
from trainer_service.providers.grpo.rewards import CompletionTap
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

pytestmark = pytest.mark.slow

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest


def build_trainer(job: TrainJob, callbacks: Sequence[Any] = (), **kwargs: Any) -> Any:
    """``build.build_trainer``, imported when first called: its module imports TRL and
    transformers (~2.3 s of CPU), which every pytest worker would otherwise pay to collect this
    file."""
    from trainer_service.providers.grpo.build import build_trainer as build

    return build(job, callbacks, **kwargs)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Trainers built in this process use one CPU thread, as a job's process does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Granted:
    """A rank's channel whose trainer grants every step; keeps the episodes rank 0 sends."""

    def __init__(self) -> None:
        self.last_step = 0
        self.episodes: list[episode_pb2.Episode] = []

    def send_episode(self, episode: episode_pb2.Episode) -> None:
        self.episodes.append(episode)

    def wait_step(self, step: int) -> bool:
        return True


def _rank_episodes(job: TrainJob, scratch: pathlib.Path) -> list[episode_pb2.Episode]:
    """The episodes rank 0 of ``job`` sends: its trainer and step gate, run in this process."""
    from trainer_service.providers.grpo.callback import EpisodeMaker, StepGate

    tap, channel = CompletionTap(), _Granted()
    steps = job.config.max_episodes
    gate = StepGate(EpisodeMaker(EpisodeCounter(steps), tap), channel, steps)
    build_trainer(job, [gate], output_dir=str(scratch), tap=tap).train()
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    for episode in channel.episodes:
        checker.check(episode)
    checker.finish()
    return channel.episodes


def test_0_and_2_workers_give_the_same_stream_over_3_epochs(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # 4 rows and one prompt per step: an epoch is 4 steps, so 14 steps cross 3 epoch boundaries
    # (persistent workers keep one DataLoader iterator; inline loading makes one per epoch).
    def stream(workers: int) -> list[tuple[float, tuple[str, ...]]]:
        task = tiny_grpo_task(
            dataset_path=FOUR_ROWS_FILE,
            workers=workers,
            num_generations=2,
            batch_size=2,
            max_completion_length=4,
            reward_functions=("exact_match", "length"),
        )
        job = make_job(grpo_data_root, task, max_episodes=14, seed=11)
        episodes = _rank_episodes(job, tmp_path / f"workers-{workers}")
        return [(e.reward, tuple(e.grpo.sample_completions)) for e in episodes]

    inline, workers = stream(0), stream(2)
    assert len(inline) == 14
    assert all(len(completions) == 2 for _, completions in inline)
    # Sampling is random over many words, so equal completions at every step mean equal index
    # streams, equal images and an equal sampling RNG in all epochs.
    assert len({c for _, completions in inline for c in completions}) >= 4
    for step, (a, b) in enumerate(zip(inline, workers, strict=True), start=1):
        assert a == b, f"streams diverge at step {step}"


def test_decoding_runs_in_worker_processes_once_per_row(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    job = make_job(grpo_data_root, tiny_grpo_task(workers=2, num_generations=4), seed=3)
    trainer = build_trainer(job, output_dir=str(tmp_path), provenance_key="_decode")
    batches = iter(trainer.get_train_dataloader())
    try:
        rows = [row for _ in range(2) for row in next(batches)]
    finally:
        del batches  # shuts the persistent workers down
    pids = {row["_decode"]["pid"] for row in rows}
    assert os.getpid() not in pids
    assert len(pids) == 2  # consecutive batches come from the two workers
    # Each batch holds every prompt num_generations times, yet each row was decoded once.
    assert {row["_decode"]["decodes"] for row in rows} == {1}
    assert all(row["image"].mode == "RGB" for row in rows)


def test_a_dataloader_worker_starts_without_importing_trl(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """What a worker receives (dataset, collate and init functions) unpickles in an interpreter
    that holds only the workers' fork-server preload, and imports neither TRL nor transformers
    there: each worker would otherwise pay their import (about 1.9 s of CPU)."""
    from trainer_service.providers.grpo.settings import WORKER_PRELOAD

    job = make_job(grpo_data_root, tiny_grpo_task(workers=2), seed=3)
    loader = build_trainer(job, output_dir=str(tmp_path)).get_train_dataloader()
    base = getattr(loader, "base_dataloader", loader)
    payload = ForkingPickler.dumps((base.dataset, base.collate_fn, base.worker_init_fn))
    probe = (
        "import importlib, json, pickle, sys\n"
        f"for name in {WORKER_PRELOAD!r}: importlib.import_module(name)\n"
        "dataset, collate, init = pickle.loads(sys.stdin.buffer.read())\n"
        "print(json.dumps([len(dataset), sorted(m for m in ('trl', 'transformers')"
        " if m in sys.modules)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        input=bytes(payload),
        capture_output=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert json.loads(done.stdout) == [len(base.dataset), []]
    assert base.collate_fn([{"a": 1}, {"b": 2}]) == [{"a": 1}, {"b": 2}]


def test_model_and_dataset_problems_are_plain_provider_errors(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    def build(task: Any) -> None:
        build_trainer(make_job(grpo_data_root, task), output_dir=str(tmp_path))

    with pytest.raises(
        ProviderError, match="model directory 'models/absent' was not found"
    ) as info:
        build(tiny_grpo_task(model_path="models/absent"))
    assert str(grpo_data_root) not in info.value.user_message
    with pytest.raises(ProviderError, match=r"dataset file 'absent\.jsonl' was not found"):
        build(tiny_grpo_task(dataset_path="absent.jsonl"))

    broken = grpo_data_root / "models" / "broken"
    shutil.copytree(grpo_data_root / MODEL_DIR, broken, dirs_exist_ok=True)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ProviderError, match="could not be loaded") as info:
        build(tiny_grpo_task(model_path="models/broken"))
    assert info.value.reason == "MODEL_UNLOADABLE"


def test_a_bad_row_fails_the_run_naming_its_line_and_image(grpo_data_root: pathlib.Path) -> None:
    # The last of 8 lines escapes the data root. Opening the file checks no row, so the run
    # starts; rank 0's background check of every row fails it within seconds, naming line and
    # image, whether rows are decoded inline or in DataLoader workers (the default, here).
    rows = (grpo_data_root / DATASET_FILE).read_text().splitlines()
    bad = json.loads(rows[-1])
    bad["image_paths"] = ["../../../etc/passwd"]
    escaping = grpo_data_root / "datasets" / "demo" / "escaping.jsonl"
    escaping.write_text("\n".join([*rows[:-1], json.dumps(bad)]) + "\n")
    task = tiny_grpo_task(dataset_path="datasets/demo/escaping.jsonl", workers=2)
    with pytest.raises(ProviderError) as info:
        list(process.run(make_job(grpo_data_root, task, max_episodes=50)))
    assert info.value.user_message == (
        f"Dataset line {len(rows)} of escaping.jsonl: image '../../../etc/passwd' must be "
        "relative to the dataset file, or absolute inside a data root, and contain no '..'."
    )
    assert info.value.reason == "BAD_DATASET"


def test_the_default_batch_fits_a_small_dataset_and_a_set_one_must(
    grpo_data_root: pathlib.Path,
) -> None:
    from trainer_service.providers.grpo.settings import Settings

    # 8 rows: the default 16 prompts per step shrink to 8; a batch that needs 16 rows is refused.
    fitted = Settings.from_task(tiny_grpo_task(num_generations=2, batch_size=0).grpo, rows=8)
    assert (fitted.batch_size, fitted.memo_rows) == (16, 8)
    assert Settings.from_task(tiny_grpo_task(batch_size=0).grpo).batch_size == 32
    with pytest.raises(ProviderError, match="samples 16 distinct dataset rows") as info:
        Settings.from_task(tiny_grpo_task(num_generations=2, batch_size=32).grpo, rows=8)
    assert info.value.code == "INVALID_ARGUMENT"
    # batch_size is per process: two processes share the rows of a step.
    task = tiny_grpo_task(num_generations=2, batch_size=0).grpo
    assert Settings.from_task(task, rows=8, processes=2).batch_size == 8
    with pytest.raises(ProviderError, match=r"x 2 processes / num_generations 2\), but"):
        Settings.from_task(tiny_grpo_task(batch_size=16).grpo, rows=8, processes=2)


def test_unreadable_image_fails_the_run_naming_the_row(grpo_data_root: pathlib.Path) -> None:
    # Decoded in a DataLoader worker (the default): torch re-raises the worker's error with its
    # traceback as the message; the rank reports the row's own message. (Inline decoding names
    # the row the same way: see test_lazy_images.)
    demo = grpo_data_root / "datasets" / "demo"
    broken = demo / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "bad.png").write_bytes(b"not a png at all")
    rows = [json.loads(line) for line in (demo / "train.jsonl").read_text().splitlines()]
    for row in rows:
        row["image_paths"] = ["broken/bad.png"]
    (demo / "broken.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = tiny_grpo_task(dataset_path="datasets/demo/broken.jsonl", workers=2)
    with pytest.raises(ProviderError) as info:
        list(process.run(make_job(grpo_data_root, task, max_episodes=2)))
    message = info.value.user_message
    assert re.fullmatch(
        r"Dataset line \d of broken\.jsonl: image 'broken/bad\.png' could not be read\.", message
    ), message
    assert "Traceback" not in message and str(grpo_data_root) not in message
