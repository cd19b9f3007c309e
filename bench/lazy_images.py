"""Benchmark: the lazy image dataset against the materialized path, and the GRPO step gate's cost.

Prints, side by side in one run (``python bench/lazy_images.py``):

1. time to first batch (reading the JSONL to holding a batch of 8, no workers): materialized
   (``datasets.Dataset.from_list`` of decoded images, which re-encodes every image into Arrow;
   measured at N rows, extrapolated to 46k) vs lazy (index table + ``with_transform``), measured
   for real at N rows and at 46,000 rows (the 46k rows share the N images); target: 46k <= 0.5 s
   and within 2x of N. Also the full background row check at 46k;
2. loader throughput (images/s) with 0, 1 and 2 DataLoader workers vs a plain PIL decode loop;
3. disk cache: per-image time without a cache, on a miss and on a hit, for the PNG set and for
   expensive sources (JPEG photos of 1, 6 and 12 megapixels);
4. decodes per unique row over GRPO-style batches (``RepeatSampler``), without and with the memo;
5. GRPO step time on the tiny VLM with a rank's step gate vs plain TRL (target < 2 %).

Everything runs on CPU with one torch thread; images and the tiny model are generated into a
temp dir. ``--rows`` trades precision for time (default 400, a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import _offline  # noqa: F401  (first: offline libraries, the repository importable)
import datasets
import torch
from PIL import Image
from torch.utils.data import DataLoader

from trainer_service.providers.grpo.lazy_images import LazyImageDataset, RowTransform
from trainer_service.tools import make_demo_dataset, make_tiny_vlm

FULL_SET = 46_000
BATCH = 8


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _identity(batch: list[Any]) -> list[Any]:
    return batch


def first_batch(jsonl: pathlib.Path, root: pathlib.Path, repeats: int = 5) -> dict[str, float]:
    """Seconds from opening the JSONL to holding the first batch, lazy path (median of runs).

    Returns:
        ``setup`` (open the file, build the index table), ``batch`` (first batch through a
        DataLoader, no workers) and ``total``.
    """

    def open_lazy() -> Any:
        data = LazyImageDataset.from_jsonl(jsonl, data_root=root)
        return datasets.Dataset.from_dict({"_i": list(range(len(data)))}).with_transform(
            RowTransform(data)
        )

    def once() -> tuple[float, float]:
        t_setup, table = _timed(open_lazy)
        t_batch, _ = _timed(
            lambda: next(iter(DataLoader(table, batch_size=BATCH, collate_fn=_identity)))
        )
        return t_setup, t_batch

    runs = sorted((once() for _ in range(repeats)), key=sum)
    setup, batch = runs[len(runs) // 2]
    return {"setup": setup, "batch": batch, "total": setup + batch}


def materialized_first_batch(jsonl: pathlib.Path, root: pathlib.Path) -> float:
    """Seconds to the first batch when every image is decoded and put in Arrow up front."""

    def materialized() -> Any:
        lazy = LazyImageDataset.from_jsonl(jsonl, data_root=root)
        rows = [lazy[i] for i in range(len(lazy))]  # decode everything up front
        table = datasets.Dataset.from_list(rows)  # re-encodes every image into Arrow
        return next(iter(DataLoader(table, batch_size=BATCH, collate_fn=_identity)))

    elapsed, batch = _timed(materialized)
    lazy_first = LazyImageDataset.from_jsonl(jsonl, data_root=root)[0]["image"]
    assert batch[0]["image"].tobytes() == lazy_first.tobytes()
    return elapsed


def repeated_jsonl(jsonl: pathlib.Path, rows: int) -> pathlib.Path:
    """A JSONL of ``rows`` rows cycling through ``jsonl``'s rows (so they share its images)."""
    lines = [line for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = jsonl.with_name(f"repeated-{rows}.jsonl")
    out.write_text("\n".join(lines[i % len(lines)] for i in range(rows)) + "\n", encoding="utf-8")
    return out


def check_all_seconds(jsonl: pathlib.Path, root: pathlib.Path) -> float:
    """Seconds for the background check of every row (parse + path checks, no decoding)."""
    data = LazyImageDataset.from_jsonl(jsonl, data_root=root)
    elapsed, checked = _timed(data.check_rows)
    assert checked == len(data)
    return elapsed


def loader_rate(
    jsonl: pathlib.Path, root: pathlib.Path, workers: int, limit: int | None = None
) -> float:
    """Images/s through DataLoader(with_transform) with ``workers`` processes.

    Workers start the way the provider starts them (a preloaded fork server), start-up included.
    """
    from trainer_service.providers.grpo.settings import worker_start_method

    data = LazyImageDataset.from_jsonl(jsonl, data_root=root)
    table = datasets.Dataset.from_dict({"_i": list(range(limit or len(data)))}).with_transform(
        RowTransform(data)
    )
    loader = DataLoader(
        table,
        batch_size=BATCH,
        num_workers=workers,
        collate_fn=_identity,
        multiprocessing_context=worker_start_method() if workers else None,
    )
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)  # includes worker start-up, as training does
    return count / (time.perf_counter() - start)


