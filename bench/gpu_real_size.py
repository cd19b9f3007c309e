"""Benchmark: GRPO at real size on one GPU, a Trainwire job against bare TRL, full fine-tuning and
LoRA.

``python bench/gpu_real_size.py`` builds, offline, a random-weight model with the shapes of
Qwen2.5-VL-3B (``make_tiny_vlm --preset qwen2_5_vl_3b``) and a colour dataset of 448 x 448
images, then trains the same GRPO steps four ways, with the same settings on both sides (bf16,
8 completions per prompt, at most 128 completion tokens, the same batch, learning rate, seed,
gradient checkpointing and DataLoader workers; LoRA: the same rank, alpha and target modules):

- **Trainwire**: a run created on a gateway (in this process, contract checks on) attached to a
  trainer process on ``cuda:0``, which trains it in its job process; each step is timed as a
  watcher of the run receives its episode;
- **bare TRL**: ``bench/_bare_trl_grpo.py``, ``GRPOTrainer`` alone in a process of its own;

each with full fine-tuning and with LoRA. It prints, per side and mode, the median over the
steps after the first: steps/s, completion tokens/s, the peak of the CUDA allocator, the model
FLOP utilization (the 6N rule: 2N per token to generate, 6N per token to train, 4N with LoRA,
and the vision tower per image patch; attention left out; against the GPU's dense bf16 peak),
and where a step's time goes: for bare TRL generation, reward scoring, the rest of scoring
(log-probabilities, advantages) and the backward and optimizer step; for Trainwire generation
and the time the GPU waits between steps (the episode's wall time less the rank's
``step_time``: the step's log, the episode through the job's channel, the trainer's go for the
next step). Then the ratios it is held to: Trainwire's steps/s at least 0.95 x bare TRL's, and
LoRA's peak memory at most 0.75 x full fine-tuning's. A ``RESULT`` line closes it.

The full fine-tuning run is cancelled on the trainer, without a checkpoint, after its steps (the
gateway then ends it ERROR: its job is gone): a checkpoint of it holds fp32 weights and Adam's
two moments, 12 bytes a parameter (~45 GB for Qwen2.5-VL-3B's 3.75 B), written to local
scratch and then copied into the store: more than the GPU machine's disk holds. The LoRA run
trains one step more and ends as runs end, with its final checkpoint, whose write time and size
the trainer's log gives.

``--dry-run`` (and any machine without CUDA) runs the same four on the CPU at tiny size: the
offline tiny LLaVA (``--arch`` picks another), 64 x 64 images, 2 completions of 8 tokens, 3
steps; its figures only show that every path works. Exit status: 0, 1 when a run failed, 3 when
a GPU run missed a goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import _offline  # noqa: F401  (first: offline libraries, the repository importable)

from tests.fakes.gateway_harness import (
    WatchResult,
    absorb,
    get_run,
    running_gateway,
    trainer_process,
)
from trainer_service.tools import make_demo_dataset
from trainwire.contract import StreamChecker
from trainwire.v1 import (
    episode_pb2,
    gateway_service_pb2,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESET = "qwen2_5_vl_3b"
#: Dense bf16 peak of the GPUs this may run on (FLOP/s), by a word of the device's name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}
#: LoRA on the attention projections of the language model (Qwen2.5-VL's vision blocks name
#: theirs qkv and proj, so these match the language model only).
LORA = {
    "rank": 16,
    "alpha": 32.0,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
GOAL_STEPS_RATIO = 0.95
#: "Clearly below": LoRA's peak GPU memory at most this fraction of full fine-tuning's.
GOAL_PEAK_RATIO = 0.75
GIB = 2**30


@dataclass(frozen=True)
class Size:
    """What the benchmark trains."""

    steps: int
    prompts: int
    generations: int
    tokens: int
    image: int
    checkpointing: bool
    workers: int = 2
    learning_rate: float = 1e-6
    seed: int = 1

    @property
    def batch(self) -> int:
        """Completions per step (per process)."""
        return self.prompts * self.generations


@dataclass
class Shapes:
    """The model's parameter counts and a prompt's size, for the FLOP estimate."""

    total: int  #: every parameter
    language: int  #: parameters a text token passes (the head's matmul included, embeddings not)
    vision: int  #: parameters of the vision tower and projector
    patches: int  #: vision patches per image
    prompt_tokens: int


@dataclass
class Side:
    """One run's steps, as one side saw them."""

    side: str
    mode: str
    walls: list[float] = field(default_factory=list)  #: seconds between step ends
    steps: list[dict[str, float]] = field(default_factory=list)  #: each step's metrics
    peak_gib: float | None = None
    notes: list[str] = field(default_factory=list)

    def steady(self) -> list[int]:
        """The steps measured: all but the first (loading, compiling, allocator warm-up)."""
        return list(range(1, len(self.walls))) or [0]

    def median(self, values: list[float]) -> float:
        return statistics.median([values[i] for i in self.steady()])

    def wall(self) -> float:
        return self.median(self.walls)

    def metric(self, name: str) -> float | None:
        """The median of a metric over the measured steps; None when a step lacks it."""
        values = [float(s[name]) for s in self.steps if name in s]
        if len(values) != len(self.steps) or not values:
            return None
        return self.median(values)

    def tokens_per_step(self) -> float | None:
        """Prompt and completion tokens trained per step (TRL's ``num_tokens`` counter)."""
        seen = [s["num_tokens"] for s in self.steps if "num_tokens" in s]
        if len(seen) != len(self.steps) or len(seen) < 2:
            return None
        return self.median([0.0, *(b - a for a, b in itertools.pairwise(seen))])


