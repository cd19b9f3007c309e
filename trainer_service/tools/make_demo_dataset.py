"""Writes a generated image+text GRPO dataset: PNG images plus a JSONL file of prepared rows.

``python -m trainer_service.tools.make_demo_dataset DIR`` writes ``DIR/images/*.png`` and
``DIR/train.jsonl``: each image shows one shape (circle, square, triangle, cross, diamond or star)
in one colour on a noisy gray background, and each row asks about it. ``--kind colour`` (the
default) asks for the colour, ``--kind shape`` for the shape; the answers are balanced over
``--answers`` (default ``red,green,blue,yellow`` for colours, ``circle,square,triangle,cross``
for shapes), so a policy that ignores the pixels scores ``1 / len(answers)`` with
``exact_match``.

Each row is what the ``grpo`` provider expects: a conversational ``prompt`` (a user message with
an image part and the question), ``image_paths`` relative to the JSONL file, ``solution`` (the
one-word answer), an ``assistant_response`` (a reference answer the lazy dataset drops) and the
extra keys ``colour`` and ``shape`` (passed through to reward functions).

Images are deterministic for a given seed. The background is noise (not a flat colour) so that
PNG decoding costs what it costs on real photos of the same size: flat images compress to almost
nothing and would make decode benchmarks meaningless. ``--distinct-images M`` lets many rows
share M image files (large row counts for data-path benchmarks without writing every image);
:func:`write_gray_ablation` writes a copy of a dataset whose every image is uniform gray.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
from collections.abc import Sequence

#: RGB values of the colours the generator can draw (a superset of any default answer set).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 60, 220),
    "yellow": (235, 215, 40),
    "orange": (245, 140, 20),
    "purple": (130, 40, 170),
    "pink": (250, 150, 200),
    "brown": (120, 70, 30),
    "black": (15, 15, 15),
    "white": (245, 245, 245),
}
#: Shapes the generator can draw.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "diamond", "star")
DEFAULT_ANSWERS: dict[str, tuple[str, ...]] = {
    "colour": ("red", "green", "blue", "yellow"),
    "shape": ("circle", "square", "triangle", "cross"),
}
QUESTIONS: dict[str, str] = {
    "colour": "What colour is the shape in the image? Answer with one word.",
    "shape": "What shape is in the image? Answer with one word.",
}
GRAY_IMAGE = "gray.png"


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of ``shape`` centred at (cx, cy) with outer radius ``r`` (not for circles)."""

    def ring(count: int, radius: float, start: float) -> list[tuple[float, float]]:
        return [
            (
                cx + radius * math.cos(start + 2 * math.pi * k / count),
                cy + radius * math.sin(start + 2 * math.pi * k / count),
            )
            for k in range(count)
        ]

    if shape == "square":
        s = r * 0.8
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return ring(3, r, -math.pi / 2)
    if shape == "diamond":
        return ring(4, r, -math.pi / 2)
    if shape == "star":
        outer, inner = ring(5, r, -math.pi / 2), ring(5, r * 0.45, -math.pi / 2 + math.pi / 5)
        return [point for pair in zip(outer, inner, strict=True) for point in pair]
    if shape == "cross":
        a, b = r, r * 0.35
        return [
            (cx - b, cy - a), (cx + b, cy - a), (cx + b, cy - b), (cx + a, cy - b),
            (cx + a, cy + b), (cx + b, cy + b), (cx + b, cy + a), (cx - b, cy + a),
            (cx - b, cy + b), (cx - a, cy + b), (cx - a, cy - b), (cx - b, cy - b),
        ]  # fmt: skip
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def write_image(
    path: pathlib.Path,
    colour: tuple[int, int, int],
    size: tuple[int, int],
    seed: int,
    shape: str = "square",
) -> None:
    """Writes one PNG: a ``colour`` ``shape`` on a noisy gray background.

    The shape's size (45-80 % of the shorter side) and position vary with ``seed``.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = size
    rng = np.random.default_rng(seed)
    pixels = rng.integers(88, 168, size=(height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, mode="RGB")
    side = min(width, height)
    r = side * rng.uniform(0.225, 0.4)
    cx = rng.uniform(r, width - r) if width > 2 * r else width / 2
    cy = rng.uniform(r, height - r) if height > 2 * r else height / 2
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=colour)
    # Fast compression: noise does not compress anyway, and big bench sets build quicker.
    image.save(path, format="PNG", compress_level=1)


def _row(
    paths: Sequence[str], question: str, solution: str, colour: str, shape: str
) -> dict[str, object]:
    content: list[dict[str, str]] = [{"type": "image"} for _ in paths]
    content.append({"type": "text", "text": question})
    return {
        "prompt": [{"role": "user", "content": content}],
        "image_paths": list(paths),
        "solution": solution,
        "assistant_response": solution,
        "colour": colour,
        "shape": shape,
    }


def build(
    directory: pathlib.Path,
    rows: int = 64,
    size: tuple[int, int] = (48, 40),
    seed: int = 0,
    images_per_row: int = 1,
    *,
    kind: str = "colour",
    answers: Sequence[str] | None = None,
    question: str | None = None,
    distinct_images: int | None = None,
    file_name: str = "train.jsonl",
) -> pathlib.Path:
    """Writes the dataset and returns the path of its JSONL file.

    Args:
        directory: Output directory (created if missing).
        rows: Number of rows.
        size: Image size in pixels, (width, height).
        seed: Seed for answers, shapes, positions and noise.
        images_per_row: Images per row (all show the same answer); rows with several images
            exercise the ``images`` key.
        kind: ``colour`` (the solution is the shape's colour) or ``shape``.
        answers: The possible solutions, balanced over the rows (default per kind:
            :data:`DEFAULT_ANSWERS`).
        question: The question's wording (default per kind: :data:`QUESTIONS`).
        distinct_images: Write only this many distinct images per slot and let rows share them
            (row ``i`` uses image ``i % distinct_images``); ``None``: one image per row.
        file_name: Name of the JSONL file.

    Raises:
        ValueError: Unknown kind, colour or shape, or non-positive counts.
    """
    if kind not in DEFAULT_ANSWERS:
        raise ValueError(f"kind {kind!r} must be one of {', '.join(DEFAULT_ANSWERS)}")
    chosen = tuple(answers or DEFAULT_ANSWERS[kind])
    known = COLOURS if kind == "colour" else SHAPES
    unknown = [a for a in chosen if a not in known]
    if unknown or len(set(chosen)) < 2:
        raise ValueError(
            f"answers {', '.join(chosen)}: need at least two distinct {kind}s "
            f"among {', '.join(known)}"
        )
    if rows < 1 or images_per_row < 1 or (distinct_images is not None and distinct_images < 1):
        raise ValueError("rows, images_per_row and distinct_images must be >= 1")
    rng = random.Random(seed)
    solutions = [chosen[i % len(chosen)] for i in range(rows)]
    rng.shuffle(solutions)
    images = rows if distinct_images is None else min(rows, distinct_images)
    directory.mkdir(parents=True, exist_ok=True)
    images_dir = directory / "images"
    images_dir.mkdir(exist_ok=True)
    text = question or QUESTIONS[kind]
    lines = []
    drawn: dict[int, tuple[str, str]] = {}  # image index -> (colour, shape) it shows
    for row in range(rows):
        image_index = row % images
        if image_index not in drawn:
            solution = solutions[row]
            if kind == "colour":
                drawn[image_index] = (solution, rng.choice(SHAPES))
            else:
                drawn[image_index] = (rng.choice(sorted(COLOURS)), solution)
            colour, shape = drawn[image_index]
            for slot in range(images_per_row):
                write_image(
                    images_dir / f"{image_index:05d}_{slot}.png",
                    COLOURS[colour],
                    size,
                    seed * 1_000_003 + image_index * 31 + slot,
                    shape,
                )
        colour, shape = drawn[image_index]
        paths = [f"images/{image_index:05d}_{slot}.png" for slot in range(images_per_row)]
        solution = colour if kind == "colour" else shape
        lines.append(json.dumps(_row(paths, text, solution, colour, shape)))
    dataset = directory / file_name
    dataset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dataset


def write_gray_ablation(dataset: pathlib.Path, file_name: str = "gray.jsonl") -> pathlib.Path:
    """Writes a copy of ``dataset`` whose every image is one uniform gray image.

    The copy sits next to ``dataset`` (same prompts and solutions); the gray image has the size
    of the dataset's first image. A policy trained on it can only learn text shortcuts.

    Returns:
        The path of the copy.
    """
    from PIL import Image

    rows = [json.loads(line) for line in dataset.read_text(encoding="utf-8").splitlines() if line]
    with Image.open(dataset.parent / rows[0]["image_paths"][0]) as first:
        size = first.size
    Image.new("RGB", size, (128, 128, 128)).save(dataset.parent / GRAY_IMAGE)
    for row in rows:
        row["image_paths"] = [GRAY_IMAGE for _ in row["image_paths"]]
    out = dataset.parent / file_name
    out.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m trainer_service.tools.make_demo_dataset DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path, help="output directory")
    parser.add_argument("--rows", type=int, default=64, help="number of rows (default 64)")
    parser.add_argument("--kind", choices=sorted(DEFAULT_ANSWERS), default="colour")
    parser.add_argument(
        "--answers", default=None, help="comma-separated answers (default: four per kind)"
    )
    parser.add_argument("--question", default=None, help="question wording (default per kind)")
    parser.add_argument("--width", type=int, default=48, help="image width in pixels")
    parser.add_argument("--height", type=int, default=40, help="image height in pixels")
    parser.add_argument("--images-per-row", type=int, default=1, help="images per row")
    parser.add_argument(
        "--distinct-images", type=int, default=None, help="rows share this many image files"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for answers, shapes and noise")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.width < 1 or args.height < 1 or args.images_per_row < 1:
        parser.error("--rows, --width, --height and --images-per-row must be >= 1")
    try:
        path = build(
            args.directory,
            rows=args.rows,
            size=(args.width, args.height),
            seed=args.seed,
            images_per_row=args.images_per_row,
            kind=args.kind,
            answers=args.answers.split(",") if args.answers else None,
            question=args.question,
            distinct_images=args.distinct_images,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
