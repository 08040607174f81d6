# Everything a new machine needs is in these targets: `make serve`, `make test`, `make train`, `make demo`,
# `make bench`. ARGS passes options on: `make serve ARGS=--fresh`, `make train ARGS='--max-steps 8'`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# setuptools announces its import finder ("Editable installation…") on every editable install of a project whose
# packages map onto other folders, as proctor.* does; it says nothing about this project.
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip
# The Debian packages the tests drive: curl (the docs' curl tour, run verbatim), docker-compose (a real compose
# implementation checks docker/compose.yaml) and chromium (the live page, headless). Each command is its package.
# And postgresql, whose server binaries (off the PATH) the tests start a cluster of their own with.
SYSTEM_PACKAGES := curl docker-compose chromium

# The suites whose servers and stores keep state (the others, batching/, curricula/, bench/, docker/ and the docs',
# start none, or one of their own).
POSTGRESQL_SUITES := tests/server tests/experience tests/cli tests/client tests/e2e

.PHONY: serve test test-fast train demo system-packages lint typecheck format docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The stamps re-run an install whenever pyproject.toml changes.
$(VENV)/.server-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e '.[server]'
	touch $@

# torch first, pinned to the CPU wheel this machine has on disk: anything that pulls torch in later
# (transformers, trl) then finds it satisfied instead of downloading a CUDA build.
$(VENV)/.train-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q 'torch==2.13.0'
	$(PIP) install -q -e '.[server,train]'
	touch $(VENV)/.server-installed $@

# OpenRLHF's own reward-server client (openrlhf.utils.agent), which the tests of its protocol call, installed
# without its dependencies: those are its GPU training stack (deepspeed, flash-attn, ray); the client needs
# aiohttp and pylatexenc, which the dev extra brings.
$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q 'torch==2.13.0'
	$(PIP) install -q -e '.[server,train,dev]'
	$(PIP) install -q --no-deps 'openrlhf==0.11.2'
	touch $(VENV)/.server-installed $(VENV)/.train-installed $@

serve: $(VENV)/.server-installed
	$(BIN)/proctor serve $(ARGS)

# GRPO with TRL against the dataserver at $PROCTOR_URL (default http://127.0.0.1:8000).
train: $(VENV)/.train-installed
	$(BIN)/proctor train $(ARGS)

# Installs the missing ones as root through apt-get; anyone else is told, in one line, what to run.
system-packages:
	@missing=(); for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null || missing+=($$p); done; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql); \
	command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light); \
	compose_v2=""; if command -v docker >/dev/null && ! docker compose version >/dev/null 2>&1; then compose_v2=1; fi; \
	if [ $${#missing[@]} -eq 0 ] && [ -z "$$compose_v2" ]; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make test: the tests need $${missing[*]} $${compose_v2:+docker compose v2 (docker/compose-v2.sh)}" >&2; exit 1; \
	fi; \
	if [ $${#missing[@]} -gt 0 ]; then \
	  echo "installing the Debian packages the tests drive: $${missing[*]}"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$${missing[@]}" >/dev/null; \
	fi; \
	if [ -n "$$compose_v2" ]; then echo "installing Docker Compose v2 from Debian's package"; docker/compose-v2.sh; fi

# Every suite on SQLite; then the suites whose servers keep state on PostgreSQL (bench/_postgresql.py starts a
# cluster): every state file and in-memory state such a test names becomes a database of its own.
test: system-packages $(VENV)/.dev-installed lint typecheck docs
	$(BIN)/python -m pytest
	$(BIN)/python -m pytest --database postgresql $(POSTGRESQL_SUITES)

# pytest without the end-to-end tests (marked e2e: a real server, a whole training run, a Docker engine, a browser),
# in a process per core (pytest-xdist), for the edit-test loop; `make test` runs them all, in one process.
test-fast: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -m "not e2e" -n auto

# A dataserver on curricula/arithmetic.yaml and GRPO on a tiny offline model across its first stage boundary.
demo: $(VENV)/.train-installed
	$(BIN)/proctor demo $(ARGS)

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check server client curricula cli tests bench
	$(BIN)/ruff format --check server client curricula cli tests bench
	$(BIN)/lint-imports --no-cache

format: $(VENV)/.dev-installed
	$(BIN)/ruff format server client curricula cli tests bench
	$(BIN)/ruff check --fix server client curricula cli tests bench

typecheck: $(VENV)/.dev-installed
	$(BIN)/mypy -p proctor.server -p proctor.client -p proctor.experience -p proctor.batching -p proctor.errors -p proctor.wire -p proctor.cli -p bench -p tests

# The documentation site (mkdocs.yml, docs/) into build/site; strict: a broken link or anchor fails it.
# NO_MKDOCS_2_WARNING silences Material's banner about MkDocs 2, which says nothing about these pages.
docs: $(VENV)/.dev-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

bench: $(VENV)/.dev-installed
	$(BIN)/python -m bench

clean:
	rm -rf build .mypy_cache .ruff_cache .pytest_cache .hypothesis
