"""Benchmark: start-up with the cyclic collector running, against paused then frozen
(``trainwire_ops.heap``), for what Trainwire's processes import once.

``python bench/startup_gc.py [--repeats 5]`` starts fresh interpreters, alternating the two
ways, for each preload:

- ``rank launcher``: the GRPO rank launcher's fork-server preload (torch, transformers, TRL,
  datasets, the provider's builder), paid once per trainer that runs a GRPO job;
- ``dataloader workers``: the DataLoader workers' fork-server preload (torch, datasets, PIL,
  the lazy dataset), paid once per GRPO job rank with workers;
- ``trainer start-up``: what ``python -m trainer_service`` imports before its ready line (the
  service modules, grpc, torch).

and prints per preload the median CPU seconds (user + system) of the import, and then the
time of one full collection (``gc.collect()``) of the imported heap, both ways, with their
ratios, and the objects the collector tracks and those a collection scans. The second figure
is paid at every full collection for the process's life (a rank collects while it trains).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import _offline

from trainer_service.providers.grpo.launch import LAUNCHER_PRELOAD
from trainer_service.providers.grpo.settings import WORKER_PRELOAD

BRACKETS = (
    "trainer_service.providers.grpo.preload_begin",
    "trainer_service.providers.grpo.preload_end",
)
PRELOADS = {
    "rank launcher": [m for m in LAUNCHER_PRELOAD if m not in BRACKETS],
    "dataloader workers": [m for m in WORKER_PRELOAD if m not in BRACKETS],
    "trainer start-up": ["trainer_service.__main__", "trainer_service.providers._device", "torch"],
}

# Imports the modules (paused then frozen, or not), then times full collections.
_PROBE = """
import gc, importlib, json, resource, sys, time
frozen = sys.argv[1] == "frozen"
names = sys.argv[2:]
from trainwire_ops import heap
if frozen:
    heap.pause()
for name in names:
    importlib.import_module(name)
if frozen:
    heap.freeze()
usage = resource.getrusage(resource.RUSAGE_SELF)
collections = []
for _ in range(5):
    began = time.perf_counter()
    gc.collect()
    collections.append(time.perf_counter() - began)
print(json.dumps({"import_cpu_s": usage.ru_utime + usage.ru_stime,
                  "collect_ms": 1000 * sorted(collections)[2],
                  "objects": len(gc.get_objects()) + gc.get_freeze_count(),
                  "scanned": len(gc.get_objects())}))
"""


def probe(way: str, names: list[str]) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, way, *names],
        capture_output=True,
        text=True,
        check=True,
        cwd=_offline.ROOT,
        env={**os.environ, "PYTHONPATH": f"{_offline.ROOT}:{_offline.ROOT / 'clients'}"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interpreters per way (default 5)")
    args = parser.parse_args()
    print(
        f"{'preload':<20} {'way':<8} {'import CPU s':>12} {'full collection ms':>19} "
        f"{'objects':>8} {'scanned':>8}"
    )
    for label, names in PRELOADS.items():
        results: dict[str, list[dict[str, float]]] = {"running": [], "frozen": []}
        for _ in range(args.repeats):  # alternating, so that drift hits both ways alike
            for way in results:
                results[way].append(probe(way, names))
        medians = {}
        for way, runs in results.items():
            cpu = statistics.median(r["import_cpu_s"] for r in runs)
            collect = statistics.median(r["collect_ms"] for r in runs)
            medians[way] = (cpu, collect)
            objects = int(statistics.median(r["objects"] for r in runs))
            scanned = int(statistics.median(r["scanned"] for r in runs))
            print(f"{label:<20} {way:<8} {cpu:>12.2f} {collect:>19.1f} {objects:>8} {scanned:>8}")
        (cpu_on, coll_on), (cpu_off, coll_off) = medians["running"], medians["frozen"]
        print(
            f"{label:<20} frozen/running: import CPU x{cpu_off / cpu_on:.2f}, "
            f"full collection x{coll_off / max(coll_on, 1e-9):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