# -- building --------------------------------------------------------------------------------


def build_data(work: pathlib.Path, size: Size, model_flags: list[str]) -> pathlib.Path:
    """The data root: the model (``make_tiny_vlm`` with ``model_flags``, in a process of its
    own, unless ``work/data/model`` already holds one) and the dataset."""
    root = work / "data"
    model = root / "model"
    if (model / "config.json").exists():
        print(f"model: the one already in {model}")
    else:
        command = [sys.executable, "-m", "trainer_service.tools.make_tiny_vlm", str(model)]
        started = time.perf_counter()
        subprocess.run(
            [*command, *model_flags],
            check=True,
            cwd=ROOT,
            env=_child_env(),
            stdout=subprocess.DEVNULL,
        )
        print(f"model built in {time.perf_counter() - started:.0f} s ({' '.join(model_flags)})")
    make_demo_dataset.build(root / "colours", rows=64, size=(size.image, size.image))
    return root


def measure_shapes(model_dir: pathlib.Path, dataset: pathlib.Path) -> Shapes:
    """Counts parameters on the meta device and runs the processor on the first row."""
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    decoder = model.get_decoder()
    embeddings = decoder.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    language = sum(p.numel() for p in decoder.parameters()) - embeddings + head
    tied = model.get_output_embeddings().weight is decoder.get_input_embeddings().weight
    vision = total - sum(p.numel() for p in decoder.parameters()) - (0 if tied else head)
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    row = json.loads(dataset.read_text().splitlines()[0])
    text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    image = Image.open(dataset.parent / row["image_paths"][0]).convert("RGB")
    out = processor(text=[text], images=[image], return_tensors="pt")
    if "image_grid_thw" in out:
        patches = int(out["image_grid_thw"].prod())
    else:
        image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        patches = int((out["input_ids"] == image_id).sum())
    return Shapes(total, language, vision, patches, int(out["input_ids"].shape[1]))


