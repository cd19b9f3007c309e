"""Thumbnails of the images a GRPO step's samples answered, small enough for an episode.

:func:`thumbnail` fits an image into ``THUMBNAIL_SIDE`` pixels (its longer side; never
enlarged) and encodes it as JPEG, lowering the quality and then the size until it is at most
``MAX_SAMPLE_IMAGE_BYTES``: what it returns always keeps the contract's limit. Transparent
images are flattened onto white. Plain PIL, no torch.

JPEG rather than WebP: it encodes several times faster for a slightly larger thumbnail, and a
rank encodes up to eight per step, on the training thread.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

from PIL import Image, JpegImagePlugin  # noqa: F401 - registered now, not at the first save

from trainwire.contract import MAX_SAMPLE_IMAGE_BYTES

#: Longest side of a thumbnail, in pixels, before any shrinking to fit the byte limit.
THUMBNAIL_SIDE = 128
#: Encoder qualities tried in turn at each size.
_QUALITIES = (80, 60, 40, 25)
#: Each next size is this fraction of the last; the smallest side tried.
_SHRINK = 0.7
_SMALLEST_SIDE = 8

#: The thumbnails' MIME type.
IMAGE_TYPE = "image/jpeg"


def as_image(value: Any) -> Image.Image | None:
    """``value`` as a PIL image: an image, encoded bytes, or a ``{"bytes": ...}`` mapping (a
    Hugging Face ``Image`` value); None for anything else or bytes that do not decode."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, Mapping):
        value = value.get("bytes")
    if isinstance(value, bytes | bytearray) and value:
        try:
            image = Image.open(io.BytesIO(value))
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError):
            return None
        return image
    return None


def thumbnail(
    image: Image.Image, side: int = THUMBNAIL_SIDE, limit: int = MAX_SAMPLE_IMAGE_BYTES
) -> tuple[bytes, str]:
    """``image`` as a small encoded picture of at most ``limit`` bytes.

    Returns:
        (the encoded bytes, their MIME type).

    Raises:
        ValueError: Not even an 8-pixel picture fits ``limit`` (a limit of a few bytes).
    """
    rgb = _rgb(image)
    size = max(1, side)
    while True:
        small = _fit(rgb, size)
        for quality in _QUALITIES:
            data = _encode(small, quality)
            if len(data) <= limit:
                return data, IMAGE_TYPE
        if size <= _SMALLEST_SIDE:
            raise ValueError(f"no thumbnail fits in {limit} bytes")
        size = max(_SMALLEST_SIDE, int(size * _SHRINK))


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def _fit(image: Image.Image, side: int) -> Image.Image:
    width, height = image.size
    scale = min(1.0, side / max(width, height, 1))
    if scale >= 1.0:
        return image
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    # reducing_gap: a quick integer reduction first, then a good filter over what is left.
    return image.resize(size, Image.Resampling.BICUBIC, reducing_gap=2.0)


def _encode(image: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()
