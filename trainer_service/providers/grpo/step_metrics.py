"""What each GRPO optimizer step cost: its wall time, its generation time and speed, and (on CUDA)
its peak of GPU memory.

:class:`StepMeter` is fed from two sides: the trainer's generation call reports each
generation's seconds and completion tokens (:meth:`StepMeter.generated`), and the step gate
marks where each step begins and ends (:meth:`StepMeter.step_began`, :meth:`StepMeter.step_ended`).
:meth:`StepMeter.take` hands the finished step's metrics to its episode:

- ``step_time``: seconds from the step's start (training started, or the trainer's go for it)
  to the end of its optimizer step: loading its batch, generating, scoring, the forward and
  backward passes and the update; a pause before the go is not in it.
- ``generate_time``: seconds the step spent generating completions; 0.0 for a step that trained
  on an earlier step's completions (``steps_per_generation`` or ``num_iterations`` > 1).
- ``completion_tokens_per_second``: the completion tokens the step generated divided by its
  ``generate_time`` (a step that did not generate carries the latest step's that did); absent
  before the first generation.
- ``gpu_memory_peak_gib``: the most GPU memory torch allocated during the step, in GiB; only
  when the job runs on CUDA (``memory`` given).

Each rank measures its own work; rank 0's meter feeds the episodes. Plain Python: the CUDA
counters come in through :class:`MemoryProbe` (:class:`CudaMemory` in a job on CUDA).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

GIB = float(1 << 30)


class MemoryProbe(Protocol):
    """The device's peak-memory counter."""

    def reset(self) -> None:
        """Starts a new peak at the memory in use now."""
        ...

    def peak_bytes(self) -> int:
        """The most memory allocated since the last reset, in bytes."""
        ...


class CudaMemory:
    """torch's peak-memory counter of one CUDA device.

    Args:
        device: ``cuda`` or ``cuda:N``.
    """

    def __init__(self, device: str) -> None:
        import torch

        self._cuda: Any = torch.cuda
        self._device = torch.device(device)

    def reset(self) -> None:
        self._cuda.reset_peak_memory_stats(self._device)

    def peak_bytes(self) -> int:
        return int(self._cuda.max_memory_allocated(self._device))


class StepMeter:
    """Times a rank's steps and generations (see the module docstring); thread-safe.

    Args:
        clock: Seconds, monotonic.
        memory: The device's peak-memory counter (None: not on CUDA, no ``gpu_memory_peak_gib``).
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, memory: MemoryProbe | None = None
    ) -> None:
        self._clock = clock
        self._memory = memory
        self._lock = threading.Lock()
        self._began: float | None = None
        self._step_time: float | None = None
        self._peak_gib: float | None = None
        self._generate_time = 0.0
        self._tokens = 0
        self._tokens_per_second: float | None = None

    def step_began(self) -> None:
        """A step may start now (training started, or the trainer's go for the next step)."""
        if self._memory is not None:
            self._memory.reset()
        with self._lock:
            self._began = self._clock()

    def generated(self, seconds: float, tokens: int) -> None:
        """One generation call took ``seconds`` and produced ``tokens`` completion tokens."""
        with self._lock:
            self._generate_time += seconds
            self._tokens += tokens

    def step_ended(self) -> None:
        """The step's optimizer update is done."""
        peak = self._memory.peak_bytes() / GIB if self._memory is not None else None
        with self._lock:
            if self._began is not None:
                self._step_time = self._clock() - self._began
            self._peak_gib = peak

    def take(self) -> dict[str, float]:
        """The finished step's metrics (see the module docstring); its generation time resets."""
        with self._lock:
            if self._generate_time > 0:
                self._tokens_per_second = self._tokens / self._generate_time
            metrics = {"generate_time": self._generate_time}
            if self._step_time is not None:
                metrics["step_time"] = self._step_time
            if self._tokens_per_second is not None:
                metrics["completion_tokens_per_second"] = self._tokens_per_second
            if self._peak_gib is not None:
                metrics["gpu_memory_peak_gib"] = self._peak_gib
            self._generate_time = 0.0
            self._tokens = 0
            self._step_time = None
            self._peak_gib = None
            return metrics
