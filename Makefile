# Two entry points: `make demo` (the main job) and `make test`. Both set up on first use.
PY ?= python3.11
VENV := .venv
PYTHON := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
EXPERIMENT_ARGS ?=

.PHONY: setup test demo bench experiment unpatch clean

# Installing the pins is slow, so it is stamped; applying the patch series is a cheap
# hash check and runs every time (a no-op when already applied).
setup: $(DEPS_STAMP)
	$(PYTHON) scripts/trinity_patches.py apply

$(DEPS_STAMP): pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -c constraints.txt ".[test]"
	touch $@

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PYTHON) scripts/bapo_demo.py $(DEMO_ARGS)

bench: setup
	$(PYTHON) scripts/bapo_bench.py $(BENCH_ARGS)

# Multi-seed study of BAPO against fixed clipping on stale data (about 10 minutes on 2 cores).
experiment: setup
	$(PYTHON) scripts/bapo_experiment.py $(EXPERIMENT_ARGS)

# Restores the installed trinity-rft to its released files.
unpatch:
	$(PYTHON) scripts/trinity_patches.py revert

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
