"""The real Karpenter in the test bed: a pending GPU pod gets a NodeClaim of the cheapest fitting GPU type, and a
kwok Node with the GPU type's labels and GPUs, on which the pod runs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.harness.karpenter import A100
from tests.harness.karpenter import L4
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


def test_a_pending_gpu_pod_gets_a_karpenter_node_with_its_gpu_type(
        cluster: Cluster, karpenter: Karpenter, namespace: str) -> None:
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=8, products=(L4, A100)))
    try:
        cluster.admin.apps.create_namespaced_deployment(namespace, gpu_workload("infer", taint=taint, product=A100))

        claim = wait_for(lambda: karpenter.nodeclaims(pool), timeout=60, what="a NodeClaim for the pending pod")[0]
        # The cheapest type with one A100 (a2-highgpu-1g, $3.673/h) is all the pod needs.
        types = next(r for r in claim["spec"]["requirements"] if r["key"] == "node.kubernetes.io/instance-type")
        assert "a2-highgpu-1g" in types["values"]
        assert not {"g6.xlarge", "g6.12xlarge"} & set(types["values"])  # L4 types do not satisfy its nodeSelector

        node = wait_for(lambda: karpenter.nodes(pool), timeout=60, what="the NodeClaim's kwok Node")[0]
        labels = node.metadata.labels
        assert labels["nvidia.com/gpu.product"] == A100
        assert labels["nvidia.com/gpu.count"] == "1"
        assert labels["node.kubernetes.io/instance-type"] == "a2-highgpu-1g"
        assert labels["karpenter.sh/nodepool"] == pool
        assert node.status.allocatable["nvidia.com/gpu"] == "1"

        def running_on_it() -> bool:
            pods = cluster.admin.core.list_namespaced_pod(namespace, label_selector="app=infer").items
            return bool(pods) and all(p.spec.node_name == node.metadata.name and p.status.phase == "Running"
                                      for p in pods)

        wait_for(running_on_it, timeout=60, what="the pod running on the Karpenter node")
        name = claim["metadata"]["name"]

        def registered_and_initialized() -> dict[str, Any] | None:
            found = karpenter.nodeclaim(name)
            conditions = {c["type"]: c["status"] for c in found["status"].get("conditions") or []}
            return found if conditions.get("Registered") == conditions.get("Initialized") == "True" else None

        claim = wait_for(registered_and_initialized, timeout=30, what="the NodeClaim registered and initialized")
        assert claim["status"]["nodeName"] == node.metadata.name
    finally:
        cluster.admin.apps.delete_namespaced_deployment("infer", namespace)
        karpenter.delete_nodepool(pool)
