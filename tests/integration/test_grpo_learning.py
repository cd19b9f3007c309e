"""GRPO learns, survives the death of its trainer, and hands over a model that answers: two real
trainer processes, the gateway in-process, a shared checkpoint directory.

The offline tiny VLM starts with random weights, so its ``exact_match`` reward on the four-colour
demo dataset starts at or below chance (0.25); with the provider's defaults (the task sets only
model, dataset, reward and steps) 60 optimizer steps lift it well above chance. Midway the
trainer that runs the job is killed (kill -9): the gateway restarts the run from its latest
checkpoint on the other trainer, and a watcher still gets every step once. The run's final
checkpoint is then downloaded and its ``model/`` loaded with plain ``transformers`` in a fresh
process that cannot import trainwire, which answers held-out images (a dataset of another seed)
about as well as the last training steps did. ``bench/grpo_learning.py`` runs the full-length
comparison with uniform gray images, which cannot get above chance.

Then a provider error is not retried: a run whose images vanish after its first checkpoint
ends ERROR with the provider's message, never restarted. Its images are palette PNGs that make
PIL warn while DataLoader worker processes decode them.

Last, what the trainers wrote: started with ``--log-format json``, a trainer process running
GRPO jobs (transformers, TRL, datasets and torch, each with its own progress bars, logging
handlers and warnings, and worker processes decoding images) writes only JSON records to
stderr, the workers' PIL warning among them, and nothing but its ``trainer listening on`` line
to stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from tests.fakes.gateway_harness import collect, get_run, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.grpo_fixtures import tiny_vlm
from trainer_service.tools import make_demo_dataset
from trainwire import aio
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State
STEPS = 60
EVERY = 10
CHANCE = 1 / len(make_demo_dataset.DEFAULT_ANSWERS["colour"])
HELD_OUT_ROWS = 32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpo-learning")
    tiny_vlm(tmp_path_factory, root / "models" / "tiny-vlm")
    make_demo_dataset.build(root / "datasets" / "colours")
    make_demo_dataset.build(root / "datasets" / "held-out", rows=HELD_OUT_ROWS, seed=12345)
    vanishing = root / "datasets" / "vanishing"
    make_demo_dataset.build(vanishing, rows=4, seed=3)
    # Every row's image a palette PNG whose transparency makes PIL warn when it decodes it.
    image = Image.new("P", (16, 16))
    image.putpalette([(i * 37) % 256 for i in range(768)])
    image.save(vanishing / "images" / "palette.png", transparency=bytes(range(256)))
    rows = [json.loads(line) for line in (vanishing / "train.jsonl").read_text().splitlines()]
    for row in rows:
        row["image_paths"] = ["images/palette.png"]
    (vanishing / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@dataclass
class Trainers:
    """The module's two trainer processes, their shared checkpoint store and their logs."""

    store: Path
    processes: list[tuple[subprocess.Popen[bytes], str]]
    logs: list[Path]


@pytest.fixture(scope="module")
def trainers(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    """Two one-slot trainers on the data root, sharing a checkpoint directory, logging JSON."""
    logs = tmp_path_factory.mktemp("logs")
    store = tmp_path_factory.mktemp("checkpoints")
    flags = ("--data-root", str(data_root), "--checkpoint-store", str(store))
    flags += ("--heartbeat", "0.5", "--detach-grace", "60")
    flags += ("--log-format", "json", "--log-level", "debug")
    # Whatever the developer's environment asks for, the libraries' own output must not leak.
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    hidden = {"TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS"} & os.environ.keys()
    saved = {name: os.environ.pop(name) for name in hidden}
    try:
        with (
            trainer_process(logs / "t1.log", *flags, slots=1, env=env) as one,
            trainer_process(logs / "t2.log", *flags, slots=1, env=env) as two,
        ):
            yield Trainers(store, [one, two], [logs / "t1.log", logs / "t2.log"])
    finally:
        os.environ.update(saved)


def _grpo(dataset: str, steps: int, every: int, **task: object) -> pb.CreateRunRequest:
    grpo = episode_pb2.GrpoTask(
        model_path="models/tiny-vlm",
        dataset_path=dataset,
        reward_functions=["exact_match"],
        # Inline decoding: worker start-up would cost more than the 64 small images.
        dataloader_num_workers=0,
        **task,  # type: ignore[arg-type]
    )
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=0, checkpoint_every=every),
        episodes_per_second=-1.0,
    )


# Loads the downloaded model with transformers alone (the editable installs' import hooks
# removed, trainwire refused) and answers each held-out row greedily; prints the accuracy.
_ANSWER_HELD_OUT = r"""
import importlib.abc, json, sys
class _NoTrainwire(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer_service", "trainwire", "gateway", "tests"):
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path[:] = [_NoTrainwire()] + [
    f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
]
from pathlib import Path
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
torch.set_num_threads(1)
model_dir, dataset = Path(sys.argv[1]), Path(sys.argv[2])
processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True).eval()
right = total = 0
for line in dataset.read_text().splitlines():
    row = json.loads(line)
    prompt = processor.apply_chat_template(row["prompt"], add_generation_prompt=True)
    images = [Image.open(dataset.parent / p).convert("RGB") for p in row["image_paths"]]
    inputs = processor(images=images, text=[prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new_tokens = out[:, inputs["input_ids"].shape[1]:]
    text = processor.batch_decode(new_tokens, skip_special_tokens=True)[0]
    answer = " ".join(text.lower().split()).strip(" \t\r\n.,;:!?\"'`")
    right += answer == row["solution"]
    total += 1
print(json.dumps({"accuracy": right / total, "rows": total, "model": type(model).__name__}))
"""


