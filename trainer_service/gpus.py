"""The GPUs a trainer's jobs may use, read for ``GetCapabilities``: each one's name, memory and
utilization.

:class:`GpuProbe` reads them, when asked, from the first source this machine has:

1. NVML through ``pynvml`` (the ``nvidia-ml-py`` package), when it imports and initializes;
2. ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` when it is on ``PATH`` (run with
   a timeout: a hung driver delays an answer by ``timeout_s`` at most);
3. a fallback the caller gives (the trainer's: torch's name and total memory of each CUDA
   device, :func:`trainer_service.providers._device.torch_gpus`);
4. none: no GPUs.

Only the GPUs of the trainer's job slots are reported (``cuda_indices``), under the CUDA index
the jobs know them by: NVML and ``nvidia-smi`` number every GPU of the machine, CUDA only those
``CUDA_VISIBLE_DEVICES`` names (by index or UUID), in its order. CUDA enumerates GPUs fastest
first and the driver tools by PCI bus; on a machine of one kind of GPU the two agree.

A reading is kept for ``max_age_s`` (callers asking together share it). A source that fails
(an error, a timeout, output it cannot parse) gives no GPUs, is logged once, and is tried again
only after ``retry_s``; it is logged again once it answers.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from trainer_service.core.jobs import Gpu

_LOGGER = logging.getLogger(__name__)

#: What ``nvidia-smi`` is asked for, in this order (``--query-gpu``).
SMI_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu")
_MIB = 1 << 20


@dataclass(frozen=True)
class Reading:
    """One GPU as a driver tool numbers it.

    Attributes:
        index: Its index on the machine (NVML's, ``nvidia-smi``'s), or its CUDA index when
            ``GpuSource.cuda_indexed``.
        uuid: ``GPU-...`` (empty when unknown).
        gpu: What is reported of it (its ``index`` is set when it is mapped to CUDA's).
    """

    index: int
    uuid: str
    gpu: Gpu


class GpuSource(Protocol):
    """Where GPU readings come from."""

    #: Its readings are numbered as CUDA numbers them (no ``CUDA_VISIBLE_DEVICES`` mapping).
    cuda_indexed: bool

    @property
    def name(self) -> str:
        """For the log."""
        ...

    def read(self) -> list[Reading]:
        """Every GPU it sees. Raises anything on failure."""
        ...


class NvmlSource:
    """NVML through ``pynvml`` (initialized once, by :meth:`open`)."""

    cuda_indexed = False
    name = "NVML"

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    @classmethod
    def open(cls, importer: Callable[[], ModuleType | None]) -> NvmlSource | None:
        """The source, or None when ``pynvml`` does not import or NVML does not initialize
        (no driver)."""
        try:
            nvml = importer()
            if nvml is None:
                return None
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError, a missing libnvidia-ml.so, ...
            _LOGGER.debug("NVML not available: %s", exc)
            return None
        return cls(nvml)

    def read(self) -> list[Reading]:
        nvml = self._nvml
        readings = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except nvml.NVMLError:  # not supported (a MIG-enabled GPU, some vGPUs)
                utilization = 0.0
            gpu = Gpu(
                i, _text(nvml.nvmlDeviceGetName(handle)), memory.total, memory.used, utilization
            )
            readings.append(Reading(i, _text(nvml.nvmlDeviceGetUUID(handle)), gpu))
        return readings


class SmiSource:
    """``nvidia-smi``'s CSV query, run with a timeout."""

    cuda_indexed = False
    name = "nvidia-smi"

    def __init__(self, executable: str, timeout_s: float) -> None:
        self.executable = executable
        self.timeout_s = timeout_s

    def read(self) -> list[Reading]:
        done = subprocess.run(
            [
                self.executable,
                f"--query-gpu={','.join(SMI_FIELDS)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(
                f"exit status {done.returncode}" + (f": {detail[-1][:200]}" if detail else "")
            )
        return parse_smi(done.stdout)


class FallbackSource:
    """The caller's reader of CUDA devices by CUDA index (torch's)."""

    cuda_indexed = True
    name = "torch.cuda"

    def __init__(self, read: Callable[[Sequence[int]], Sequence[Gpu]], indices: Sequence[int]):
        self._read = read
        self._indices = tuple(indices)

    def read(self) -> list[Reading]:
        return [Reading(gpu.index, "", gpu) for gpu in self._read(self._indices)]


def _text(value: str | bytes) -> str:
    """NVML's strings are bytes in older ``pynvml`` releases."""
    return value.decode() if isinstance(value, bytes) else value


def _number(text: str) -> float:
    """A field of ``nvidia-smi``'s CSV; ``[N/A]`` and the like (not supported) are 0."""
    try:
        return float(text)
    except ValueError:
        return 0.0


def parse_smi(output: str) -> list[Reading]:
    """The GPUs of ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``
    (memory in MiB, utilization in percent).

    Raises:
        ValueError: A line without the fields asked for, or without an index.
    """
    readings = []
    for row in csv.reader(output.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != len(SMI_FIELDS):
            raise ValueError(f"want {len(SMI_FIELDS)} fields, got {row!r}")
        index, uuid, name, total, used, utilization = (field.strip() for field in row)
        gpu = Gpu(
            int(index),
            name,
            int(_number(total) * _MIB),
            int(_number(used) * _MIB),
            min(1.0, max(0.0, _number(utilization) / 100.0)),
        )
        readings.append(Reading(int(index), uuid, gpu))
    return readings


def cuda_indices(devices: Sequence[str]) -> tuple[int, ...]:
    """The CUDA indices among torch device names (``cuda`` is ``cuda:0``), sorted, once each."""
    found = set()
    for device in devices:
        kind, _, index = device.partition(":")
        if kind == "cuda":
            found.add(int(index or 0))
    return tuple(sorted(found))


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: the entries up to the first it cannot use (an
    index below 0 or anything but an index or ``GPU-``/``MIG-`` UUID); None when unset."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    return entries


def _matches(entry: str, reading: Reading) -> bool:
    if entry.isdigit():
        return int(entry) == reading.index
    return entry.startswith("GPU-") and bool(reading.uuid) and reading.uuid.startswith(entry)


def jobs_gpus(
    readings: Sequence[Reading], indices: Sequence[int], visible: list[str] | None
) -> tuple[Gpu, ...]:
    """The readings of CUDA devices ``indices``, numbered as CUDA numbers them.

    Args:
        readings: Every GPU of the machine, numbered as the driver numbers them.
        indices: The CUDA indices wanted.
        visible: :func:`visible_devices` (None: every GPU, in the driver's order). A MIG
            instance has no reading of its own, and is left out.
    """
    if visible is None:
        by_index = {r.index: r for r in readings}
        chosen = [(i, by_index.get(i)) for i in indices]
    else:
        chosen = []
        for i in indices:
            entry = visible[i] if i < len(visible) else ""
            chosen.append((i, next((r for r in readings if entry and _matches(entry, r)), None)))
    return tuple(
        Gpu(i, r.gpu.name, r.gpu.memory_total_bytes, r.gpu.memory_used_bytes, r.gpu.utilization)
        for i, r in chosen
        if r is not None
    )


def _import_pynvml() -> ModuleType | None:
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return pynvml  # type: ignore[no-any-return, unused-ignore]


class GpuProbe:
    """Reads the GPUs of CUDA devices ``indices`` when called (see the module docstring).

    Args:
        indices: The CUDA indices the trainer's jobs may use (:func:`cuda_indices` of its slot
            devices); none: the probe reads nothing, ever.
        fallback: Reads CUDA devices by CUDA index when neither NVML nor ``nvidia-smi`` is
            there; None: no fallback.
        environ: Where ``PATH`` and ``CUDA_VISIBLE_DEVICES`` come from (``os.environ``).
        timeout_s: The longest ``nvidia-smi`` may take.
        max_age_s: How long a reading is reused.
        retry_s: How long a failed source is left alone before it is tried again.
        clock: Monotonic seconds.
        nvml: Imports ``pynvml`` (None when it is not installed).
    """

    def __init__(
        self,
        indices: Sequence[int],
        fallback: Callable[[Sequence[int]], Sequence[Gpu]] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        timeout_s: float = 2.0,
        max_age_s: float = 1.0,
        retry_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        nvml: Callable[[], ModuleType | None] = _import_pynvml,
    ) -> None:
        self.indices = tuple(indices)
        self._fallback = fallback
        self._environ = os.environ if environ is None else environ
        self._timeout_s = timeout_s
        self._max_age_s = max_age_s
        self._retry_s = retry_s
        self._clock = clock
        self._nvml = nvml
        self._source: GpuSource | None = None
        self._chosen = False
        self._lock = threading.Lock()
        self._gpus: tuple[Gpu, ...] = ()
        self._read_at = -float("inf")
        self._failing = False

    @property
    def source(self) -> str:
        """The source chosen ("" before the first call or when there is none)."""
        return self._source.name if self._source is not None else ""

    def __call__(self) -> tuple[Gpu, ...]:
        """The GPUs now (a reading at most ``max_age_s`` old; none while the source fails)."""
        if not self.indices:
            return ()
        with self._lock:
            wait = self._retry_s if self._failing else self._max_age_s
            if self._clock() - self._read_at < wait:
                return self._gpus
            if not self._chosen:
                self._source = self._choose()
                self._chosen = True
            self._gpus = self._read()
            self._read_at = self._clock()
            return self._gpus

    def _choose(self) -> GpuSource | None:
        source: GpuSource | None = NvmlSource.open(self._nvml)
        if source is None:
            smi = shutil.which("nvidia-smi", path=self._environ.get("PATH", os.defpath))
            if smi is not None:
                source = SmiSource(smi, self._timeout_s)
            elif self._fallback is not None:
                source = FallbackSource(self._fallback, self.indices)
        _LOGGER.info(
            "GPUs of CUDA devices %s read from %s",
            ", ".join(map(str, self.indices)),
            source.name if source is not None else "nowhere (no NVML, no nvidia-smi)",
        )
        return source

    def _read(self) -> tuple[Gpu, ...]:
        source = self._source
        if source is None:
            return ()
        try:
            readings = source.read()
            visible = None if source.cuda_indexed else visible_devices(self._environ)
            gpus = jobs_gpus(readings, self.indices, visible)
        except subprocess.TimeoutExpired:
            self._failed(source, f"no answer within {self._timeout_s:g} s")
            return ()
        except Exception as exc:
            self._failed(source, f"{type(exc).__name__}: {exc}")
            return ()
        if self._failing:
            _LOGGER.info("reading GPUs from %s works again", source.name)
            self._failing = False
        return gpus

    def _failed(self, source: GpuSource, why: str) -> None:
        if not self._failing:
            _LOGGER.warning(
                "reading GPUs from %s failed (%s): reporting none, trying again every %g s",
                source.name,
                why,
                self._retry_s,
            )
        self._failing = True