def plain_rate(paths: list[pathlib.Path]) -> float:
    """Images/s of ``Image.open(p).convert("RGB")`` in a loop."""
    start = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            image.convert("RGB")
    return len(paths) / (time.perf_counter() - start)


def cache_times(jsonl: pathlib.Path, root: pathlib.Path, rows: int) -> tuple[float, float, float]:
    """Per-image ms: no cache, cache miss (cold), cache hit (warm)."""
    with tempfile.TemporaryDirectory() as cache:
        out = []
        for cache_dir in (None, pathlib.Path(cache), pathlib.Path(cache)):
            data = LazyImageDataset.from_jsonl(jsonl, data_root=root, cache_dir=cache_dir)
            elapsed, _ = _timed(lambda d=data: [d[i] for i in range(rows)])
            out.append(elapsed / rows * 1000)
        return out[0], out[1], out[2]


def write_photos(
    directory: pathlib.Path, size: tuple[int, int], count: int, fmt: str = "JPEG"
) -> pathlib.Path:
    """``count`` photo-like images (smooth gradients, shapes, mild noise) + a JSONL.

    ``fmt`` is ``JPEG`` (quality 90) or ``JPEG2000`` (Pillow's default lossy settings).

    Photo-like rather than noise: JPEG and PNG sizes (and so decode costs) of noise are not
    those of photographs.
    """
    import numpy as np
    from PIL import ImageDraw, ImageFilter

    directory.mkdir(parents=True, exist_ok=True)
    width, height = size
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
        y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
        base = rng.uniform(0, 255, size=(1, 1, 3)).astype(np.float32)
        pixels = base * (0.6 + 0.4 * x) * (0.7 + 0.3 * y)
        pixels += rng.normal(0, 6, size=(height, width, 3)).astype(np.float32)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
            r = rng.uniform(0.03, 0.2) * min(size)
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=colour)
        image = image.filter(ImageFilter.GaussianBlur(1.5))
        name = f"photo_{i:03d}.{'jpg' if fmt == 'JPEG' else 'jp2'}"
        image.save(directory / name, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        lines.append(f'{{"prompt": [], "image_paths": ["{name}"], "solution": "x"}}')
    jsonl = directory / "photos.jsonl"
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return jsonl


def decodes_per_row(jsonl: pathlib.Path, root: pathlib.Path, memo_rows: int) -> float:
    """Decodes per unique row over 10 GRPO steps (G=4, 2 prompts per step)."""
    from trl.trainer.utils import RepeatSampler

    generations, prompts = 4, 2
    data = LazyImageDataset.from_jsonl(jsonl, data_root=root, memo_rows=memo_rows)
    transform = RowTransform(data)
    sampler = RepeatSampler(data, mini_repeat_count=generations, batch_size=prompts, seed=0)
    indices = list(sampler)[: 10 * generations * prompts]
    step = generations * prompts
    for start in range(0, len(indices), step):
        transform({"_i": indices[start : start + step]})
    return data.stats.decodes_per_unique_row()


def grpo_step_times(root: pathlib.Path, steps: int, repeats: int) -> dict[str, Any]:
    """Step time of plain TRL vs TRL + a rank's step gate, alternating runs.

    The gate is the callback every rank of a job trains with (``callback.StepGate``), here
    with a channel that grants every step at once, so what is timed is its own work: making and
    serializing each step's episode (its samples' thumbnails and step metrics included). Per run
    the median TRL ``step_time``; across runs the minimum (the run least disturbed by other load
    on a shared box). The gate's own time is measured directly as well.
    """
    from trainer_service.core.provider import EpisodeCounter, TrainJob
    from trainer_service.providers.grpo.build import build_trainer
    from trainer_service.providers.grpo.callback import EpisodeMaker
    from trainer_service.providers.grpo.rewards import CompletionTap
    from trainwire.v1 import episode_pb2

    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path="model",
            dataset_path="small/train.jsonl",
            reward_functions=["exact_match", "format", "length"],
            num_generations=4,
            batch_size=4,
            max_completion_length=16,
            dataloader_num_workers=0,
        )
    )
    job = TrainJob(
        run_id="bench",
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=steps, seed=1),
        device="cpu",
        data_root=root,
        image_cache_dir=None,
        stop_event=threading.Event(),
    )
    results: dict[str, list[float]] = {"plain": [], "gated": []}
    callback_s: list[float] = []
    for _ in range(repeats):
        for mode in ("plain", "gated"):
            with tempfile.TemporaryDirectory() as scratch:
                if mode == "plain":
                    trainer = build_trainer(job, output_dir=scratch)
                    trainer.train()
                else:
                    tap = CompletionTap()
                    maker = EpisodeMaker(EpisodeCounter(steps), tap)
                    gate = _TimedGate(maker, _GrantingChannel(), steps)
                    trainer = build_trainer(job, [gate], output_dir=scratch, tap=tap)
                    maker.meter = trainer.step_meter  # as a rank wires it (worker.py)
                    trainer.train()
                    callback_s.append(gate.spent / steps)
                times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
                results[mode].append(statistics.median(times[1:]))  # first step warms up
    plain = min(results["plain"])
    gated = min(results["gated"])
    return {
        "plain_ms": plain * 1000,
        "gated_ms": gated * 1000,
        "overhead_pct": (gated - plain) / plain * 100,
        "callback_us": statistics.median(callback_s) * 1e6,
        "callback_pct": statistics.median(callback_s) / plain * 100,
    }


