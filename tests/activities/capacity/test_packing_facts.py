"""A fragmented GPU NodePool on the real Karpenter, made as users make it (waves of pods under the default
scheduler, which scores only cpu and memory): the packing facts read with the optimizer's credentials and the
planner's round on them: one of three 4-GPU nodes emptied, its pods re-placed on the others, the $/h it saves;
a PDB without headroom shown on every move it covers; nodes held by do-not-disrupt pods or a bare pod never chosen."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC
from datetime import datetime

import pytest
from kubernetes import client

from activities.capacity.facts import PackFacts
from activities.capacity.facts import gather
from activities.capacity.karpenter import KarpenterCapacity
from activities.packing import plan_round
from models.capacity import DO_NOT_DISRUPT
from models.packing import PackPlan
from models.packing import PackPlanRequest
from planning.packing import plan_packing
from tests.harness import packing
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_tolerations
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import gpu_pod

pytestmark = pytest.mark.cluster


def _running(cluster: Cluster, namespace: str, app: str, count: int) -> list[client.V1Pod]:
    pods = [p for p in cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
            if p.metadata.deletion_timestamp is None]
    return pods if len(pods) == count and all(p.status.phase == "Running" for p in pods) else []


def test_fragmented_pool_one_round(cluster: Cluster, karpenter: Karpenter, namespace: str) -> None:
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=12, gpu_counts=(4,)))
    apps = cluster.admin.apps
    try:
        # Wave 1: three 4-GPU pods, three nodes; gone again, the nodes stay (WhenEmpty, consolidateAfter Never).
        apps.create_namespaced_deployment(namespace, gpu_workload("wave", taint=taint, replicas=3, gpus=4))
        wait_for(lambda: _running(cluster, namespace, "wave", 3), timeout=90, what="three nodes for wave 1")
        apps.delete_namespaced_deployment("wave", namespace)
        wait_for(lambda: not cluster.admin.core.list_namespaced_pod(namespace, label_selector="app=wave").items,
                 timeout=60, what="wave 1 gone")
        # Wave 2: six 1-GPU pods, spread by the default scheduler over the three nodes.
        apps.create_namespaced_deployment(namespace, gpu_workload("serve", taint=taint, replicas=6))
        pods = wait_for(lambda: _running(cluster, namespace, "serve", 6), timeout=60, what="six pods running")
        spread = Counter(p.spec.node_name for p in pods)
        assert len(spread) == 3 and len(karpenter.nodeclaims(pool)) == 3, spread
        cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"),
            spec=client.V1PodDisruptionBudgetSpec(max_unavailable=0,
                                                  selector=client.V1LabelSelector(match_labels={"app": "serve"}))))

        optimizer = grant(cluster, "kubeon-packing-facts-test", OPTIMIZER_RULES)
        capacity = KarpenterCapacity(optimizer.api)

        def with_pdb_status() -> PackFacts | None:
            found = gather(optimizer.api, capacity, [pool])
            return found if f"{namespace}/serve" in found.pdb_allowed else None

        facts = wait_for(with_pdb_status, timeout=30, what="the PDB's status")
        assert sorted(n.name for n in facts.nodes) == sorted(str(n) for n in spread)
        assert all(n.gpus == 4 and n.usd_per_hour == 4.6016 and n.gpu_product == "NVIDIA-L4" for n in facts.nodes)
        assert all(p.owner_kind == "ReplicaSet" and p.pdbs == [f"{namespace}/serve"] for p in facts.pods)
        assert facts.pdb_allowed[f"{namespace}/serve"] == 0

        plan = plan_packing(facts.nodes, facts.pods, now=datetime.now(UTC), pdb_allowed=facts.pdb_allowed,
                            max_nodes=2)
        [emptied] = plan.empty
        assert plan.usd_per_hour_saved == 4.6016
        assert sorted(m.pod for m in plan.moves) == sorted(
            f"{namespace}/{p.metadata.name}" for p in pods if p.spec.node_name == emptied)
        assert all(m.target != emptied and m.waits_for_pdb == f"{namespace}/serve" for m in plan.moves)
        # Moved, each kept node holds at most its 4 GPUs.
        after = Counter({n: c for n, c in spread.items() if n != emptied})
        after.update(m.target for m in plan.moves)
        assert sum(after.values()) == 6 and max(after.values()) <= 4
    finally:
        apps.delete_namespaced_deployment("serve", namespace)
        karpenter.delete_nodepool(pool)


def test_nodes_held_by_do_not_disrupt_or_a_bare_pod_are_not_chosen(cluster: Cluster, karpenter: Karpenter,
                                                                   namespace: str) -> None:
    """On the real cluster, as the optimizer reads it: a pod annotated ``karpenter.sh/do-not-disrupt: "true"``, one
    with a duration not yet elapsed, and a bare pod (no controller re-creates it) each hold their node; with all
    three held no node is emptied, and once the bare pod is gone its node is the one emptied."""
    with packing.fragmented_pool(cluster, karpenter, namespace) as (pool, spread):
        by_node: dict[str, list[client.V1Pod]] = {}
        for pod in packing.wait_running(cluster, namespace, "serve", 6):
            by_node.setdefault(str(pod.spec.node_name), []).append(pod)
        # The bare pod goes to the node with the fewest pods: it has a GPU free for it.
        pinned, waiting, bare_on = sorted(spread, key=lambda n: (-spread[n], n))
        core = cluster.admin.core
        for node, value in ((pinned, "true"), (waiting, "1h")):
            core.patch_namespaced_pod(str(by_node[node][0].metadata.name), namespace,
                                      {"metadata": {"annotations": {DO_NOT_DISRUPT: value}}})
        bare_name = f"bare-{uuid.uuid4().hex[:6]}"
        bare = gpu_pod(bare_name, node_name=bare_on)
        bare.spec.tolerations = gpu_tolerations(pool.removeprefix("gpu-"))
        core.create_namespaced_pod(namespace, bare)
        optimizer = grant(cluster, "kubeon-packing-facts-test", OPTIMIZER_RULES)
        capacity = KarpenterCapacity(optimizer.api)
        try:
            def held() -> PackPlan | None:
                plan = plan_round(optimizer.api, capacity, PackPlanRequest(groups=[pool], max_nodes=2),
                                  datetime.now(UTC))
                return plan if len(plan.kept) == 3 else None

            plan = wait_for(held, timeout=30, what="all three nodes held")
            assert plan.empty == [] and not plan.moves, plan
            assert "karpenter.sh/do-not-disrupt: true" in plan.kept[pinned], plan.kept
            assert "karpenter.sh/do-not-disrupt: 1h (not elapsed)" in plan.kept[waiting], plan.kept
            assert f"{namespace}/{bare_name}" in plan.kept[bare_on], plan.kept
        finally:
            core.delete_namespaced_pod(bare_name, namespace, grace_period_seconds=0)

        def freed() -> PackPlan | None:
            plan = plan_round(optimizer.api, capacity, PackPlanRequest(groups=[pool], max_nodes=2),
                              datetime.now(UTC))
            return plan if plan.empty else None

        assert wait_for(freed, timeout=30, what="the bare pod's node freed").empty == [bare_on]
