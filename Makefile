# Two commands matter: `make dev` (run everything locally) and `make test` (what CI runs).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: test dev venv binaries lint pytest clean

test: venv binaries lint pytest

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kwok and helm from the Go module proxy,
# cached in ~/.cache/kubeon-gpu/bin keyed by the versions in tests/harness/versions.env.
binaries:
	bash tests/harness/build-binaries.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

pytest: venv binaries
	$(BIN)/python -m pytest $(PYTEST_ARGS)

dev: venv binaries
	$(BIN)/kubeon-gpu dev

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .kubeon
