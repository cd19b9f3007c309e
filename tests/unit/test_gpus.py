"""The trainer's GPU probe (``trainer_service.gpus``) at its seams: ``nvidia-smi``'s CSV, which
CUDA devices the jobs see under ``CUDA_VISIBLE_DEVICES``, and the probe over a fake
``nvidia-smi`` (``tests.fakes.nvidia_smi``, a real executable on ``PATH``: answering, failing,
hanging), a fake NVML module and a fallback, with a virtual clock for its cache and retries."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes.nvidia_smi import SMI_OUTPUT, calls, fake_smi
from trainer_service.core.jobs import Gpu
from trainer_service.gpus import (
    GpuProbe,
    Reading,
    cuda_indices,
    jobs_gpus,
    parse_smi,
    visible_devices,
)

MIB = 1 << 20


class Clock:
    """Virtual monotonic seconds."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def no_nvml() -> None:
    return None


def probe(
    directory: Path, indices: tuple[int, ...] = (0, 1), clock: Clock | None = None, **kwargs: Any
) -> GpuProbe:
    environ = {"PATH": str(directory), **kwargs.pop("environ", {})}
    return GpuProbe(
        indices, environ=environ, clock=clock or Clock(), nvml=kwargs.pop("nvml", no_nvml), **kwargs
    )


# -- parsing and mapping ------------------------------------------------------------------------


def test_nvidia_smi_output_is_parsed_into_bytes_and_a_fraction() -> None:
    readings = parse_smi(SMI_OUTPUT)
    assert [r.index for r in readings] == [0, 1, 2, 3]
    assert readings[1] == Reading(
        1,
        "GPU-bbbb2222-0000-0000-0000-000000000000",
        Gpu(1, "NVIDIA H100 80GB HBM3", 81559 * MIB, 40960 * MIB, 0.87),
    )
    assert readings[2].gpu.utilization == 1.0
    assert readings[3].gpu == Gpu(3, "NVIDIA A10", 23028 * MIB, 512 * MIB, 0.0)  # [N/A]
    assert parse_smi("") == []


@pytest.mark.parametrize("bad", ["0, GPU-x, H100, 80", "zero, GPU-x, H100, 1, 2, 3"])
def test_nvidia_smi_output_without_the_fields_asked_for_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_smi(bad)


def test_the_cuda_devices_of_the_slots_are_their_indices_once_each() -> None:
    assert cuda_indices(("cuda:1", "cuda:0", "cuda:1")) == (0, 1)
    assert cuda_indices(("cuda",)) == (0,)
    assert cuda_indices(("cpu", "cpu", "")) == ()


def test_cuda_visible_devices_is_read_as_cuda_reads_it() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3, 1"}) == ["3", "1"]
    # CUDA stops at the first entry it cannot use.
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2,-1,0"}) == ["2"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-cccc,MIG-x,junk,1"}) == [
        "GPU-cccc",
        "MIG-x",
    ]