def _child_env() -> dict[str, str]:
    """This process's environment with the repository and the client package on the path
    (after what is there: on a GPU machine the carried wheels)."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def task(size: Size, lora: bool) -> episode_pb2.TrainTask:
    grpo = episode_pb2.GrpoTask(
        model_path="model",
        dataset_path="colours/train.jsonl",
        reward_functions=["exact_match"],
        num_generations=size.generations,
        batch_size=size.batch,
        max_completion_length=size.tokens,
        learning_rate=size.learning_rate,
        temperature=1.0,
        dataloader_num_workers=size.workers,
        gradient_checkpointing=size.checkpointing,
    )
    if lora:
        grpo.lora.CopyFrom(
            episode_pb2.LoraConfig(
                rank=LORA["rank"],
                alpha=LORA["alpha"],
                dropout=LORA["dropout"],
                target_modules=LORA["target_modules"],
            )
        )
    return episode_pb2.TrainTask(grpo=grpo)


# -- the Trainwire side ----------------------------------------------------------------------


@contextlib.contextmanager
def _trainer(root: pathlib.Path, work: pathlib.Path, device: str) -> Iterator[str]:
    env = {k: v for k, v in _child_env().items() if k == "PYTHONPATH"}
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    flags = ("--device", device, "--data-root", str(root), "--heartbeat", "1")
    store = ("--checkpoint-store", str(work / "checkpoints"))
    with trainer_process(work / "trainer.log", *flags, *store, slots=1, env=env) as (_, address):
        yield address


async def _trainwire_run(
    client: Any,
    trainer: str,
    log: pathlib.Path,
    size: Size,
    lora: bool,
    timeout: float,
    parameters: int,
) -> Side:
    """One run through the gateway: full fine-tuning is cancelled after its steps, LoRA ends
    with its final checkpoint."""
    side = Side("trainwire", "lora" if lora else "full")
    steps = size.steps + 1 if lora else size.steps + 1000
    request = gateway_service_pb2.CreateRunRequest(
        task=task(size, lora),
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=size.seed),
        episodes_per_second=-1.0,
    )
    run = (await client.stub.CreateRun(request, timeout=30)).run
    checker = StreamChecker.for_task(request.task, request.config, run.id)
    watched = WatchResult()
    started = last = time.perf_counter()
    call = client.stub.WatchRun(gateway_service_pb2.WatchRunRequest(run_id=run.id), timeout=timeout)
    async for message in call:
        seen = len(watched.episodes)
        absorb(watched, message)
        now = time.perf_counter()
        for episode in watched.episodes[seen:]:
            checker.check(episode)
            side.walls.append(now - last)
            side.steps.append(dict(episode.metrics))
            last = now
        if len(watched.episodes) >= size.steps:
            call.cancel()
            break
    first = side.walls[0] if side.walls else time.perf_counter() - started
    side.notes.append(f"first step {first:.1f} s after the run was created (loading)")
    if lora:
        ended = await _finished(client, run.id, timeout)
        written = re.findall(
            rf"run {run.id}: checkpoint of step \d+ written in ([\d.]+) s \((\d+) bytes\)",
            log.read_text(errors="replace"),
        )
        side.notes.append(
            f"ended {gateway_service_pb2.Run.State.Name(ended.state)} with its final "
            + (
                f"checkpoint, written in {float(written[-1][0]):.1f} s "
                f"({int(written[-1][1]) / 1e6:.0f} MB)"
                if written
                else "checkpoint (not in the trainer's log)"
            )
        )
    else:
        async with _trainer_stub(trainer) as stub:
            await stub.CancelJob(
                trainer_service_pb2.CancelJobRequest(run_id=run.id, checkpoint=False), timeout=60
            )
        ended = await _finished(client, run.id, timeout)
        side.notes.append(
            f"cancelled on the trainer after {size.steps} steps, without a checkpoint "
            f"(fp32 weights and Adam's moments: {12 * parameters / 1e9:.1f} GB; "
            f"run {gateway_service_pb2.Run.State.Name(ended.state)})"
        )
    peaks = [s["gpu_memory_peak_gib"] for s in side.steps if "gpu_memory_peak_gib" in s]
    side.peak_gib = max(peaks) if peaks else None
    return side


@contextlib.asynccontextmanager
async def _trainer_stub(address: str) -> Any:
    import grpc

    channel = grpc.aio.insecure_channel(address)
    try:
        yield trainer_service_pb2_grpc.TrainerServiceStub(channel)
    finally:
        await channel.close()


async def _finished(client: Any, run_id: str, timeout: float) -> Any:
    """Waits for the run to finish; returns it."""
    deadline = time.monotonic() + timeout
    finished = (
        gateway_service_pb2.Run.State.STATE_DONE,
        gateway_service_pb2.Run.State.STATE_STOPPED,
        gateway_service_pb2.Run.State.STATE_ERROR,
    )
    while True:
        run = await get_run(client.stub, run_id)
        if run.state in finished:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def trainwire_side(
    root: pathlib.Path,
    work: pathlib.Path,
    device: str,
    size: Size,
    timeout: float,
    parameters: int,
) -> list[Side]:
    with _trainer(root, work, device) as trainer:
        async with running_gateway(
            (trainer,), checkpoint_store=str(work / "checkpoints"), heartbeat_timeout_s=60.0
        ) as client:
            log = work / "trainer.log"
            return [
                await _trainwire_run(client, trainer, log, size, lora, timeout, parameters)
                for lora in (False, True)
            ]


# -- the bare TRL side -----------------------------------------------------------------------


def bare_side(root: pathlib.Path, work: pathlib.Path, device: str, size: Size) -> list[Side]:
    spec = {
        "model": str(root / "model"),
        "dataset": str(root / "colours" / "train.jsonl"),
        "device": device,
        "steps": size.steps,
        "batch_size": size.batch,
        "num_generations": size.generations,
        "max_completion_length": size.tokens,
        "learning_rate": size.learning_rate,
        "temperature": 1.0,
        "seed": size.seed,
        "gradient_checkpointing": size.checkpointing,
        "dataloader_num_workers": size.workers,
        "runs": [{"name": "full"}, {"name": "lora", "lora": LORA}],
    }
    (work / "bare-spec.json").write_text(json.dumps(spec, indent=1))
    env = _child_env()
    if not device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    with (work / "bare.log").open("wb") as log:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "_bare_trl_grpo.py"),
                "--spec",
                str(work / "bare-spec.json"),
                "--out",
                str(work / "bare.json"),
            ],
            check=True,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    sides = []
    for result in json.loads((work / "bare.json").read_text()):
        side = Side("bare TRL", result["name"])
        side.walls = [s["wall_s"] for s in result["steps"]]
        side.steps = result["steps"]
        side.peak_gib = result.get("peak_allocated_gib")
        sides.append(side)
    return sides


# -- the report ------------------------------------------------------------------------------


def flops_per_step(side: Side, shapes: Shapes, size: Size) -> float | None:
    """Model FLOPs of one step (see the module docstring); None without a token count."""
    tokens = side.tokens_per_step()
    if tokens is None:
        return None
    lora = side.mode == "lora"
    language = (2 + (4 if lora else 6)) * shapes.language * tokens
    vision = (2 + (2 if lora else 6)) * shapes.vision * shapes.patches * size.batch
    return language + vision


def _cell(value: float | None, width: int, form: str = ".2f", unit: str = "") -> str:
    text = f"{value:{form}}{unit}" if value is not None else "-"
    return f"{text:>{width}}"


def report(sides: list[Side], shapes: Shapes, size: Size, gpu: str) -> dict[str, Any]:
    """Prints the table; returns its figures by ``side/mode``."""
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    print(
        f"{'side':10} {'mode':5} {'steps/s':>8} {'tok/s':>8} {'peak GiB':>9} {'MFU':>6}  "
        f"{'generate':>8} {'reward':>7} {'score':>7} {'bwd+opt':>8} {'idle':>7}  (seconds a step)"
    )
    rows: dict[str, Any] = {}
    for side in sides:
        wall = side.wall()
        length = side.metric("completions/mean_length") or 0.0
        flops = flops_per_step(side, shapes, size)
        mfu = flops / wall / peak if (flops and peak) else None
        bare = side.side == "bare TRL"
        generate = side.metric("generate_s" if bare else "generate_time")
        reward = side.metric("reward_s")
        score = side.metric("score_other_s")
        backward = wall - (generate or 0) - (reward or 0) - (score or 0) if bare else None
        step_time = side.metric("step_time")
        idle = wall - step_time if (step_time is not None and not bare) else None
        print(
            f"{side.side:10} {side.mode:5} {_cell(1 / wall, 8, '.3f')} "
            f"{_cell(size.batch * length / wall, 8, '.0f')} {_cell(side.peak_gib, 9)} "
            f"{_cell(mfu * 100 if mfu else None, 6, '.1f', '%')}  {_cell(generate, 8)} "
            f"{_cell(reward, 7)} {_cell(score, 7)} {_cell(backward, 8)} {_cell(idle, 7, '.3f')}"
        )
        rows[f"{side.side}/{side.mode}"] = {
            "steps_per_s": 1 / wall,
            "completion_tokens_per_s": size.batch * length / wall,
            "mean_completion_tokens": length,
            "peak_gib": side.peak_gib,
            "mfu": mfu,
            "generate_s": generate,
            "reward_s": reward,
            "score_other_s": score,
            "backward_optimizer_s": backward,
            "idle_between_steps_s": idle,
            "walls_s": side.walls,
            "notes": side.notes,
        }
    for side in sides:
        for note in side.notes:
            print(f"  {side.side} {side.mode}: {note}")
    return rows


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--steps", type=int, help="steps per run (the first is not measured)")
    parser.add_argument("--prompts", type=int, help="prompts per step (x 8 completions)")
    parser.add_argument("--preset", default=PRESET, help="make_tiny_vlm's preset (GPU runs)")
    parser.add_argument(
        "--arch", default="llava", help="make_tiny_vlm's architecture of a dry run's tiny model"
    )
    parser.add_argument("--work", type=pathlib.Path, help="where the model and logs go")
    parser.add_argument(
        "--no-gradient-checkpointing", action="store_true", help="keep activations (more memory)"
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here too")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most")
    args = parser.parse_args()
    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("no CUDA GPU here: a dry run at tiny size on the CPU")
    device = "cpu" if dry else "cuda:0"
    if dry:
        size = Size(args.steps or 3, args.prompts or 1, 2, 8, 64, False, workers=1)
        gpu = "cpu"
    else:
        size = Size(
            args.steps or 4, args.prompts or 4, 8, 128, 448, not args.no_gradient_checkpointing
        )
        gpu = torch.cuda.get_device_name(0)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="gpu-real-size-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_flags = ["--arch", args.arch] if dry else ["--preset", args.preset]
        root = build_data(work, size, model_flags)
        shapes = measure_shapes(root / "model", root / "colours" / "train.jsonl")
    except (subprocess.CalledProcessError, OSError, ValueError) as exc:
        print(f"FAILED: building the model and data in {work}: {type(exc).__name__}: {exc}")
        print(f"RESULT real_size device={gpu.replace(' ', '_')} status=failed")
        return 1
    print(
        f"GRPO {f'dry run, tiny {args.arch}' if dry else args.preset} on {gpu}: "
        f"{_count(shapes.language)} language + {_count(shapes.vision)} vision parameters, "
        f"{'fp32' if dry else 'bf16 autocast'}, {size.generations} completions x {size.prompts} "
        f"prompts = {size.batch} per step, <= {size.tokens} tokens, {size.image}x{size.image} "
        f"images ({shapes.patches} patches, {shapes.prompt_tokens}-token prompt), gradient "
        f"checkpointing {'on' if size.checkpointing else 'off'}, {size.workers} DataLoader "
        f"workers, {size.steps} steps (the first not measured); work dir {work}"
    )
    failed = False
    sides: list[Side] = []
    try:
        sides += asyncio.run(trainwire_side(root, work, device, size, args.timeout, shapes.total))
    except Exception as exc:
        failed = True
        print(f"FAILED: the Trainwire side: {type(exc).__name__}: {exc}; see {work}/trainer.log")
    try:
        sides += bare_side(root, work, device, size)
    except Exception as exc:
        failed = True
        print(f"FAILED: the bare TRL side: {type(exc).__name__}: {exc}; see {work}/bare.log")
    order = {("bare TRL", "full"): 0, ("trainwire", "full"): 1, ("bare TRL", "lora"): 2}
    sides.sort(key=lambda s: order.get((s.side, s.mode), 3))
    rows = report(sides, shapes, size, gpu) if sides else {}
    ratios = {}
    for mode in ("full", "lora"):
        ours, theirs = rows.get(f"trainwire/{mode}"), rows.get(f"bare TRL/{mode}")
        if ours and theirs:
            ratios[f"{mode}_steps_ratio"] = ours["steps_per_s"] / theirs["steps_per_s"]
    for side in ("trainwire", "bare TRL"):
        full, lora = rows.get(f"{side}/full"), rows.get(f"{side}/lora")
        if full and lora and full["peak_gib"] and lora["peak_gib"]:
            key = "lora_peak_ratio" if side == "trainwire" else "bare_lora_peak_ratio"
            ratios[key] = lora["peak_gib"] / full["peak_gib"]
    missed = [
        k for k in ("full_steps_ratio", "lora_steps_ratio") if ratios.get(k, 0) < GOAL_STEPS_RATIO
    ]
    if ratios.get("lora_peak_ratio", 1.0) > GOAL_PEAK_RATIO:
        missed.append("lora_peak_ratio")
    peaks = ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if "peak" in k)
    print(
        "trainwire/bare steps/s: "
        + ", ".join(f"{k.split('_')[0]} {v:.3f}" for k, v in ratios.items() if "steps" in k)
        + f" (goal >= {GOAL_STEPS_RATIO}); LoRA/full peak GPU memory: "
        + (f"{peaks} (goal <= {GOAL_PEAK_RATIO})" if peaks else "none on the CPU")
        + (f"; missed: {', '.join(missed)}" if missed and not dry else "")
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "gpu": gpu,
                    "size": size.__dict__,
                    "shapes": shapes.__dict__,
                    "rows": rows,
                    "ratios": ratios,
                },
                indent=1,
            )
        )
    status = "failed" if failed else ("dry-run" if dry else ("missed" if missed else "met"))
    print(
        f"RESULT real_size device={gpu.replace(' ', '_')} status={status} "
        + " ".join(f"{k}={v:.3f}" for k, v in ratios.items())
    )
    if failed:
        return 1
    return 3 if (missed and not dry) else 0


if __name__ == "__main__":
    sys.exit(main())
