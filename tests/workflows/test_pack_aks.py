"""A packing round on an AKS agent pool (capacity.provider aks-nodepools): the local Azure Resource Manager over
HTTPS with its identity endpoint, the pool's machines kwok Nodes on the real control plane, the Temporal dev server
and the official azure-mgmt-containerservice client inside the provider. Six 1-GPU pods spread over three 8-GPU
nodes -> two nodes emptied (their pods evicted one at a time, the PDB honoured) and exactly those machines deleted
through deleteMachines: no count decrease (which lets AKS choose the node) is ever sent."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from activities.capacity.aks import FROZEN_TAG
from models.decisions import Approval
from models.packing import PackSettings
from models.packing import PackView
from tests.activities.capacity.test_aks import RG
from tests.activities.capacity.test_aks import gpu_pods
from tests.activities.capacity.test_aks import identity
from tests.activities.capacity.test_aks import mutations
from tests.activities.capacity.test_aks import pool_nodes
from tests.activities.capacity.test_aks import pool_state
from tests.activities.capacity.test_aks import provider
from tests.activities.capacity.test_aks import ready
from tests.activities.capacity.test_aks import removals
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_SUBSCRIPTION
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.packing import pack_worker
from tests.harness.packing import proposed_round
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import live_pods

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
FAST = PackSettings(pdb_retry_seconds=1, poll_seconds=0.5, replacement_timeout_seconds=30,
                    removal_timeout_seconds=60)
SIZE = "Standard_ND96isr_H100_v5"  # 8 H100s


@pytest.fixture
def fragmented(cluster: Cluster, namespace: str, azure_server: FakeServer, aks_nodes: NodeReconciler,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """An agent pool of three 8-GPU nodes with six 1-GPU pods spread over them by the default scheduler."""
    azure_server.reset()
    azure_server.fault(operation_seconds=0.2, retry_after=0)
    name = f"train-{uuid.uuid4().hex[:6]}"
    azure_server.seed(aks={"subscription": AZURE_SUBSCRIPTION, "resourceGroup": RG, "cluster": name,
                           "location": "westeurope", "agentPools": [
                               {"name": "gpu", "vmSize": SIZE, "count": 3, "mode": "User",
                                "nodeTaints": ["nvidia.com/gpu=true:NoSchedule"],
                                "nodeLabels": {"kubeon.io/pool": "home"}},
                               {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})
    identity(azure_server, monkeypatch)
    wait_for(lambda: len(ready(aks_nodes, name, "gpu")) == 3, timeout=30, what="the pool's 3 nodes Ready")
    cluster.admin.apps.create_namespaced_deployment(namespace, gpu_pods("serve", 6))
    try:
        pods = _running(cluster, namespace)
        spread = Counter(str(p.spec.node_name) for p in pods)
        assert len(spread) == 3, spread
        cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"),
            spec=client.V1PodDisruptionBudgetSpec(max_unavailable=1, selector=client.V1LabelSelector(
                match_labels={"app": "serve"}))))
        yield {"cluster": name, "spread": dict(spread)}
    finally:
        cluster.admin.apps.delete_namespaced_deployment("serve", namespace)
        azure_server.reset()
        wait_for(lambda: not pool_nodes(aks_nodes, name, "gpu"), timeout=30, what="the test's nodes gone")


def _running(cluster: Cluster, namespace: str) -> list[client.V1Pod]:
    def running() -> list[client.V1Pod]:
        pods = live_pods(cluster.admin.core, namespace, "serve")
        return pods if len(pods) == 6 and all(p.status.phase == "Running" for p in pods) else []

    return list(wait_for(running, timeout=60, what="6 serve pods running"))


@pytest.fixture
async def queue(cluster: Cluster, temporal_dev_server: WorkflowEnvironment, azure_server: FakeServer,
                fragmented: dict[str, Any]) -> AsyncIterator[str]:
    optimizer = grant(cluster, "kubeon-pack-aks-test", OPTIMIZER_RULES)
    name = f"pack-aks-{uuid.uuid4().hex[:6]}"
    async with pack_worker(temporal_dev_server.client, name, optimizer.api,
                           provider(optimizer.api, azure_server, fragmented["cluster"])):
        yield name


async def test_approved_round_removes_exactly_the_planned_nodes(
        queue: str, temporal_dev_server: WorkflowEnvironment, cluster: Cluster, namespace: str,
        fragmented: dict[str, Any], azure_server: FakeServer, aks_nodes: NodeReconciler) -> None:
    temporal, spread = temporal_dev_server.client, fragmented["spread"]
    before = set(pool_nodes(aks_nodes, fragmented["cluster"], "gpu"))
    handle, proposal = await proposed_round(temporal, queue, ["gpu"], max_nodes=2)
    assert proposal.plan is not None and len(proposal.plan.empty) == 2
    planned = list(proposal.plan.empty)
    assert removals(azure_server) == [] and mutations(azure_server) == []  # nothing changed before approval
    await handle.signal("approve", Approval(approver="test"))
    view: PackView = await handle.result()
    assert view.phase == "Done", view
    # Nodes are emptied one at a time (only the current one cordoned): a replacement may land on the next planned
    # node and move again.
    # Every planned node is cordoned before the first eviction: no replacement lands on one emptied later, so each
    # planned pod is moved exactly once.
    assert sorted(view.removed) == sorted(planned) and len(view.moved) == sum(spread[n] for n in planned)
    # Exactly the planned machines, each through deleteMachines naming it; never a count decrease.
    assert sorted(d["machine"] for d in removals(azure_server)) == sorted(planned)
    assert {d["via"] for d in removals(azure_server)} == {"deleteMachines"}
    posts = [r["body"] for r in mutations(azure_server) if r["method"] == "POST"]
    assert sorted(b["machineNames"][0] for b in posts) == sorted(planned) and all(
        len(b["machineNames"]) == 1 for b in posts)
    # The pool frozen once for the round (its tag), while both planned nodes are cordoned and emptied, and unfrozen
    # after the last; each such PUT carries the count as read (If-Match): none scaled the pool in (the server
    # records a scale-in's machines with via "scale").
    puts = [r["body"]["properties"] for r in mutations(azure_server) if r["method"] == "PUT"]
    assert [(p["count"], (p.get("tags") or {}).get(FROZEN_TAG)) for p in puts] == [
        (3, handle.id), (1, None)]  # freeze, (deleteMachines twice), unfreeze
    state = pool_state(azure_server, fragmented["cluster"], "gpu")["properties"]
    assert state["count"] == 1 and FROZEN_TAG not in (state.get("tags") or {})
    pods = _running(cluster, namespace)
    kept = before - set(planned)
    assert {p.spec.node_name for p in pods} == kept  # re-placed on the kept node
    wait_for(lambda: set(pool_nodes(aks_nodes, fragmented["cluster"], "gpu")) == kept, timeout=20,
             what="the planned nodes gone")
    assert not any(n.spec.unschedulable for n in pool_nodes(aks_nodes, fragmented["cluster"], "gpu").values())
