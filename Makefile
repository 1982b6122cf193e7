# Two entry points: `make demo` (the main job) and `make test`. Both set up on first use.
PY ?= python3.11
VENV := .venv
PYTHON := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
EXPERIMENT_ARGS ?=
SENSITIVITY_ARGS ?=
TRINITY_RUN_ARGS ?=

.PHONY: setup test lint pr demo trinity-run bench experiment sensitivity dp-check unpatch clean

# Installing the pins is slow, so it is stamped. Applying the patch series and copying our
# modules into trinity-rft is a cheap hash check and runs every time, so an edit under trinity/
# reaches the installed package (a no-op when nothing changed).
setup: $(DEPS_STAMP)
	$(PYTHON) scripts/trinity_patches.py apply

$(DEPS_STAMP): pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -c constraints.txt ".[test,lint]"
	touch $@

# The test files run on one worker per core (pytest-xdist), a file's tests on one worker, in
# the order tests/conftest.py collects them (the slowest first).
test: setup
	$(PYTHON) -m pytest -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Trinity-RFT's checks: black, isort, flake8 with docstrings (.flake8), mypy (pyproject.toml).
# trinity/ ships upstream, where Python 3.10 is the floor: a second mypy pass reads typeshed's
# 3.10 signatures, so an API that came with 3.11 or later fails here. mypy reads the patched
# trinity-rft (the tests import what the series adds), so lint sets up first.
lint: setup
	$(VENV)/bin/black --check trinity scripts tests
	$(VENV)/bin/isort --check-only trinity scripts tests
	$(VENV)/bin/flake8 trinity scripts tests
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --python-version 3.10 trinity

# dist/trinity-rft-bapo.patch: everything above as one patch against a Trinity-RFT 0.6.0 checkout.
pr: setup
	$(PYTHON) -m scripts.make_pr

demo: setup
	$(PYTHON) -m scripts.experiment demo $(DEMO_ARGS)

# Trinity's own `trinity run --config` trains BAPO for a few steps on 2 CPU ranks, on a Ray of its
# own under runs/ (TRINITY_RUN_ARGS="--steps 5" or --no-sync, with which the ranks choose apart).
trinity-run: setup
	$(PYTHON) -m scripts.trinity_run $(TRINITY_RUN_ARGS)

bench: setup
	$(PYTHON) -m scripts.bench $(BENCH_ARGS)

# Multi-seed study of BAPO against fixed clipping on stale data (EXPERIMENT_ARGS=--task cover).
experiment: setup
	$(PYTHON) -m scripts.experiment study $(EXPERIMENT_ARGS)

# BAPO's pairs on one fixed stale mini-batch in micro-batches of 1 to 8 sequences on 1, 2, 4 ranks.
sensitivity: setup
	$(PYTHON) -m scripts.experiment sensitivity $(SENSITIVITY_ARGS)

# Every rank's clip pair per call, and whether the group agrees (DP_ARGS=--no-sync or --group 0,1).
RANKS ?= 3
DP_ARGS ?=
dp-check: setup
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$(RANKS) \
		-m scripts.harness.dp_worker by-hand $(DP_ARGS)

# Restores the installed trinity-rft to its released files.
unpatch:
	$(PYTHON) scripts/trinity_patches.py revert

clean:
	rm -rf $(VENV) build dist *.egg-info runs .pytest_cache .mypy_cache
