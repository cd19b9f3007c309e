#!/usr/bin/env bash
# The GPU check: one command for a bare GPU machine (no internet, no PyPI). It installs the
# wheels bench/gpu_wheels.sh carried (offline, into a private folder put first on PYTHONPATH:
# the image's CUDA torch is used, the pinned trl, transformers, peft, datasets, grpcio... win
# over the image's), then runs, each within its time budget:
#
#   1. tests/gpu: the shipped path on CUDA (pytest);
#   2. bench/gpu_grpo.sh: GRPO steps of the tiny VLM as the trainer runs a job;
#   3. bench/gpu_real_size.py: Qwen2.5-VL-3B shapes, a Trainwire job against bare TRL, full
#      fine-tuning and LoRA;
#
# and prints one table (part, status, seconds, key figures). It exits non-zero when any part
# failed, ran past its budget or (part 3) missed its goal.
#
#   bash bench/gpu_wheels.sh                  # once, on a machine that reaches PyPI: fills .whl
#   bash bench/gpu_check.sh                   # on the GPU machine, in the repository's root
#   bash bench/gpu_check.sh --dry-run         # the same parts on the CPU at tiny size, with
#                                             # the repository's .venv and no wheels (make test)
#
# Options (or variables): --dry-run (GPU_CHECK_DRY_RUN=1); --wheels DIR (GPU_CHECK_WHEELS;
# default .whl when it exists, none in a dry run); --logs DIR (GPU_CHECK_LOGS: each part's
# output and the benchmark's JSON; default a new temporary folder); GPU_CHECK_COMMIT names the
# commit in the table where the copy has no .git. PYTHON picks the
# interpreter (default: python3 there, the image's, which holds the CUDA torch; .venv/bin/python
# in a dry run). Budgets in seconds: GPU_CHECK_BUDGET_TESTS (180), GPU_CHECK_BUDGET_GRPO (45),
# GPU_CHECK_BUDGET_REAL (240); with the install they add up to the 8 minutes the check may take
# on one H200 (a dry run allows 240, 240 and 480: they only bound a hang).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
DRY="${GPU_CHECK_DRY_RUN:-0}"
WHEELS="${GPU_CHECK_WHEELS:-}"
LOGS="${GPU_CHECK_LOGS:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --wheels) WHEELS="$2"; shift ;;
        --logs) LOGS="$2"; shift ;;
        *) echo "usage: bash bench/gpu_check.sh [--dry-run] [--wheels DIR] [--logs DIR]" >&2; exit 2 ;;
    esac
    shift
done
[ "$DRY" = 1 ] || [ -n "$WHEELS" ] || { [ -d .whl ] && WHEELS=.whl; }
LOGS="${LOGS:-$(mktemp -d -t gpu-check-XXXXXX)}"
mkdir -p "$LOGS"
# A dry run's budgets only bound a hang: a shared CPU may be slow.
if [ "$DRY" = 1 ]; then budgets=(240 240 480); else budgets=(180 45 240); fi
BUDGET_TESTS="${GPU_CHECK_BUDGET_TESTS:-${budgets[0]}}"
BUDGET_GRPO="${GPU_CHECK_BUDGET_GRPO:-${budgets[1]}}"
BUDGET_REAL="${GPU_CHECK_BUDGET_REAL:-${budgets[2]}}"
if [ "$DRY" = 1 ]; then PY="${PYTHON:-.venv/bin/python}"; else PY="${PYTHON:-python3}"; fi
export PYTHON="$PY" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

ROWS=()
FAILED=0
row() {  # PART STATUS SECONDS FIGURES
    ROWS+=("$(printf '%-22s %-8s %6s  %s' "$1" "$2" "$3" "$4")")
    [ "$2" = ok ] || FAILED=1
}
table() {
    echo
    echo "== gpu_check ($([ "$DRY" = 1 ] && echo "dry run on the CPU" || echo "GPU")," \
        "commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "${GPU_CHECK_COMMIT:-unknown}")," \
        "$(date -u +%Y-%m-%dT%H:%MZ); logs in $LOGS)"
    printf '%-22s %-8s %6s  %s\n' part status s figures
    printf '%s\n' "${ROWS[@]}"
}

