# Trainwire: the only entry points. `make run` and `make test` set everything up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The code generator's own pinned venv: the client's oldest supported toolchain (see
# scripts/gen-requirements.txt), which the services' pinned venv cannot hold.
GEN_VENV := $(VENV)/gen
GEN_STAMP := $(GEN_VENV)/.installed-stamp
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
PYTEST_ARGS ?=
# Test processes: most tests wait on servers, subprocesses and sockets, so three workers on two
# cores overlap those waits (quiet, an earlier machine: 305 s with three, 384 s with two;
# 2026-12-06: 354 s with three, 371 s with four). Files stay whole on one worker (their module fixtures start once).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3
# The tests start a few hundred Python processes (workers, services, trainers, ranks, CLIs):
# with PYTHONDONTWRITEBYTECODE set (some images set it) each one compiled the repository's
# modules again, and each worker rewrote every test file (~5 CPU-s of its collection). The
# caches go to the __pycache__ folders git ignores.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE

# Benchmarks `make bench` runs: each bench/NAME.py with a `__main__` entry point; files starting
# with `_` are helpers (a gateway process, a shared setup) and never run on their own. GPU
# benchmarks run in their CPU dry mode here (`--dry-run`: tiny sizes, the same code path); the
# real GPU run is bench/gpu_check.sh; the chaos soak (ten minutes) is `make soak`.
# `make bench BENCHES=bench/store_wal.py` runs one.
BENCHES ?= $(shell grep -l '^if __name__ == "__main__":' $(filter-out bench/_% bench/chaos.py,$(wildcard bench/*.py)))
BENCH_ARGS_gpu_real_size := --dry-run

.PHONY: help install run test gen docs lint bench clean

# Python dependencies (when a dependency file changed), then Chromium for the browser tests.
install: $(STAMP) $(GEN_STAMP)
	@bash scripts/install_browser.sh

# Re-installs only when a dependency file changed; otherwise `make install` is a no-op.
$(STAMP): pyproject.toml clients/pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade "pip>=24"
	$(PIP_INSTALL) -e './clients[cli]' -e '.[trainer,dev]'
	@touch $@

$(GEN_STAMP): scripts/gen-requirements.txt
	@test -x $(GEN_VENV)/bin/python || $(PYTHON) -m venv $(GEN_VENV)
	$(GEN_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
		-r scripts/gen-requirements.txt
	@touch $@

run: install
	@bash scripts/run.sh

test: install
	cd protos && ../$(VENV)/bin/buf lint
	@set +e; $(TEST_ENV) TRAINWIRE_GEN_PYTHON=$(GEN_VENV)/bin/python $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

gen: install
	TRAINWIRE_GEN_PYTHON=$(GEN_VENV)/bin/python $(PY) scripts/gen_protos.py

# docs/reference from the code: the CLI's parser, the services' config classes, the protos'
# comments, gateway/auth.py's roles. Deterministic, offline; tests/docs proves it is fresh.
docs: install
	$(PY) scripts/gen_docs.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy clients/trainwire gateway trainer_service trainwire_ops
	$(VENV)/bin/lint-imports
	cd protos && ../$(VENV)/bin/buf lint

bench: install
	@for b in $(BENCHES); do \
		name=$$(basename $$b .py); \
		case $$name in gpu_real_size) args="$(BENCH_ARGS_gpu_real_size)";; *) args="";; esac; \
		echo "== $$b $$args"; $(PY) $$b $$args || exit 1; \
	done

# Deletes what `make install`, `make run` and the tools made: .venv (with .venv/gen), var/ (the
# gateway's database and the checkpoints) and the pytest, mypy, ruff and import-linter caches.
clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# The targets and what each does.
help:
	@echo "make install  the venvs (.venv, .venv/gen) and Chromium; a no-op when up to date"
	@echo "make run      a gateway and a trainer on this machine (scripts/run.sh)"
	@echo "make test     buf lint, then the whole test suite"
	@echo "make gen      regenerate the protobuf code in clients/trainwire/v1 from protos/"
	@echo "make docs     regenerate docs/reference (CLI, services' flags, protocol, roles)"
	@echo "make lint     ruff, ruff format --check, mypy, import-linter, buf lint"
	@echo "make bench    every benchmark, one after another (minutes each; GPU ones dry-run)"
	@echo "make soak     the 10-minute chaos soak (SOAK_MINUTES, SOAK_SEED); exits 1 on a violation"
	@echo "make clean    delete .venv (both venvs), var/ (the database and checkpoints) and caches"

# The full chaos soak (bench/chaos.py): ten minutes of faults and actions on real processes, then
# every invariant checked; exits 1 on any violation. SOAK_SEED picks the schedule.
SOAK_MINUTES ?= 10
SOAK_SEED ?= 1
.PHONY: soak
soak: install
	nice $(PY) bench/chaos.py --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)
