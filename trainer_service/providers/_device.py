"""Resolves the torch device jobs run on (torch is imported here, under providers/, only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from trainer_service.core.jobs import Gpu

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


def slot_devices(
    spec: str, device: str, description: str, slots: int | str
) -> tuple[tuple[str, ...], str]:
    """The device of each trainer slot, and the trainer's device description.

    ``slots="auto"`` on CUDA chosen by ``auto`` or ``cuda`` gives one slot per visible GPU
    (``cuda:0``, ``cuda:1``, ...: a job of N processes takes N of them); otherwise ``auto`` is
    one slot, and a count puts every slot on ``device``.

    Args:
        spec: The ``--device`` flag (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        device: What it resolved to (:func:`resolve_device`).
        description: Its description.
        slots: The ``--slots`` flag (a count or ``"auto"``).
    """
    if slots != "auto":
        return (device,) * int(slots), description
    if device.startswith("cuda") and spec in ("auto", "cuda"):
        import torch

        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        label = f"{count} x {' / '.join(names)} (cuda:0..{count - 1}, one slot per GPU)"
        return tuple(f"cuda:{i}" for i in range(count)), label
    return (device,), description


def torch_gpus(indices: Sequence[int]) -> list[Gpu]:
    """The name and total memory of CUDA devices ``indices``, as torch reads them (none
    without CUDA): the fallback of :class:`trainer_service.gpus.GpuProbe` where neither NVML nor
    ``nvidia-smi`` is found. Memory in use and utilization read 0: torch has them only through
    NVML, or from a CUDA context that would take memory on every GPU in this process."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in indices:
        if index < torch.cuda.device_count():
            props = torch.cuda.get_device_properties(index)
            gpus.append(Gpu(index, props.name, int(props.total_memory), 0, 0.0))
    return gpus
