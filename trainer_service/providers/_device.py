"""Resolves the torch device jobs run on (torch is imported here, under providers/, only)."""

from __future__ import annotations

import logging

_LOGGER = logging.getLogger(__name__)


def resolve_device(spec: str) -> tuple[str, str]:
    """Turns ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` into a device and its description.

    Returns:
        ``(device, description)``, e.g. ``("cuda:0", "cuda:0 NVIDIA H200")`` or ``("cpu", "cpu")``.

    Raises:
        ValueError: CUDA was asked for but is not available (or the index is out of range).
    """
    try:
        import torch
    except ImportError:
        if spec in ("auto", "cpu"):
            return "cpu", "cpu"
        raise ValueError(f"device {spec!r} needs torch, which is not installed") from None
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r}: CUDA is not available on this machine")
    index = 0 if spec in ("auto", "cuda") else int(spec.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
    device = f"cuda:{index}"
    return device, f"{device} {torch.cuda.get_device_name(index)}"
