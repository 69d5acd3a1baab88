#!/usr/bin/env bash
# Builds (or reuses) the control-plane binaries from the Go module proxy.
#
# kube-apiserver, kube-scheduler and kube-controller-manager cannot be `go install`ed: k8s.io/kubernetes
# replaces its ~30 staging modules with local paths. We build them from a small wrapper module that
# requires k8s.io/kubernetes and replaces each staging module with its published v0.Y.Z twin; the list of
# replaces is read from that release's own go.mod so it stays right across version bumps.
#
# Output: $KUBEON_BIN_DIR/<name>-<version> (default ~/.cache/kubeon-gpu/bin), plus a stamp per binary.
# Prints the directory on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$here/versions.env"

cache="${KUBEON_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kubeon-gpu}"
bin="${KUBEON_BIN_DIR:-$cache/bin}"
work="$cache/build"
mkdir -p "$bin" "$work"

# One build at a time per cache: two at once (two make runs, several worktrees) share the build directory and
# the temporary output names, and one's `mv` finds the other's file gone.
if command -v flock >/dev/null; then
  exec 9>"$cache/build.lock"
  flock 9
fi

command -v go >/dev/null || { echo "build-binaries: Go is not installed; the control plane is built from the Go module proxy" >&2; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-mod=mod

log() { echo "[build-binaries] $*" >&2; }

have() { [ -x "$bin/$1-$2" ]; }

build_kubernetes() {
  local v="$KUBERNETES_VERSION"
  local need=()
  for c in kube-apiserver kube-scheduler kube-controller-manager; do have "$c" "$v" || need+=("$c"); done
  [ ${#need[@]} -eq 0 ] && return 0
  log "building ${need[*]} $v (first build takes 10-25 minutes on 2 cores)"
  local mod="$work/kubernetes-$v"
  rm -rf "$mod"; mkdir -p "$mod"; cd "$mod"
  go mod init kubeon.local/build/kubernetes >/dev/null 2>&1
  local upstream; upstream="$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  local staging="v0.${v#v1.}"
  # Each replace of the release's go.mod that points into ./staging becomes a replace with the published twin.
  go mod edit -json "$upstream" | python3 -c '
import json, sys
staging = sys.argv[1]
for r in json.load(sys.stdin).get("Replace") or []:
    new = r["New"]
    if new["Path"].startswith("./staging/"):
        old = r["Old"]["Path"]
        print("-replace=%s=%s@%s" % (old, old, staging))
    elif new.get("Version"):
        print("-replace=%s=%s@%s" % (r["Old"]["Path"], new["Path"], new["Version"]))
' "$staging" | xargs go mod edit
  go mod edit -require="k8s.io/kubernetes@$v"
  local pkgs=(); for c in "${need[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c@$v"); done
  go get "${pkgs[@]}" >&2
  local minor="${v#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/component-base/version/base k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  for c in "${need[@]}"; do
    log "go build $c"
    go build -trimpath -ldflags "$ld" -o "$bin/$c-$v.tmp" "k8s.io/kubernetes/cmd/$c"
    mv "$bin/$c-$v.tmp" "$bin/$c-$v"
  done
}

build_etcd() {
  local v="$ETCD_VERSION"
  have etcd "$v" && return 0
  log "building etcd $v"
  local mod="$work/etcd-$v"
  rm -rf "$mod"; mkdir -p "$mod"; cd "$mod"
  go mod init kubeon.local/build/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$v" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/etcd-$v.tmp" go.etcd.io/etcd/server/v3
  mv "$bin/etcd-$v.tmp" "$bin/etcd-$v"
}

build_installable() { # name version package
  have "$1" "$2" && return 0
  log "building $1 $2"
  local gobin="$work/gobin-$1-$2"; rm -rf "$gobin"; mkdir -p "$gobin"
  GOBIN="$gobin" GOFLAGS= go install -trimpath -ldflags "-s -w $4" "$3@$2"
  mv "$gobin/$1" "$bin/$1-$2"
}

# Karpenter with its kwok cloud provider (nodes are kwok Nodes), and its CRDs from the same module version:
# $bin/karpenter-<v> and $bin/karpenter-crds-<v>/*.yaml (karpenter.sh NodePool/NodeClaim/NodeOverlay, KWOKNodeClass).
build_karpenter() {
  local v="$KARPENTER_VERSION"
  have karpenter "$v" && [ -f "$bin/karpenter-crds-$v/karpenter.sh_nodepools.yaml" ] && return 0
  log "building karpenter (kwok provider) $v (from empty Go caches: 7.5 minutes on 2 busy cores, 4 CPU-minutes)"
  local gobin="$work/gobin-karpenter-$v"; rm -rf "$gobin"; mkdir -p "$gobin"
  GOBIN="$gobin" GOFLAGS= go install -trimpath -ldflags "-s -w" "sigs.k8s.io/karpenter/kwok@$v"
  local dir; dir="$(GOFLAGS= go mod download -json "sigs.k8s.io/karpenter@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  local crds="$bin/karpenter-crds-$v"; rm -rf "$crds.tmp"; mkdir -p "$crds.tmp"
  cp "$dir"/pkg/apis/crds/karpenter.sh_*.yaml "$dir"/kwok/apis/crds/karpenter.kwok.sh_*.yaml "$crds.tmp/"
  chmod u+w "$crds.tmp"/*.yaml
  rm -rf "$crds"; mv "$crds.tmp" "$crds"
  mv "$gobin/kwok" "$bin/karpenter-$v"
}

want="${*:-etcd kubernetes kwok helm karpenter}"
for w in $want; do
  case "$w" in
    etcd) build_etcd ;;
    kubernetes) build_kubernetes ;;
    kwok) build_installable kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" ;;
    karpenter) build_karpenter ;;
    helm) build_installable helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" ;;
    *) echo "build-binaries: unknown component $w" >&2; exit 2 ;;
  esac
done
echo "$bin"
