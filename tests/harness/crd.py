from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes import client

from tests.harness.kube import Cluster, wait_for

CRD_FILE = Path(__file__).resolve().parents[2] / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml"


def install_gpupolicy_crd(cluster: Cluster) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    try:
        cluster.admin.apiext.create_custom_resource_definition(crd)
    except client.ApiException as exc:
        if exc.status != 409:
            raise

    def established() -> bool:
        got = cluster.admin.apiext.read_custom_resource_definition(crd["metadata"]["name"])
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])

    wait_for(established, what="GpuPolicy CRD established")
