"""Writes a small generated image+text GRPO dataset: PNG images plus a JSONL file of prepared rows.

``python -m trainer_service.tools.make_demo_dataset DIR --rows N`` writes ``DIR/images/*.png`` and
``DIR/train.jsonl``. Each row is what the ``grpo`` provider expects: a conversational ``prompt``
(a user message with an image part and a question), ``image_paths`` relative to the JSONL file,
``solution`` (the colour of the square), an ``assistant_response`` (a reference answer the lazy
dataset drops) and an extra key ``shape`` (passed through to reward functions).

Images are deterministic for a given seed: a coloured square on a noisy background, so PNG
decoding costs what it costs on real photos of the same size (pure flat colours would compress
to nothing and make decode benchmarks meaningless).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 60, 220),
    "yellow": (230, 210, 40),
}
QUESTION = "What colour is the square? Answer with one word inside <answer></answer>."


def write_image(
    path: pathlib.Path, colour: tuple[int, int, int], size: tuple[int, int], seed: int
) -> None:
    """Writes one PNG: uniform noise background with a ``colour`` square in the middle."""
    import numpy as np
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    side = max(1, min(width, height) // 2)
    top, left = (height - side) // 2, (width - side) // 2
    pixels[top : top + side, left : left + side] = colour
    # Fast compression: noise does not compress anyway, and big bench sets build quicker.
    Image.fromarray(pixels, mode="RGB").save(path, format="PNG", compress_level=1)


def build(
    directory: pathlib.Path,
    rows: int = 16,
    size: tuple[int, int] = (48, 40),
    seed: int = 0,
    images_per_row: int = 1,
) -> pathlib.Path:
    """Writes the dataset and returns the path of its JSONL file.

    Args:
        directory: Output directory (created if missing).
        rows: Number of rows (and of distinct images per image slot).
        size: Image size in pixels, (width, height).
        seed: Seed for colours and noise.
        images_per_row: Images per row; rows with several images exercise the ``images`` key.
    """
    directory.mkdir(parents=True, exist_ok=True)
    images_dir = directory / "images"
    images_dir.mkdir(exist_ok=True)
    names = sorted(COLOURS)
    lines = []
    for row in range(rows):
        colour = names[(row * 7 + seed) % len(names)]
        paths = []
        for slot in range(images_per_row):
            name = f"{row:05d}_{slot}.png"
            write_image(
                images_dir / name, COLOURS[colour], size, seed * 1_000_003 + row * 31 + slot
            )
            paths.append(f"images/{name}")
        content: list[dict[str, str]] = [{"type": "image"} for _ in paths]
        content.append({"type": "text", "text": QUESTION})
        lines.append(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": content}],
                    "image_paths": paths,
                    "solution": colour,
                    "assistant_response": f"<answer>{colour}</answer>",
                    "shape": "square",
                }
            )
        )
    dataset = directory / "train.jsonl"
    dataset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dataset


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m trainer_service.tools.make_demo_dataset DIR --rows N``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path, help="output directory")
    parser.add_argument("--rows", type=int, default=16, help="number of rows (default 16)")
    parser.add_argument("--width", type=int, default=48, help="image width in pixels")
    parser.add_argument("--height", type=int, default=40, help="image height in pixels")
    parser.add_argument("--images-per-row", type=int, default=1, help="images per row")
    parser.add_argument("--seed", type=int, default=0, help="seed for colours and noise")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.width < 1 or args.height < 1 or args.images_per_row < 1:
        parser.error("--rows, --width, --height and --images-per-row must be >= 1")
    path = build(
        args.directory,
        rows=args.rows,
        size=(args.width, args.height),
        seed=args.seed,
        images_per_row=args.images_per_row,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