async def test_grpo_learns_survives_kill_9_and_its_model_answers_held_out_images(
    trainers: Trainers, data_root: Path, tmp_path: Path
) -> None:
    store, processes = trainers.store, trainers.processes
    addresses = tuple(address for _, address in processes)
    async with running_gateway(
        addresses, checkpoint_store=str(store), heartbeat_timeout_s=5.0, schedule_poll_s=0.2
    ) as client:
        request = _grpo("datasets/colours/train.jsonl", STEPS, EVERY)
        run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run
        # Two stretches of training (before the kill and after the restart): twice a job's
        # deadline, which a loaded machine needed.
        watch = asyncio.create_task(collect(client.stub, run.id, timeout=2 * JOB_TIMEOUT))

        async def checkpointed() -> pb.Run | None:
            now = await get_run(client.stub, run.id)
            return now if now.checkpoint_episode >= 2 * EVERY else None

        running = await until(checkpointed, "two checkpoints", JOB_TIMEOUT)
        victim = next(proc for proc, address in processes if address == running.trainer)
        victim.send_signal(signal.SIGKILL)
        watched = await watch

        done = watched.finished
        assert done is not None and done.state == State.STATE_DONE, done
        assert (done.restarts, done.checkpoint_episode) == (1, STEPS)
        assert done.trainer != running.trainer
        assert [e.episode for e in watched.episodes] == list(range(1, STEPS + 1))
        rewards = [e.reward for e in watched.episodes]
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        assert first <= CHANCE + 0.1, rewards[:10]  # it does not know the answers to begin with
        assert last >= CHANCE + 0.4, rewards  # ...it learned, through the restart

        out = tmp_path / "model"
        async with aio.GatewayClient(client.address) as gateway:
            record = await gateway.download_checkpoint(run.id, out)
        assert record.episode == STEPS

    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-I",
            "-c",
            _ANSWER_HELD_OUT,
            str(out / "model"),
            str(data_root / "datasets" / "held-out" / "train.jsonl"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answered = json.loads(result.stdout.strip().splitlines()[-1])
    assert answered["rows"] == HELD_OUT_ROWS
    print(f"held-out accuracy {answered['accuracy']:.3f}, last 10 steps' reward {last:.3f}")
    # As well as training promised: images it never saw, about as right as its last steps.
    assert answered["accuracy"] >= min(last - 0.2, CHANCE + 0.4), (answered, last)


async def test_a_provider_error_is_not_retried(trainers: Trainers, data_root: Path) -> None:
    store, processes = trainers.store, trainers.processes
    alive = tuple(address for proc, address in processes if proc.poll() is None)
    images = data_root / "datasets" / "vanishing" / "images"
    async with running_gateway(
        alive, checkpoint_store=str(store), heartbeat_timeout_s=5.0, schedule_poll_s=0.2
    ) as client:
        # One prompt of two completions a step: an epoch is the dataset's 4 rows, and the
        # second epoch decodes every image again.
        request = _grpo("datasets/vanishing/train.jsonl", 8, 1, num_generations=2, batch_size=2)
        request.task.grpo.dataloader_num_workers = 2  # the decoding warns in worker processes
        run = (await client.stub.CreateRun(request, timeout=TIMEOUT)).run

        async def checkpointed() -> bool:
            return (await get_run(client.stub, run.id)).checkpoint_episode >= 1

        await until(checkpointed, "a first checkpoint", JOB_TIMEOUT)
        (images / "palette.png").unlink()
        watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)

    failed = watched.finished
    assert failed is not None and failed.state == State.STATE_ERROR, failed
    assert failed.restarts == 0 and failed.checkpoint_episode >= 1
    assert "image" in failed.error_message.lower(), failed.error_message


def test_the_trainers_wrote_only_json_lines(trainers: Trainers) -> None:
    """Runs last in the module: stops the trainers and reads what they wrote."""
    records: list[dict[str, object]] = []
    for (proc, address), log in zip(trainers.processes, trainers.logs, strict=True):
        killed = proc.poll() is not None
        if not killed:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=TIMEOUT) == 0
        assert proc.stdout is not None
        assert proc.stdout.read() == b"", f"{address} wrote to stdout after its address"
        lines = log.read_text().splitlines()
        if killed and lines:
            lines.pop()  # kill -9 may cut the last line short
        assert lines, f"no log lines from {address}"
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise AssertionError(f"not a JSON line in {log}: {line!r}") from None
            assert {"time", "level", "logger", "message"} <= record.keys(), record
            records.append(record)
    messages = [str(r["message"]) for r in records]
    # The jobs really ran through the GRPO stack and said so, in JSON.
    assert any("GRPO training started" in m for m in messages), messages[-50:]
    assert any("GRPO training ended" in m for m in messages), messages[-50:]
    # PIL's warning, raised while decoding in a worker process, arrived as a JSON record.
    assert any(
        r["logger"] == "py.warnings" and "Palette images" in str(r["message"]) for r in records
    ), messages[-50:]
