#!/usr/bin/env bash
# Builds (or reuses) a Temporal server and its SQL schema tool from the Go module proxy, for the bench's
# production-shaped Temporal (bench/temporal_production.py: PostgreSQL persistence, SQL visibility). Not part of
# `make test` or CI: the first build took 405 s (457 CPU-seconds) on 2 shared cores, Go's build cache warm.
#
# Output, in $KUBEON_BIN_DIR (default ~/.cache/kubeon-gpu/bin, beside the control-plane binaries), keyed by version:
#   temporal-server-<v>        go.temporal.io/server/cmd/server
#   temporal-sql-tool-<v>      go.temporal.io/server/cmd/tools/sql
#   temporal-schema-<v>/       the module's schema/postgresql/v12 (temporal/ and visibility/, versioned dirs)
# Prints the directory on the last line of stdout.
#
# The version: v1.32.0, the server the Temporal CLI's dev server runs in the tests (CLI 1.9.1). v1.32.1+ (and
# v1.31.5, v1.30.9) declare `go 1.26.10`, newer than this machine's Go 1.26.8; v1.32.0 declares 1.26.8.
set -euo pipefail

TEMPORAL_SERVER_VERSION="${TEMPORAL_SERVER_VERSION:-v1.32.0}"
v="$TEMPORAL_SERVER_VERSION"

cache="${KUBEON_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeon-gpu}"
bin="${KUBEON_BIN_DIR:-$cache/bin}" work="$cache/build"
mkdir -p "$bin" "$work"
# One run of this script at a time per cache (two worktrees at once would share the temporary output names).
if command -v flock >/dev/null; then exec 9>"$cache/temporal-server.lock" && flock 9; fi
command -v go >/dev/null || { echo "build-temporal-server: Go is not installed" >&2; exit 1; }
export CGO_ENABLED=0

log() { echo "[build-temporal-server] $*" >&2; }

have() { [ -x "$bin/$1-$v" ]; }

build() { # name package
  have "$1" && return 0
  log "building $1 $v ($2)"
  local gobin="$work/gobin-$1-$v"; rm -rf "$gobin"; mkdir -p "$gobin"
  GOBIN="$gobin" GOFLAGS= go install -trimpath -ldflags "-s -w" "$2@$v"
  mv "$gobin/$(basename "$2")" "$bin/$1-$v"
  rm -rf "$gobin"
}

schema() {
  local dest="$bin/temporal-schema-$v"
  [ -f "$dest/temporal/versioned/v1.0/manifest.json" ] && return 0
  log "copying schema/postgresql/v12 of go.temporal.io/server@$v"
  local dir; dir="$(GOFLAGS= go mod download -json "go.temporal.io/server@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$dest.tmp"; mkdir -p "$dest.tmp"
  cp -R "$dir/schema/postgresql/v12/temporal" "$dir/schema/postgresql/v12/visibility" "$dest.tmp/"
  chmod -R u+w "$dest.tmp"
  rm -rf "$dest"; mv "$dest.tmp" "$dest"
}

start=$(date +%s)
build temporal-server go.temporal.io/server/cmd/server
build temporal-sql-tool go.temporal.io/server/cmd/tools/sql
schema
log "done in $(( $(date +%s) - start )) s"
echo "$bin"
