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
# cores overlap those waits (quiet, an earlier machine: 305 s with three, 384 s with two; four are
# no faster than three). Files stay whole on one worker (their module fixtures start once).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3

.PHONY: install run test gen lint bench clean

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
	@set +e; TRAINWIRE_GEN_PYTHON=$(GEN_VENV)/bin/python $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

gen: install
	TRAINWIRE_GEN_PYTHON=$(GEN_VENV)/bin/python $(PY) scripts/gen_protos.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy clients/trainwire gateway trainer_service trainwire_ops
	$(VENV)/bin/lint-imports
	cd protos && ../$(VENV)/bin/buf lint

bench: install
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# The full chaos soak (bench/chaos.py): ten minutes of faults and actions on real processes, then
# every invariant checked; exits 1 on any violation. SOAK_SEED picks the schedule.
SOAK_MINUTES ?= 10
SOAK_SEED ?= 1
.PHONY: soak
soak: install
	nice $(PY) bench/chaos.py --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)
