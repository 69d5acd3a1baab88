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

# etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kwok, helm and Karpenter (kwok provider) from the
# Go module proxy,
# cached in ~/.cache/kubeon-gpu/bin keyed by the versions in tests/harness/versions.env.
binaries:
	bash tests/harness/build-binaries.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile

# PostgreSQL from Debian's package: the hub's tests run against it as well as SQLite.
# WireGuard (userspace wireguard-go, wg), iproute2 and tcpdump: the tunnel test bed's network namespaces.
# nftables: the gateway's MSS clamping and service-CIDR NAT. Prometheus (with promtool): the metrics tests
# scrape the DCGM exporter fixture, backfill history and unit-test PromQL. Chromium: the Temporal UI tests.
system-deps:
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v wireguard-go >/dev/null || missing="$$missing wireguard-go"; \
	command -v wg >/dev/null || missing="$$missing wireguard-tools"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v tcpdump >/dev/null || missing="$$missing tcpdump"; \
	command -v nft >/dev/null || missing="$$missing nftables"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	{ command -v prometheus && command -v promtool; } >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

# Bytecode is written, to a cache outside the repo, even where the environment says not to write it
# (PYTHONDONTWRITEBYTECODE): the tests start many Python processes (workers, the harness's servers), and without
# bytecode each compiles every module it imports from source again (three workflow suites: 10.5-15.3 s of user CPU
# without, 7.9 s with a warm cache).
pytest: export PYTHONPYCACHEPREFIX := $(HOME)/.cache/kubeon-gpu/pycache
pytest: export PYTHONDONTWRITEBYTECODE :=
pytest: venv binaries
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything on this machine: Temporal dev server + UI, control plane with kwok, sim locations, the worker.
dev: venv binaries system-deps
	$(BIN)/python -m tests.harness.dev $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .kubeon
