# Everything a new machine needs is in these targets: `make serve`, `make test`, `make bench`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test demo lint typecheck format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The stamps re-run an install whenever pyproject.toml changes.
$(VENV)/.server-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[server]'
	touch $@

# torch first, pinned to the CPU wheel this machine has on disk: anything that pulls torch in later
# (transformers, trl) then finds it satisfied instead of downloading a CUDA build.
$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[server,train,dev]'
	touch $(VENV)/.server-installed $@

serve: $(VENV)/.server-installed
	$(BIN)/proctor serve curricula/arithmetic.yaml --host 127.0.0.1 --port 8000

test: $(VENV)/.dev-installed lint typecheck
	$(BIN)/python -m pytest

# A dataserver on curricula/arithmetic.yaml and GRPO on a tiny offline model across its first stage boundary.
demo: $(VENV)/.dev-installed
	$(BIN)/proctor demo --steps 64

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check server client curricula cli batching dock tests bench
	$(BIN)/ruff format --check server client curricula cli batching dock tests bench

format: $(VENV)/.dev-installed
	$(BIN)/ruff format server client curricula cli batching dock tests bench
	$(BIN)/ruff check --fix server client curricula cli batching dock tests bench

# The source folders become proctor.server / proctor.client / proctor.cli (…) only when installed; mypy
# cannot follow that mapping, so it checks a tree of symlinks with the installed names.
typecheck: $(VENV)/.dev-installed
	@mkdir -p build/typecheck/proctor
	@for d in server client curricula cli batching dock; do ln -sfn ../../../$$d build/typecheck/proctor/$$d; done
	@ln -sfn ../../bench build/typecheck/bench
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml \
		-p proctor.server -p proctor.client -p proctor.curricula -p proctor.cli -p proctor.batching \
		-p proctor.dock -p bench

bench: $(VENV)/.dev-installed
	$(BIN)/python -m bench

clean:
	rm -rf build .mypy_cache .ruff_cache .pytest_cache .hypothesis
