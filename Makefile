# Two commands matter: `make dev` (run everything locally) and `make test` (what CI runs).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: test dev venv binaries system-deps lint pytest clean

test: venv binaries system-deps lint pytest

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
	$(BIN)/hadolint Dockerfile

# PostgreSQL from Debian's package: the hub's tests run against it as well as SQLite. Prometheus (with promtool)
# from Debian's package: the metrics tests scrape the DCGM exporter fixture, backfill and unit-test PromQL.
system-deps:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

pytest: venv binaries
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything on this machine: Temporal dev server + UI, control plane with kwok, sim locations, the worker.
dev: venv binaries system-deps
	$(BIN)/python -m tests.harness.dev $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .kubeon
