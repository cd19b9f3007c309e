"""GRPO checkpoints on the real trainer, in the processes the trainer runs a job in
(``process.run``): a resumed job continues the uninterrupted one, skips what was trained without
decoding it, the saved model loads without trainwire, and a checkpoint that does not fit is
refused before the first episode.

The ranks are the real worker around the real trainer, traced (``tests.fakes.grpo_traced_rank``:
the rows of each step and every image decode, from the rank and its DataLoader workers). One
uninterrupted job writes the checkpoints every test here reads (a module fixture): each rank
start costs seconds of imports on a small box.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.fakes.grpo_traced_rank import MODULE, TRACE_ENV, read_trace
from tests.fakes.local_checkpoints import LocalCheckpoints
from tests.fakes.waiting import TIMEOUT
from tests.grpo_fixtures import DATASET_FILE, DATASET_ROWS, MODEL_DIR, grpo_data_root, make_job
from tests.grpo_fixtures import tiny_grpo_task as _task
from trainer_service.core.provider import CheckpointUnusable, RestoredCheckpoint
from trainer_service.providers.grpo import launch, process
from trainwire.contract import StreamChecker
from trainwire.v1 import episode_pb2

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

#: 8 rows, one prompt per step: an epoch is 8 steps. The job resumes in its second epoch, so
#: the resumed job must both skip within an epoch and give that epoch its own order.
STEPS = 13
EVERY = 5
RESUME_AT = 10
SEED = 11
TASK = _task(
    dataset_path=DATASET_FILE,
    workers=2,
    num_generations=2,
    batch_size=2,
    max_completion_length=4,
    reward_functions=("exact_match", "length"),
)


@dataclass
class Job:
    """What one traced job streamed and read."""

    episodes: list[episode_pb2.Episode]
    steps: dict[int, list[int]]  #: the rows of each step (one entry per completion)
    decodes: list[int]  #: the row of every image decoded
    checkpoints: LocalCheckpoints


def _traced_job(
    root: pathlib.Path,
    where: pathlib.Path,
    *,
    resume: RestoredCheckpoint | None = None,
) -> Job:
    where.mkdir(parents=True)
    trace = where / "trace.jsonl"
    os.environ[TRACE_ENV] = str(trace)
    checkpoints = LocalCheckpoints(where / "store", EVERY, STEPS)
    job = make_job(
        root, TASK, max_episodes=STEPS, seed=SEED, checkpoints=checkpoints, resume=resume
    )
    episodes = list(process.run(job))
    steps, decodes = read_trace(trace)
    return Job(episodes, steps, decodes, checkpoints)


@pytest.fixture(scope="module")
def jobs(
    grpo_data_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Job, Job]]:
    """The uninterrupted job (checkpointed every EVERY steps) and one resumed at RESUME_AT."""
    where = tmp_path_factory.mktemp("grpo-checkpoints")
    saved = launch.WORKER_MODULE, os.environ.get(TRACE_ENV)
    launch.WORKER_MODULE = MODULE
    try:
        whole = _traced_job(grpo_data_root, where / "whole")
        resumed = _traced_job(
            grpo_data_root,
            where / "resumed",
            resume=whole.checkpoints.restored(RESUME_AT),
        )
        yield whole, resumed
    finally:
        launch.WORKER_MODULE = saved[0]
        if saved[1] is None:
            os.environ.pop(TRACE_ENV, None)
        else:
            os.environ[TRACE_ENV] = saved[1]


def _rows(job: Job, step: int) -> list[int]:
    return sorted(set(job.steps[step]))


def test_a_resumed_job_continues_the_uninterrupted_one(jobs: tuple[Job, Job]) -> None:
    whole, resumed = jobs
    checker = StreamChecker.for_task(TASK, episode_pb2.TrainConfig(max_episodes=STEPS), "run")
    for episode in whole.episodes:
        checker.check(episode)
    checker.finish()
    # Due every EVERY steps and at the last; each committed with its episode's best reward.
    best = {e.episode: e.best_reward for e in whole.episodes}
    assert [(c.episode, c.best_reward) for c in whole.checkpoints.committed] == [
        (n, best[n]) for n in (5, 10, 13)
    ]
    # The resumed job: steps RESUME_AT+1.. only, numbered on, best reward carried on.
    assert [e.episode for e in resumed.episodes] == list(range(RESUME_AT + 1, STEPS + 1))
    assert sorted(resumed.steps) == list(range(RESUME_AT + 1, STEPS + 1))
    assert resumed.episodes[-1].done
    after = whole.episodes[RESUME_AT:]
    for mine, theirs in zip(resumed.episodes, after, strict=True):
        step = mine.episode
        # The same rows, in the same order (no row of steps 1..RESUME_AT is trained again)...
        assert resumed.steps[step] == whole.steps[step], f"rows differ at step {step}"
        # ...and the same weights, optimizer and RNG: the same sampled completions, so the same
        # rewards; the loss within float noise (it was bit-equal on the CPU this was written on).
        assert list(mine.grpo.sample_completions) == list(theirs.grpo.sample_completions)
        assert (mine.reward, mine.best_reward) == (theirs.reward, theirs.best_reward)
        assert mine.metrics["loss"] == pytest.approx(theirs.metrics["loss"], rel=1e-5, abs=1e-7)
    # The second epoch's order is its own: the test would catch a resumed job that restarted
    # the epoch order (TRL's sampler, rebuilt on resume, gives its first draw).
    first_epoch = [_rows(whole, n) for n in range(1, 9)]
    second_epoch = [_rows(whole, n) for n in range(9, 17) if n in whole.steps]
    assert first_epoch[2 : 2 + len(after)] != second_epoch[2 : 2 + len(after)]
    # Checkpoint layout: the model, the trainer's state and trainwire's record.
    directory = whole.checkpoints.restored(RESUME_AT).directory
    record = json.loads((directory / "trainwire.json").read_text())
    assert record["step"] == RESUME_AT and record["world_size"] == 1
    assert record["data_position"] == {"epoch": 1, "batches_done": 2}
    assert record["best_reward"] == best[RESUME_AT]
    names = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert {
        "model/config.json",
        "model/model.safetensors",
        "trainer/optimizer.pt",
        "trainer/scheduler.pt",
        "trainer/rng_state.pth",
        "trainer/trainer_state.json",
        "trainwire.json",
    } <= names
    state = json.loads((directory / "trainer" / "trainer_state.json").read_text())
    assert state["global_step"] == RESUME_AT and state["log_history"] == []


def test_skipped_steps_decode_no_image(jobs: tuple[Job, Job]) -> None:
    whole, resumed = jobs
    # The uninterrupted job decoded each step's row (one image per row, once per step: the
    # workers' memo serves the row's second completion).
    assert len(whole.decodes) >= STEPS
    # The resumed job skipped the first epoch and two steps of the second by index: it decoded
    # only rows of the second epoch from its third step on (what it trained on, and what the
    # workers prefetched before the epoch's end), never a row of a skipped step.
    # (An epoch is a permutation of the rows: the skipped steps' rows come nowhere else in it.)
    skipped = {row for n in (9, 10) for row in whole.steps[n]}
    assert len(skipped) == 2
    assert resumed.decodes, "the resumed job decoded nothing: is the trace on?"
    assert not skipped & set(resumed.decodes), resumed.decodes
    assert len(resumed.decodes) <= DATASET_ROWS - 2, resumed.decodes


_LOAD_AND_GENERATE = r"""
import importlib.abc, sys
class _NoTrainwire(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer_service", "trainwire", "tests"):
            raise ImportError(f"{name} is not installed here")
        return None
# The repository's editable installs are import hooks: drop them, refuse what they served.
sys.meta_path[:] = [_NoTrainwire()] + [
    f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
]
import json, torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
directory, image = sys.argv[1], sys.argv[2]
processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True)
content = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
messages = [{"role": "user", "content": content}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(images=[Image.open(image).convert("RGB")], text=[prompt], return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
text = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
try:
    import trainer_service
    importable = True
except ImportError:
    importable = False
print(json.dumps({"model": type(model).__name__, "text": text, "trainwire": importable}))
"""


def test_the_saved_model_loads_and_generates_without_trainwire(
    jobs: tuple[Job, Job], grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    whole, _ = jobs
    final = whole.checkpoints.restored(STEPS).directory / "model"
    row = json.loads((grpo_data_root / DATASET_FILE).read_text().splitlines()[0])
    image = (grpo_data_root / DATASET_FILE).parent / row["image_paths"][0]
    # -I: no PYTHONPATH, no user site, not the working directory; run from elsewhere.
    result = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD_AND_GENERATE, str(final), str(image)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 4,
        env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["model"] == "LlavaForConditionalGeneration" and not answer["trainwire"]
    assert answer["text"].strip()


def test_a_checkpoint_that_does_not_fit_is_refused_before_the_first_episode(
    jobs: tuple[Job, Job], grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    whole, _ = jobs
    good = whole.checkpoints.restored(RESUME_AT)

    def resume_from(directory: pathlib.Path, model: str = MODEL_DIR) -> str:
        task = episode_pb2.TrainTask()
        task.CopyFrom(TASK)
        task.grpo.model_path = model
        restored = RestoredCheckpoint(directory, good.episode, good.best_reward)
        job = make_job(grpo_data_root, task, max_episodes=STEPS, seed=SEED, resume=restored)
        episodes = process.run(job)
        started = time.monotonic()
        with pytest.raises(CheckpointUnusable) as info:
            next(episodes)
        return f"{info.value} ({time.monotonic() - started:.1f} s)"

    def broken(name: str) -> pathlib.Path:
        copy = tmp_path / name
        shutil.copytree(good.directory, copy)
        return copy

    # Found by the trainer before any process starts.
    missing = broken("missing")
    (missing / "trainer" / "optimizer.pt").unlink()
    assert "trainer/optimizer.pt" in resume_from(missing)
    other = grpo_data_root / "models" / "other-vlm"
    shutil.copytree(grpo_data_root / MODEL_DIR, other, dirs_exist_ok=True)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    assert "another model" in resume_from(good.directory, model="models/other-vlm")
    # Found by the rank as it loads the weights: reported before any episode.
    truncated = broken("truncated")
    weights = truncated / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "its model does not load" in resume_from(truncated)


def test_a_two_process_job_resumes_with_each_ranks_rng_state(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # Plain ranks, rows decoded inline: the part under test is the ranks' RNG states, gathered
    # to rank 0 and restored on each rank.
    task = _task(
        dataset_path=DATASET_FILE,
        workers=0,
        num_processes=2,
        max_completion_length=4,
        reward_functions=("exact_match", "length"),
    )
    checkpoints = LocalCheckpoints(tmp_path, 3, 6)

    def stream(**job: object) -> list[tuple[int, float, tuple[str, ...]]]:
        run = make_job(grpo_data_root, task, max_episodes=6, seed=5, **job)  # type: ignore[arg-type]
        return [(e.episode, e.reward, tuple(e.grpo.sample_completions)) for e in process.run(run)]

    whole = stream(checkpoints=checkpoints)
    directory = checkpoints.restored(3).directory
    assert {p.name for p in (directory / "trainer").glob("rng_state*")} == {
        "rng_state_0.pth",
        "rng_state_1.pth",
    }
    assert stream(resume=checkpoints.restored(3)) == whole[3:]