def test_the_jobs_gpus_are_numbered_as_cuda_numbers_them() -> None:
    readings = parse_smi(SMI_OUTPUT)
    names = lambda gpus: [(g.index, g.memory_used_bytes // MIB) for g in gpus]  # noqa: E731
    assert names(jobs_gpus(readings, (0, 1), None)) == [(0, 1024), (1, 40960)]
    # cuda:0 is the machine's GPU 3, cuda:1 its GPU 1.
    assert names(jobs_gpus(readings, (0, 1), ["3", "1"])) == [(0, 512), (1, 40960)]
    # By UUID (a prefix will do), and a MIG instance or a missing device is left out.
    assert names(jobs_gpus(readings, (0, 1, 2, 3), ["GPU-cccc", "MIG-1", "7"])) == [(0, 2)]
    assert jobs_gpus(readings, (0,), []) == ()
    assert jobs_gpus(readings, (), None) == ()


# -- the probe over nvidia-smi --------------------------------------------------------------------


def test_the_probe_reads_nvidia_smi_and_keeps_a_reading_for_a_second(tmp_path: Path) -> None:
    fake_smi(tmp_path)
    clock = Clock()
    gpus = probe(tmp_path, (0, 1), clock, environ={"CUDA_VISIBLE_DEVICES": "2,1"})
    first = gpus()
    assert first == (
        Gpu(0, "NVIDIA H100 80GB HBM3", 81559 * MIB, 2 * MIB, 1.0),
        Gpu(1, "NVIDIA H100 80GB HBM3", 81559 * MIB, 40960 * MIB, 0.87),
    )
    assert gpus.source == "nvidia-smi"
    (args,) = calls(tmp_path)
    assert args == (
        "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu "
        "--format=csv,noheader,nounits"
    )
    clock.now += 0.5
    assert gpus() == first and len(calls(tmp_path)) == 1  # reused
    clock.now += 0.6
    assert gpus() == first and len(calls(tmp_path)) == 2  # read again


def test_a_cpu_trainer_never_runs_nvidia_smi(tmp_path: Path) -> None:
    fake_smi(tmp_path)
    gpus = probe(tmp_path, cuda_indices(("cpu", "cpu")))
    assert gpus() == () and gpus() == ()
    assert calls(tmp_path) == [] and gpus.source == ""


def test_a_failing_nvidia_smi_reports_none_logs_once_and_is_retried_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed: driver gone" >&2; exit 9')
    clock = Clock()
    gpus = probe(tmp_path, (0,), clock, retry_s=60.0)
    with caplog.at_level(logging.INFO, logger="trainer_service.gpus"):
        assert gpus() == ()
        for _ in range(5):
            clock.now += 2.0
            assert gpus() == ()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "reading GPUs from nvidia-smi failed (RuntimeError: exit status 9: NVIDIA-SMI has "
        "failed: driver gone): reporting none, trying again every 60 s"
    ]
    assert len(calls(tmp_path)) == 1  # left alone for retry_s
    fake_smi(tmp_path)  # the driver is back
    clock.now += 60.0
    with caplog.at_level(logging.INFO, logger="trainer_service.gpus"):
        assert [g.index for g in gpus()] == [0]
    assert "reading GPUs from nvidia-smi works again" in caplog.messages


def test_a_hanging_nvidia_smi_costs_its_timeout_once_and_reports_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_smi(tmp_path, "exec sleep 30")
    clock = Clock()
    gpus = probe(tmp_path, (0,), clock, timeout_s=0.3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer_service.gpus"):
        assert gpus() == ()
        clock.now += 5.0
        assert gpus() == ()
    assert time.monotonic() - started < 10.0  # one timeout, not a hang
    assert len(calls(tmp_path)) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "reading GPUs from nvidia-smi failed (no answer within 0.3 s): reporting none, "
        "trying again every 60 s"
    ]


def test_garbage_from_nvidia_smi_reports_none(tmp_path: Path) -> None:
    fake_smi(tmp_path, "echo 'No devices were found'")
    assert probe(tmp_path, (0,))() == ()


# -- the other sources ----------------------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


def fake_nvml(fail_init: bool = False) -> SimpleNamespace:
    """A ``pynvml`` of two GPUs; the second cannot report its utilization."""
    devices = [
        (b"NVIDIA H200", b"GPU-1111", 150 * 1024 * MIB, 3 * 1024 * MIB, 25),
        ("NVIDIA H200", "GPU-2222", 150 * 1024 * MIB, 140 * 1024 * MIB, None),
    ]

    def init() -> None:
        if fail_init:
            raise FakeNvmlError("Driver Not Loaded")

    def utilization(i: int) -> SimpleNamespace:
        if devices[i][4] is None:
            raise FakeNvmlError("Not Supported")
        return SimpleNamespace(gpu=devices[i][4])

    return SimpleNamespace(
        NVMLError=FakeNvmlError,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda i: devices[i][0],
        nvmlDeviceGetUUID=lambda i: devices[i][1],
        nvmlDeviceGetMemoryInfo=lambda i: SimpleNamespace(total=devices[i][2], used=devices[i][3]),
        nvmlDeviceGetUtilizationRates=utilization,
    )


def test_nvml_comes_first_and_maps_like_nvidia_smi(tmp_path: Path) -> None:
    fake_smi(tmp_path)
    nvml = fake_nvml()
    gpus = probe(
        tmp_path, (0, 1), nvml=lambda: nvml, environ={"CUDA_VISIBLE_DEVICES": "GPU-2222,0"}
    )
    assert gpus() == (
        Gpu(0, "NVIDIA H200", 150 * 1024 * MIB, 140 * 1024 * MIB, 0.0),
        Gpu(1, "NVIDIA H200", 150 * 1024 * MIB, 3 * 1024 * MIB, 0.25),
    )
    assert gpus.source == "NVML" and calls(tmp_path) == []


def test_without_a_driver_nvml_gives_way_to_nvidia_smi(tmp_path: Path) -> None:
    fake_smi(tmp_path)
    nvml = fake_nvml(fail_init=True)
    gpus = probe(tmp_path, (0,), nvml=lambda: nvml)
    assert [g.memory_used_bytes // MIB for g in gpus()] == [1024]
    assert gpus.source == "nvidia-smi"


def test_with_neither_nvml_nor_nvidia_smi_the_fallback_reads_by_cuda_index(
    tmp_path: Path,
) -> None:
    asked: list[tuple[int, ...]] = []

    def fallback(indices: Any) -> list[Gpu]:
        asked.append(tuple(indices))
        return [Gpu(i, "NVIDIA L4", 24 * 1024 * MIB, 0, 0.0) for i in indices]

    # CUDA_VISIBLE_DEVICES is the fallback's business: it numbers devices as CUDA does.
    gpus = probe(tmp_path, (0, 1), fallback=fallback, environ={"CUDA_VISIBLE_DEVICES": "5,6"})
    assert [(g.index, g.name) for g in gpus()] == [(0, "NVIDIA L4"), (1, "NVIDIA L4")]
    assert asked == [(0, 1)] and gpus.source == "torch.cuda"
    assert probe(tmp_path, (0,))() == ()  # no fallback either: none


def test_the_environment_s_path_is_where_nvidia_smi_is_looked_for(tmp_path: Path) -> None:
    fake_smi(tmp_path / "bin")
    path = f"{tmp_path / 'empty'}{os.pathsep}{tmp_path / 'bin'}"
    gpus = GpuProbe((0,), environ={"PATH": path}, nvml=no_nvml)
    assert [g.index for g in gpus()] == [0]
