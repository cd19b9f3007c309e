#!/usr/bin/env bash
# Downloads, on a machine that reaches PyPI, the wheels bench/gpu_check.sh installs offline on a
# bare GPU machine: CPython 3.12, manylinux x86-64, the versions pinned in constraints.txt, each
# with --no-deps (the list below is explicit and complete; a check at the end says so).
#
#   bash bench/gpu_wheels.sh [DIR]        # default DIR: .whl (in the repository's root)
#
# GPU_WHEELS_PYTHON=3.11 fetches the same for another Python (to try them where 3.12 is not).
#
# What the GPU image already has (a CUDA torch with torchvision, numpy, pillow, pyarrow, pandas,
# aiohttp, psutil, prometheus-client...) is not carried: the check uses the image's CUDA
# torch. What it lacks (trl, datasets, peft, setproctitle, pytest-asyncio...) or holds at
# another version than the pins (transformers, tokenizers, huggingface-hub, grpcio, protobuf...)
# is. Put on the GPU machine's PYTHONPATH, the carried versions win over the image's.
#
# DIR is a build output: keep it out of git (`echo /.whl/ >> .git/info/exclude`). It must stay
# under the device machine's 64 MiB working-tree limit; the script prints its size.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/.whl}"
PY="${PYTHON:-python3}"
# The GPU image's Python; another minor version only to try the wheels on a machine without it.
TARGET_PYTHON="${GPU_WHEELS_PYTHON:-3.12}"

# Distribution names as constraints.txt spells them (case and - / _ do not matter).
PACKAGES=(
    # the training stack the image lacks, or has at other versions
    trl datasets peft transformers tokenizers huggingface_hub hf-xet accelerate safetensors
    # what they need that the image lacks, or has at versions they may refuse
    dill multiprocess xxhash fsspec httpx2 httpcore2 truststore anyio h11 idna filelock packaging
    typing_extensions regex tqdm
    # the services and the client
    grpcio grpcio-status grpcio-health-checking grpcio-reflection protobuf
    googleapis-common-protos setproctitle psycopg psycopg-binary psycopg-pool
    # the tests (tests/gpu is async: pytest-asyncio)
    pytest pluggy iniconfig pytest-asyncio pytest-timeout
)

pin() {  # NAME -> NAME==VERSION from constraints.txt, or fail
    local wanted line
    wanted="$(echo "$1" | tr 'A-Z_' 'a-z-')"
    while IFS= read -r line; do
        case "$line" in '#'*|'') continue ;; esac
        if [ "$(echo "${line%%==*}" | tr 'A-Z_' 'a-z-')" = "$wanted" ]; then
            echo "$line"
            return 0
        fi
    done < "$REPO/constraints.txt"
    echo "gpu_wheels: $1 is not pinned in constraints.txt" >&2
    return 1
}

REQUIREMENTS=()
for name in "${PACKAGES[@]}"; do REQUIREMENTS+=("$(pin "$name")"); done

mkdir -p "$DIR"
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
# The environment's pip constraints (PIP_CONSTRAINT, a global constraint file) are for this
# machine's own installs, not for wheels of another platform.
PIP_CONSTRAINT="" "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$TARGET_PYTHON" --implementation cp "${PLATFORMS[@]}" \
    --constraint /dev/null -d "$DIR" "${REQUIREMENTS[@]}"

# One version of each: a stale wheel of another version beside the pinned one stops the install.
"$PY" - "$DIR" "$TARGET_PYTHON" "${REQUIREMENTS[@]}" <<'PYEOF'
import pathlib
import re
import sys
import zipfile

try:
    from packaging.markers import Marker
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.markers import Marker

#: The GPU machine, as environment markers see it.
TARGET = {
    "python_version": sys.argv[2],
    "python_full_version": sys.argv[2] + ".0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

directory = pathlib.Path(sys.argv[1])
pinned = {}
for requirement in sys.argv[3:]:
    name, version = requirement.split("==")
    pinned[re.sub(r"[-_.]+", "-", name).lower()] = version

# What the GPU image holds (device notes, "Python packages already there"), by normalised name.
IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama filelock frozenlist fsspec grpcio h11 hf-xet httpcore
httpx huggingface-hub idna iniconfig jinja2 markdown-it-py markupsafe mdurl mpmath multidict networkx
numpy nvidia-ml-py packaging pandas peft pillow pip pluggy prometheus-client propcache protobuf psutil
pyarrow pygments pytest pytest-timeout pytest-xdist python-dateutil pyyaml regex requests rich
safetensors setuptools shellingham six sympy tokenizers torch torchvision tqdm transformers triton
typer typing-extensions urllib3 wheel xxhash yarl
""".split())

wheels = {}
for wheel in sorted(directory.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key not in pinned or pinned[key] != version:
        wheel.unlink()  # another version, or a package no longer carried
        continue
    wheels[key] = wheel
missing = sorted(set(pinned) - set(wheels))
if missing:
    sys.exit(f"gpu_wheels: no wheel for {missing}")

# Every requirement of a carried wheel (extras aside) is carried or in the image.
unmet = set()
for key, wheel in wheels.items():
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        requirement, _, marker = spec.partition(";")
        if marker.strip() and not Marker(marker).evaluate(TARGET):
            continue  # an extra's, or another platform's
        needed = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement)[0]).lower()
        if needed not in wheels and needed not in IMAGE:
            unmet.add(f"{needed} (for {key})")
if unmet:
    sys.exit(f"gpu_wheels: neither carried nor in the GPU image: {sorted(unmet)}")
size = sum(w.stat().st_size for w in wheels.values())
print(f"{len(wheels)} wheels in {directory}: {size / 2**20:.1f} MiB")
PYEOF
