"""Every Karpenter permission the capacity provider uses is needed, on the real apiserver: with the chart's
ClusterRole as rendered (exactly R5.1) every call succeeds as the chart's ServiceAccount; with that one verb on
that one resource taken away, the call it is for is refused (403). The provider uses nodepools get/list/patch and
nodeclaims list/delete; R5.1's watch and create on them are not used by it."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from activities.capacity import CapacityError
from activities.capacity.karpenter import KarpenterCapacity
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import bound_rules
from tests.charts.helm import template
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import OPTIMIZER_SA
from tests.harness.rbac import grant
from tests.harness.rbac import install_chart_identities

pytestmark = pytest.mark.cluster

KARPENTER_RULE = {"apiGroups": ["karpenter.sh"], "resources": ["nodepools", "nodeclaims"],
                  "verbs": ["get", "list", "watch", "create", "patch", "delete"]}


def _without(resource: str, verb: str) -> list[dict[str, Any]]:
    rules = [copy.deepcopy(r) for r in OPTIMIZER_RULES if r != KARPENTER_RULE]
    for res in ("nodepools", "nodeclaims"):
        verbs = [v for v in KARPENTER_RULE["verbs"] if not (res == resource and v == verb)]
        rules.append({"apiGroups": ["karpenter.sh"], "resources": [res], "verbs": verbs})
    return rules


def test_chart_grants_exactly_r51_for_karpenter() -> None:
    rules = [r for ns, r in bound_rules(template(values=[BURST_VALUES]), OPTIMIZER_SA) if ns is None]
    assert [r for r in rules if "karpenter.sh" in r.get("apiGroups", [])] == [KARPENTER_RULE]
    assert KARPENTER_RULE in OPTIMIZER_RULES


def test_every_karpenter_verb_used_is_needed(cluster: Cluster, karpenter: Karpenter, namespace: str) -> None:
    taint = uuid.uuid4().hex[:8]
    pool = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(pool, taint=taint, gpu_limit=4, instance_types=("g6.xlarge",)))
    try:
        cluster.admin.apps.create_namespaced_deployment(namespace, gpu_workload("one", taint=taint))
        [node] = wait_for(lambda: [str(n.metadata.name) for n in karpenter.nodes(pool)], timeout=60, what="a node")
        calls: dict[tuple[str, str], Callable[[KarpenterCapacity], object]] = {
            ("nodepools", "list"): lambda c: c.list_groups(),
            ("nodepools", "get"): lambda c: c.get_group(pool),
            ("nodepools", "patch"): lambda c: c.freeze(pool, "rbac-proof"),
            ("nodeclaims", "list"): lambda c: c.get_group(pool),
            ("nodeclaims", "delete"): lambda c: c.remove_node(pool, node),
        }
        for (resource, verb), call in calls.items():
            denied = KarpenterCapacity(grant(cluster, f"kubeon-no-{resource}-{verb}-{taint}",
                                             _without(resource, verb)).api)
            with pytest.raises(CapacityError, match="403") as refused:
                call(denied)
            assert not refused.value.retryable, (resource, verb)
        assert karpenter.nodepool(pool)["spec"]["disruption"]["budgets"] == [{"nodes": "10%"}]
        assert len(karpenter.nodeclaims(pool)) == 1

        optimizer, _ = install_chart_identities(cluster)
        capacity = KarpenterCapacity(optimizer.api)
        for call in calls.values():
            call(capacity)
        capacity.unfreeze(pool, "rbac-proof")
        # The chart's SA's delete was accepted: the NodeClaim is going (Karpenter then drains and removes the node,
        # which tests/activities/capacity/test_karpenter.py follows to the end).
        wait_for(lambda: all(c["metadata"].get("deletionTimestamp") for c in karpenter.nodeclaims(pool)),
                 timeout=30, what="the NodeClaim deleted as the chart's SA")
    finally:
        cluster.admin.apps.delete_namespaced_deployment("one", namespace)
        karpenter.force_delete_nodepool(pool)
