"""Running the pinned helm binary against the chart and reading what it renders."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness.controlplane import ensure_binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubeon-gpu-optimizer"
HERE = Path(__file__).resolve().parent
BURST_VALUES = HERE / "values-burst.yaml"
BAD_VALUES = HERE / "bad_values"

RELEASE = "kubeon-gpu-optimizer"
NAMESPACE = "kubeon-gpu"
MINIMAL_VALUES = HERE / "values-minimal.yaml"
# The two values without a default (R1.2: the cluster's name and its hub are installation-specific), as a values
# file so that later -f files and --set override them.
REQUIRED: tuple[str, ...] = ("-f", str(MINIMAL_VALUES))


def helm_path() -> Path:
    return ensure_binaries(("helm",))["helm"]


def run_helm(
    args: Sequence[str | Path], *, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_path()), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@dataclass(frozen=True)
class Rendered:
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def find(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        for d in self.docs:
            meta = d["metadata"]
            if d["kind"] == kind and meta["name"] == name and (namespace is None or meta.get("namespace") == namespace):
                return d
        return None

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        doc = self.find(kind, name, namespace)
        assert doc is not None, f"{kind} {name} not rendered; have {sorted(self.names())}"
        return doc

    def names(self) -> set[tuple[str, str]]:
        return {(d["kind"], d["metadata"]["name"]) for d in self.docs}


def template(*args: str | Path, values: Iterable[Path] = ()) -> Rendered:
    value_args = [a for v in values for a in ("-f", v)]
    proc = run_helm(["template", RELEASE, CHART, "--namespace", NAMESPACE, *REQUIRED, *value_args, *args])
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return Rendered(docs)


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name} in {deployment['metadata']['name']}")


def env(c: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in c.get("env", []):
        assert "value" in e, f"env {e['name']} is not a plain value: {e}"
        out[e["name"]] = e["value"]
    return out


def bound_rules(rendered: Rendered, service_account: str) -> list[tuple[str | None, dict[str, Any]]]:
    """Every rule the chart's bindings grant the ServiceAccount (in NAMESPACE), with the namespace of its Role
    (None for a ClusterRole)."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        for binding in rendered.all(kind):
            if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account
                       and s.get("namespace") == NAMESPACE for s in binding["subjects"]):
                continue
            ns = binding["metadata"].get("namespace")
            assert binding["roleRef"]["kind"] == role_kind, binding
            out += [(ns, rule) for rule in rendered.get(role_kind, binding["roleRef"]["name"], ns)["rules"]]
    return out