# -- the interpreter and the carried wheels ---------------------------------------------------
started=$SECONDS
SITE=""
if [ -n "$WHEELS" ]; then
    SITE="$(mktemp -d -t gpu-check-site-XXXXXX)"
    trap 'rm -rf "$SITE"' EXIT
    if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/*.whl \
            >"$LOGS/install.log" 2>&1; then
        cat "$LOGS/install.log" >&2
        row install FAIL $((SECONDS - started)) "pip install of $WHEELS (see install.log)"
        table
        exit 1
    fi
    row install ok $((SECONDS - started)) "$(find "$WHEELS" -maxdepth 1 -name "*.whl" | wc -l) wheels from $WHEELS"
fi
export PYTHONPATH="${SITE:+$SITE:}$REPO/clients:$REPO${PYTHONPATH:+:$PYTHONPATH}"

started=$SECONDS
# Everything the parts import (a dry run with the .venv only finds it: the parts import it).
PREFLIGHT='
import importlib, importlib.util, importlib.metadata as md, os, sys
dry = os.environ["GPU_CHECK_DRY_RUN"] == "1"
find_only = os.environ["GPU_CHECK_FIND_ONLY"] == "1"
modules = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "grpc",
           "google.rpc.status_pb2", "PIL", "pyarrow", "setproctitle", "pytest_asyncio",
           "trainwire.contract", "gateway.server", "trainer_service.providers.grpo.build")
for module in modules:
    if (importlib.util.find_spec(module) if find_only else importlib.import_module(module)) is None:
        sys.exit(f"{sys.executable}: no module {module}")
gpu = "cpu"
if not dry:
    import torch
    if not torch.cuda.is_available():
        sys.exit(f"{sys.executable}: torch {torch.__version__} sees no CUDA GPU")
    gpu = f"{torch.cuda.get_device_name(0)} cuda={torch.version.cuda}"
names = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "tokenizers",
         "huggingface_hub", "grpcio", "protobuf", "pyarrow", "numpy", "pillow")
versions = " ".join(f"{n}={md.version(n)}" for n in names)
print(f"python={sys.version.split()[0]} {gpu} {versions}")
'
# Imported on a GPU, and wherever wheels were installed; a dry run with the .venv finds them.
FIND_ONLY=0
[ "$DRY" = 1 ] && [ -z "$SITE" ] && FIND_ONLY=1
if figures="$(GPU_CHECK_FIND_ONLY=$FIND_ONLY GPU_CHECK_DRY_RUN="$DRY" "$PY" -c "$PREFLIGHT" 2>"$LOGS/preflight.log")"; then
    echo "$figures"
    row preflight ok $((SECONDS - started)) "$figures"
else
    cat "$LOGS/preflight.log" >&2
    row preflight FAIL $((SECONDS - started)) "$(tail -n 1 "$LOGS/preflight.log")"
    table
    echo "carry the wheels: bash bench/gpu_wheels.sh on a machine that reaches PyPI" >&2
    exit 1
fi

# -- the parts ----------------------------------------------------------------------------------
part() {  # NAME BUDGET LOG COMMAND...: runs it within its budget, output to the console and LOG
    local name="$1" budget="$2" log="$LOGS/$3" rc
    shift 3
    echo "== $name (budget ${budget} s)"
    local began=$SECONDS
    timeout --kill-after=15 "$budget" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    SPENT=$((SECONDS - began))
    case "$rc" in
        0) STATUS=ok ;;
        124 | 137) STATUS=TIMEOUT ;;
        *) STATUS="FAIL($rc)" ;;
    esac
}
result() {  # LOG PATTERN: the last line of LOG matching PATTERN
    grep -E "$2" "$LOGS/$1" | tail -n 1
}

# Only the plugins the tests use: the image's own (of other versions) stay out of pytest. A
# temporary root of their own: a pytest that shares its caller's (pytest-of-USER) sets that back
# to mode 0700, locking other users out of it (in the test suite, the embedded PostgreSQL's).
TESTS_TMP="$(mktemp -d -t gpu-check-tests-XXXXXX)"
part tests/gpu "$BUDGET_TESTS" tests.log env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
    "$PY" -m pytest tests/gpu -q -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout \
    -o addopts="" --timeout 150 --basetemp "$TESTS_TMP"
rm -rf "$TESTS_TMP"
row tests/gpu "$STATUS" "$SPENT" "$(result tests.log '(passed|failed|skipped|error)' | tr -d '=')"

# The real-size benchmark's work folder: its model (7.5 GB at real size) stays out of the logs;
# its logs join them.
WORK="$(mktemp -d -t gpu-real-size-XXXXXX)"
if [ "$DRY" = 1 ]; then
    # Both parts train the same offline tiny VLM in a dry run: gpu_grpo.sh builds it where
    # gpu_real_size.py looks for its model first, so it is built once.
    part gpu_grpo.sh "$BUDGET_GRPO" grpo.log env BENCH_DEVICE=cpu BENCH_MODEL="$WORK/data/model" \
        bash bench/gpu_grpo.sh 2
else
    part gpu_grpo.sh "$BUDGET_GRPO" grpo.log bash bench/gpu_grpo.sh 8
fi
row bench/gpu_grpo.sh "$STATUS" "$SPENT" \
    "$(result grpo.log '^RESULT' | grep -oE '(median_step_time_ms|gpu_memory_peak_gib)=[0-9.]+' | tr '\n' ' ')"

REAL=("$PY" bench/gpu_real_size.py --json "$LOGS/real_size.json" --work "$WORK")
[ "$DRY" = 1 ] && REAL+=(--dry-run)
part real_size "$BUDGET_REAL" real.log "${REAL[@]}"
for log in trainer bare; do cp "$WORK/$log.log" "$LOGS/real_size_$log.log" 2>/dev/null; done
rm -rf "$WORK"
[ "$STATUS" = "FAIL(3)" ] && STATUS=GOAL
row bench/gpu_real_size.py "$STATUS" "$SPENT" "$(result real.log '^RESULT' | cut -d' ' -f3-)"

table
exit "$FAILED"
