"""The optional disk cache of decoded dataset images, and the per-process decode counters.

An entry is a lossless PNG of the decoded RGB image, keyed by the sha256 of the source's bytes
(an image file's, or the encoded bytes a dataset row holds) and stored at
``<dir>/<key[:2]>/<key>.png``; it is published atomically (a temp file unique to the writing
process and thread, then ``os.replace``), so concurrent DataLoader workers never see a torn
entry. A hit has the pixels of a miss; an unreadable entry is rewritten.

When it pays: a hit replaces decoding the source with hashing its bytes and decoding a PNG of
the same pixels, so it only pays when the source is much more expensive to decode than a PNG of
its pixels (see the README's measurements, ``python bench/lazy_images.py``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import logging
import os
import pathlib
import tempfile
import threading
from dataclasses import dataclass, field

from PIL import Image

_LOGGER = logging.getLogger(__name__)

#: Environment variable naming the image cache directory when the trainer flag is not given.
CACHE_DIR_ENV = "TRAINWIRE_IMAGE_CACHE_DIR"


@dataclass
class DecodeStats:
    """Per-process counters (each DataLoader worker has its own copy).

    Attributes:
        pid: The process the counters belong to.
        rows: ``__getitem__`` calls.
        memo_hits: Rows served from the memo without decoding.
        decodes: Images decoded (from source or from the cache).
        cache_hits: Images read from the disk cache.
        cache_misses: Images decoded from source and written to the cache.
        cache_rewrites: Unreadable cache entries replaced.
        decodes_by_row: Row index -> images decoded for it in this process.
    """

    pid: int = field(default_factory=os.getpid)
    rows: int = 0
    memo_hits: int = 0
    decodes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_rewrites: int = 0
    decodes_by_row: collections.Counter[int] = field(default_factory=collections.Counter)

    def decodes_per_unique_row(self) -> float:
        """Mean decodes per distinct row read in this process (1.0 per image is ideal)."""
        return self.decodes / len(self.decodes_by_row) if self.decodes_by_row else 0.0


def open_rgb(path: str | os.PathLike[str]) -> Image.Image:
    """Decodes an image file exactly as the plain path does: ``Image.open(path).convert("RGB")``."""
    with Image.open(path) as image:
        return image.convert("RGB")


def decode_rgb(data: bytes) -> Image.Image:
    """Decodes encoded image bytes (PNG, JPEG...) to RGB, as :func:`open_rgb` decodes a file."""
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageCache:
    """A content-addressed disk cache of decoded images (lossless PNG).

    Safe for concurrent use by many processes: an entry is written to a temp file whose name is
    unique to the writing process and thread, then published with ``os.replace``, so readers see
    either no entry or a complete one.

    Args:
        directory: Cache root; created on first write.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory

    def entry_path(self, key: str) -> pathlib.Path:
        """Where the entry for sha256 hex ``key`` lives."""
        return self.directory / key[:2] / f"{key}.png"

    def load(self, source: pathlib.Path, stats: DecodeStats) -> Image.Image:
        """Returns ``source`` decoded to RGB, via the cache.

        Raises:
            OSError: The source cannot be read or decoded.
        """
        return self.load_bytes(source.read_bytes(), stats)

    def load_bytes(self, data: bytes, stats: DecodeStats) -> Image.Image:
        """Returns encoded image bytes decoded to RGB, via the cache.

        Raises:
            OSError: The bytes cannot be decoded.
        """
        key = hashlib.sha256(data).hexdigest()
        entry = self.entry_path(key)
        if entry.exists():
            try:
                image = open_rgb(entry)
            except (OSError, SyntaxError, ValueError) as exc:
                # A torn or corrupt entry (disk full, foreign writer): rebuild it from the source.
                _LOGGER.warning("image cache entry %s unreadable (%s); rewriting it", entry, exc)
                stats.cache_rewrites += 1
            else:
                stats.cache_hits += 1
                return image
        image = decode_rgb(data)
        stats.cache_misses += 1
        self._publish(entry, image)
        return image

    def _publish(self, entry: pathlib.Path, image: Image.Image) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Unique per process and thread: two workers writing the same key never share a temp file.
        prefix = f".{entry.stem}.{os.getpid()}.{threading.get_ident()}."
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                # Level 1: still lossless, and much cheaper to write than the default 6.
                image.save(handle, format="PNG", compress_level=1)
            os.replace(tmp_name, entry)
        except Exception:
            # A cache that cannot be written must not fail training; the image is already decoded.
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            _LOGGER.warning("could not write image cache entry %s", entry, exc_info=True)


def resolve_cache_dir(flag_value: pathlib.Path | None) -> pathlib.Path | None:
    """The cache directory: the trainer flag, else ``$TRAINWIRE_IMAGE_CACHE_DIR``, else none."""
    if flag_value is not None:
        return flag_value
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    return pathlib.Path(env) if env else None
