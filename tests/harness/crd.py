"""The GpuPolicy CRD from the chart, installed into a test cluster; policies created as `kubectl apply` would."""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from models.policy import API_GROUP
from models.policy import PLURAL
from models.policy import parse_policy
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for

CRD_FILE = Path(__file__).resolve().parents[2] / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml"


def install_crds(admin: Kube, files: list[Path], timeout: float = 60.0) -> None:
    """Create each CRD of ``files`` (there already is fine) and wait until all are established."""
    names = []
    for path in files:
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        try:
            admin.apiext.create_custom_resource_definition(crd)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    deadline = time.monotonic() + timeout
    for name in names:
        def established(name: str = name) -> bool:
            got = admin.apiext.read_custom_resource_definition(name)
            return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])

        wait_for(established, timeout=max(1.0, deadline - time.monotonic()), what=f"CRD {name} established")


def install_gpupolicy_crd(cluster: Cluster) -> None:
    install_crds(cluster.admin, [CRD_FILE])


def create_strictly(cluster: Cluster, doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A copy of ``doc`` named ``<prefix>-<random>``, created with strict field validation: what `kubectl apply`
    does by default (unknown fields are errors, not pruned)."""
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = f"{prefix}-{uuid.uuid4().hex[:10]}"
    return cluster.admin.custom.create_cluster_custom_object(  # type: ignore[return-value]
        API_GROUP, "v1", PLURAL, doc, field_validation="Strict")


def assert_accepted(cluster: Cluster, doc: dict[str, Any], prefix: str, kind: type) -> None:
    """``doc``, created strictly, comes back with its spec as written and parses as ``kind``; deleted after
    (policies are cluster-scoped: a leftover one would claim later tests' pods)."""
    created = create_strictly(cluster, doc, prefix)
    try:
        assert created["spec"] == doc["spec"]
        assert isinstance(parse_policy(created), kind)
    finally:
        cluster.admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, created["metadata"]["name"])


def assert_refused(cluster: Cluster, doc: dict[str, Any], prefix: str, case: dict[str, Any]) -> None:
    """``doc`` (a corpus ``case`` applied) is refused by the apiserver (400/422), naming the case's field (its
    ``leaf``, else the last part of its ``field``: the apiserver's paths drop list indexes and the leading spec)."""
    with pytest.raises(client.ApiException) as err:
        create_strictly(cluster, doc, prefix)
    assert err.value.status in (400, 422), err.value.body
    leaf = case.get("leaf") or case["field"].split(".")[-1].split("[")[0]
    assert leaf in err.value.body, err.value.body


def assert_cli_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str], example: Path, ok: str,
                         bad: dict[str, Any], error: str) -> None:
    """`kubeon-gpu policy validate` accepts ``example`` (printing ``ok``) and refuses ``bad`` naming ``error``."""
    from worker.cli import main

    assert main(["policy", "validate", str(example)]) == 0
    assert ok in capsys.readouterr().out
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["policy", "validate", str(path)]) == 1
    assert error in capsys.readouterr().err


def read_gpupolicy(cluster: Cluster, name: str) -> dict[str, Any] | None:
    """The GpuPolicy ``name`` as the API server has it now, None when there is none."""
    try:
        obj: dict[str, Any] = cluster.admin.custom.get_cluster_custom_object(  # type: ignore[assignment]
            API_GROUP, "v1", PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj
