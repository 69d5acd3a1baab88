"""A packing round on a GKE node pool (capacity.provider gke-nodepools): the local GKE server (node pools and their
MIGs), its VMs kwok Nodes on the real control plane, the Temporal dev server and the official google-cloud-container
/ google-cloud-compute clients inside the provider. Six 1-GPU pods over three 8-GPU nodes -> the two nodes planned
emptied (their pods evicted one at a time, PDB honoured, re-placed first) and exactly their VMs deleted from the
MIG: no resize that lets the cloud choose (setSize down, MIG resize) is ever sent. (Six pods cannot leave two of
three 4-GPU nodes empty; on 8-GPU nodes the round removes two.)"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from activities.capacity.gke import GkeNodePoolsCapacity
from models.decisions import Approval
from models.gke import FROZEN_BY_ANNOTATION
from models.gke import NODEPOOL_LABEL
from models.packing import PackView
from tests.harness import packing
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import GKE_LOCATION
from tests.harness.clouds.local import GKE_PROJECT
from tests.harness.clouds.local import GKE_ZONE
from tests.harness.clouds.local import seed_gke_gpu_pool
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import node_group_pods
from tests.harness.workloads import running_pods

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
PROJECT, LOCATION, ZONE = GKE_PROJECT, GKE_LOCATION, GKE_ZONE


@pytest.fixture
def fragmented(cluster: Cluster, namespace: str, gcp_server: FakeServer,
               gke_nodes: NodeReconciler) -> Iterator[dict[str, Any]]:
    """A node pool of three 8-GPU nodes (one zone) with six 1-GPU pods spread over them by the default scheduler."""
    gke_cluster, pool = seed_gke_gpu_pool(gcp_server, machine_type="a2-highgpu-8g", nodes=3)
    wait_for(lambda: len(gke_nodes.ready(NODEPOOL_LABEL, pool)) == 3, timeout=30, what="the pool's 3 nodes Ready")
    apps = cluster.admin.apps
    apps.create_namespaced_deployment(namespace, node_group_pods("serve", NODEPOOL_LABEL, pool, 6))
    try:
        spread = Counter(str(p.spec.node_name) for p in running_pods(cluster.admin.core, namespace, "serve", 6))
        assert len(spread) == 3, spread
        cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"),
            spec=client.V1PodDisruptionBudgetSpec(max_unavailable=1, selector=client.V1LabelSelector(
                match_labels={"app": "serve"}))))
        yield {"cluster": gke_cluster, "pool": pool, "spread": dict(spread)}
    finally:
        apps.delete_namespaced_deployment("serve", namespace)
        gcp_server.reset()
        wait_for(lambda: not gke_nodes.group(NODEPOOL_LABEL, pool), timeout=30, what="the pool's nodes gone")


@pytest.fixture
async def pack_worker(cluster: Cluster, temporal_dev_server: WorkflowEnvironment, gcp_server: FakeServer,
                      fragmented: dict[str, Any]) -> AsyncIterator[str]:
    optimizer = grant(cluster, "kubeon-pack-gke-test", OPTIMIZER_RULES)
    capacity = GkeNodePoolsCapacity(optimizer.api, project=PROJECT, location=LOCATION,
                                    cluster=fragmented["cluster"], endpoint_url=gcp_server.url, poll_seconds=0.2)
    queue = f"pack-gke-{uuid.uuid4().hex[:6]}"
    async with packing.pack_worker(temporal_dev_server.client, queue, optimizer.api, capacity):
        yield queue


async def test_approved_round_removes_exactly_the_planned_node(
        pack_worker: str, temporal_dev_server: WorkflowEnvironment, cluster: Cluster, namespace: str,
        fragmented: dict[str, Any], gcp_server: FakeServer, gke_nodes: NodeReconciler) -> None:
    pool, spread = fragmented["pool"], fragmented["spread"]
    before = set(gke_nodes.group(NODEPOOL_LABEL, pool))
    original = {p.metadata.name for p in running_pods(cluster.admin.core, namespace, "serve", 6)}
    handle, proposal = await packing.proposed_round(temporal_dev_server.client, pack_worker, [pool])
    assert proposal.plan is not None and len(proposal.plan.empty) == 2
    planned = list(proposal.plan.empty)
    assert not [r for r in gcp_server.requests() if r["path"].endswith("/deleteInstances")]
    await handle.signal("approve", Approval(approver="test"))
    view: PackView = await handle.result()
    assert view.phase == "Done", view
    # Nodes are emptied one at a time (only the current one cordoned): a replacement may land on the next planned
    # node and move again.
    # Every planned node is cordoned before the first eviction: no replacement lands on one emptied later, so each
    # planned pod is moved exactly once.
    assert sorted(view.removed) == sorted(planned) and len(view.moved) == sum(spread[n] for n in planned)
    # The server removed exactly the planned VMs, each through a deleteInstances of its own; nothing let the cloud
    # choose.
    assert sorted(d["instance"] for d in gcp_server.state()["deleted"] if d["via"] != "seed") == sorted(planned)
    assert {d["via"] for d in gcp_server.state()["deleted"] if d["via"] != "seed"} == {"deleteInstances"}
    removals = [r for r in gcp_server.requests() if r["path"].endswith("/deleteInstances")]
    assert [r["body"] for r in removals] == [{"instances": [f"zones/{ZONE}/instances/{n}"],
                                              "skipInstancesOnValidationError": True} for n in view.removed]
    assert not [r for r in gcp_server.requests() if r["path"].endswith((":setSize", "/resize"))]
    pods = running_pods(cluster.admin.core, namespace, "serve", 6)
    assert not set(planned) & {p.spec.node_name for p in pods}
    assert {p.spec.node_name for p in pods} == before - set(planned)  # re-placed on the kept node
    # Re-placed first: every running replacement was created before the last removal was sent (seconds: the
    # API server's resolution).
    replacements = [p for p in pods if p.metadata.name not in original]
    assert len(replacements) == sum(spread[n] for n in planned)
    sent = datetime.fromtimestamp(removals[-1]["time"], tz=UTC)
    assert all(p.metadata.creation_timestamp <= sent for p in replacements)
    wait_for(lambda: set(gke_nodes.group(NODEPOOL_LABEL, pool)) == before - set(planned), timeout=30,
             what=f"nodes {planned} gone")
    kept = gke_nodes.group(NODEPOOL_LABEL, pool).values()
    assert not any(n.spec.unschedulable for n in kept)
    assert not any(FROZEN_BY_ANNOTATION in (n.metadata.annotations or {}) for n in kept)  # unfrozen at the end