class _GrantingChannel:
    """A rank's channel whose trainer grants every step at once; episodes are serialized as the
    real channel does and dropped."""

    last_step = 0

    def send_episode(self, episode: Any) -> None:
        episode.SerializeToString()

    def wait_step(self, step: int) -> bool:
        return True


def _make_timed_gate() -> type:
    from trainer_service.providers.grpo.callback import StepGate

    class TimedGate(StepGate):  # type: ignore[misc]
        """The step gate, timing its own work (on_log)."""

        spent = 0.0

        def on_log(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().on_log(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

    return TimedGate


_TimedGate: Any = None


def main() -> int:
    global _TimedGate
    parser = argparse.ArgumentParser(description="lazy image dataset benchmark")
    parser.add_argument("--rows", type=int, default=400, help="images (640x480) to generate")
    parser.add_argument("--grpo-steps", type=int, default=10, help="GRPO steps per run")
    parser.add_argument("--grpo-repeats", type=int, default=5, help="alternating run pairs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    _TimedGate = _make_timed_gate()
    import logging

    logging.disable(logging.WARNING)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    with tempfile.TemporaryDirectory(prefix="bench-lazy-") as tmp:
        root = pathlib.Path(tmp)
        gen_s, jsonl = _timed(
            lambda: make_demo_dataset.build(root / "big", rows=args.rows, size=(640, 480))
        )
        paths = sorted((root / "big" / "images").glob("*.png"))
        size_mb = sum(p.stat().st_size for p in paths) / 2**20
        print(
            f"dataset: {args.rows} PNG images 640x480, {size_mb:.0f} MiB "
            f"(generated in {gen_s:.1f} s)"
        )
        print(f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")

        t_mat = materialized_first_batch(jsonl, root)
        small = first_batch(jsonl, root)
        full_jsonl = repeated_jsonl(jsonl, FULL_SET)
        full = first_batch(full_jsonl, root)
        scale = FULL_SET / args.rows
        ratio = full["total"] / small["total"]
        flat = full["total"] <= 0.5 and ratio <= 2.0
        print("\n1. time to first batch (batch of 8, no workers; lazy: median of 5)")
        print(f"   {'':26}{args.rows:>9} rows{FULL_SET:>12} rows")
        print(
            f"   {'materialized (Arrow)':26}{t_mat:>12.2f} s{t_mat * scale / 3600:>12.2f} h "
            "(extrapolated)"
        )
        for name, key in (("lazy: open + index table", "setup"), ("lazy: first batch", "batch")):
            print(f"   {name:26}{small[key]:>12.3f} s{full[key]:>12.3f} s")
        print(f"   {'lazy: total':26}{small['total']:>12.3f} s{full['total']:>12.3f} s (measured)")
        print(
            f"   46k / {args.rows}: {ratio:.2f}x; target <= 0.5 s and <= 2x: "
            f"{'met' if flat else 'MISSED'}"
        )
        print(
            f"   background check of all {FULL_SET} rows (parse + paths, no decode): "
            f"{check_all_seconds(full_jsonl, root):.2f} s"
        )

        # The fork server starts once per trainer process (it imports torch); keep that one-off
        # cost out of the per-run figures below and report it on its own.
        server_s, _ = _timed(lambda: loader_rate(jsonl, root, 1, limit=BATCH))
        plain = plain_rate(paths)
        rates = {w: loader_rate(jsonl, root, w) for w in (0, 1, 2)}
        print("\n2. loader throughput (images/s, incl. worker start-up)")
        print(f"   {'plain PIL decode loop':24}{plain:>8.0f}   1.00x")
        for w, rate in rates.items():
            print(f"   {f'DataLoader {w} worker(s)':24}{rate:>8.0f}   {rate / plain:.2f}x")
        print(f"   (one-off fork-server start with torch preloaded: {server_s:.1f} s)")

        cache_rows = min(args.rows, 100)
        print("\n3. disk cache (ms per image: no cache, miss, hit; a hit pays when < no cache)")
        sources = [(f"PNG 640x480 noise ({cache_rows})", jsonl, root, cache_rows)]
        for fmt, megapixels, size, count in (
            ("JPEG", 1, (1280, 960), 20),
            ("JPEG", 6, (3000, 2000), 8),
            ("JPEG", 12, (4000, 3000), 4),
            ("JPEG2000", 6, (3000, 2000), 4),
        ):
            photos = write_photos(root / f"photos-{fmt}-{megapixels}mp", size, count, fmt)
            label = f"{fmt.replace('2000', ' 2000')} {megapixels} MP photo ({count})"
            sources.append((label, photos, root, count))
        print(f"   {'source':30}{'no cache':>10}{'miss':>10}{'hit':>10}{'hit/none':>10}")
        for label, source, source_root, count in sources:
            none_ms, miss_ms, hit_ms = cache_times(source, source_root, count)
            print(
                f"   {label:30}{none_ms:>10.2f}{miss_ms:>10.2f}{hit_ms:>10.2f}"
                f"{hit_ms / none_ms:>9.2f}x"
            )

        without, with_memo = decodes_per_row(jsonl, root, 0), decodes_per_row(jsonl, root, 2)
        print("\n4. decodes per unique row (10 GRPO steps, num_generations=4)")
        print(f"   {'without memo':24}{without:>8.2f}")
        print(f"   {'with memo':24}{with_memo:>8.2f}   {without / with_memo:.1f}x fewer decodes")

        make_tiny_vlm.build(root / "model")
        make_demo_dataset.build(root / "small", rows=16)
        grpo = grpo_step_times(root, args.grpo_steps, args.grpo_repeats)
        print(
            f"\n5. GRPO step time, tiny VLM on CPU (best of {args.grpo_repeats} runs of the "
            f"median TRL step_time over {args.grpo_steps} steps)"
        )
        print(f"   {'plain TRL':24}{grpo['plain_ms']:>8.1f} ms")
        print(
            f"   {'with the step gate':24}{grpo['gated_ms']:>8.1f} ms   "
            f"{grpo['overhead_pct']:+.1f} % (run-to-run noise included)"
        )
        print(
            f"   {'gate own time':24}{grpo['callback_us']:>8.0f} us   "
            f"{grpo['callback_pct']:.2f} % of a step (target < 2 %)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
