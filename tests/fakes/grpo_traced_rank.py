"""A GRPO rank that records what it reads: the real worker around the real trainer, with every
image decode (in whichever process decodes it: the DataLoader workers) and the rows of every
training step appended as JSON lines to the file named by ``$TRAINWIRE_TEST_TRACE``.

``python -m tests.fakes.grpo_traced_rank --fd N --parent-pid P`` is what a job's processes run
once a test points ``launch.WORKER_MODULE`` here (the :func:`traced_ranks` fixture). Records:

- ``{"decode": <row index>, "pid": <process>}``: an image of the row was decoded;
- ``{"step": <optimizer step>, "rows": [<row index>, ...]}``: the rows a step trained on, one
  entry per completion (each row ``num_generations`` times).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from trainer_service.providers.grpo.lazy_images import DecodeStats, LazyImageDataset
from trainer_service.providers.grpo.rows import ImageRef

MODULE = "tests.fakes.grpo_traced_rank"
TRACE_ENV = "TRAINWIRE_TEST_TRACE"
_ROW_KEY = "trace_row"


def _append(record: dict[str, Any]) -> None:
    # One short write per record in append mode: lines of concurrent writers do not mix.
    with open(os.environ[TRACE_ENV], "a", encoding="utf-8") as trace:
        trace.write(json.dumps(record) + "\n")


class TracedImageDataset(LazyImageDataset):
    """The lazy dataset, recording its decodes and tagging each row with its index."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = super().__getitem__(index)
        row[_ROW_KEY] = index
        return row

    def _decode(self, index: int, ref: ImageRef, stats: DecodeStats) -> Any:
        image = super()._decode(index, ref, stats)
        _append({"decode": index, "pid": os.getpid()})
        return image


def traced_build(job: Any, callbacks: Any, **kwargs: Any) -> Any:
    """``build.build_trainer`` with a traced dataset and a record of each step's rows."""
    from trainer_service.providers.grpo import build

    load_dataset = build.load_dataset

    def traced_load(*args: Any, **load_kwargs: Any) -> LazyImageDataset:
        lazy = load_dataset(*args, **load_kwargs)
        lazy.__class__ = TracedImageDataset
        return lazy

    build.load_dataset = traced_load  # type: ignore[assignment]
    trainer: Any = build.build_trainer(job, callbacks, **kwargs)
    prepare = trainer._prepare_inputs

    def traced_prepare(batch: Any) -> Any:
        if trainer.model.training:
            rows = [row[_ROW_KEY] for row in batch]
            _append({"step": trainer.state.global_step + 1, "rows": rows})
        return prepare(batch)

    trainer._prepare_inputs = traced_prepare
    return trainer


def read_trace(path: pathlib.Path) -> tuple[dict[int, list[int]], list[int]]:
    """(rows of each step, row index of every decode) from a trace file."""
    steps: dict[int, list[int]] = {}
    decodes: list[int] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "step" in record:
                steps[record["step"]] = record["rows"]
            else:
                decodes.append(record["decode"])
    return steps, decodes


@pytest.fixture
def traced_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[pathlib.Path], None]]:
    """Makes the GRPO jobs of this test run traced ranks; yields a function that names the
    trace file of the jobs started after it is called."""
    from trainer_service.providers.grpo import launch

    monkeypatch.setattr(launch, "WORKER_MODULE", MODULE)
    yield lambda path: monkeypatch.setenv(TRACE_ENV, str(path))


if __name__ == "__main__":
    from trainer_service.providers.grpo import worker

    sys.exit(worker.main(build=traced_build))
