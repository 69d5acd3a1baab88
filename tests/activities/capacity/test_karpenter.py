"""The Karpenter capacity provider against the real Karpenter (kwok provider) on the real control plane, with the
optimizer's own credentials (R5.1): list the GPU NodePools with their nodes, usage, limits and prices; freeze and
unfreeze a pool's disruption leaving the user's budgets as they were; shield a node; cap and open GPU capacity
(Karpenter then launches nothing beyond the cap, and launches again once it is lifted); remove exactly one node
(its NodeClaim deleted; in a static pool replicas decremented once)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity import NodeNotInGroupError
from activities.capacity.karpenter import KarpenterCapacity
from models.capacity import DO_NOT_DISRUPT
from models.capacity import FROZEN_BY_ANNOTATION
from tests.harness.karpenter import L4
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant

pytestmark = pytest.mark.cluster

USER_BUDGETS: list[dict[str, Any]] = [{"nodes": "1", "reasons": ["Drifted"]},
                                     {"nodes": "0", "schedule": "0 9 * * mon-fri", "duration": "8h"}]


@pytest.fixture(scope="module")
def optimizer(cluster: Cluster) -> Kube:
    return grant(cluster, "kubeon-capacity-test", OPTIMIZER_RULES)


@pytest.fixture
def pool(karpenter: Karpenter) -> Iterator[tuple[str, str]]:
    taint = uuid.uuid4().hex[:8]
    name = f"gpu-{taint}"
    karpenter.create_nodepool(gpu_nodepool(name, taint=taint, gpu_limit=8, gpu_counts=(4,), budgets=USER_BUDGETS))
    yield name, taint
    karpenter.delete_nodepool(name)


def _running(cluster: Cluster, namespace: str, app: str, count: int) -> list[client.V1Pod]:
    pods = [p for p in cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
            if p.metadata.deletion_timestamp is None]
    return pods if len(pods) == count and all(p.status.phase == "Running" for p in pods) else []


def test_groups_freeze_shield_limits_and_removal(cluster: Cluster, karpenter: Karpenter, namespace: str,
                                                 optimizer: Kube, pool: tuple[str, str]) -> None:
    name, taint = pool
    capacity = KarpenterCapacity(optimizer.api)
    apps = cluster.admin.apps
    # Two 3-GPU pods: two 4-GPU L4 nodes (g6.12xlarge), 8 of the pool's 8 GPUs.
    apps.create_namespaced_deployment(namespace, gpu_workload("big", taint=taint, replicas=2, gpus=3))
    pods = wait_for(lambda: _running(cluster, namespace, "big", 2), timeout=90, what="two pods on two new nodes")
    assert len({p.spec.node_name for p in pods}) == 2

    # Karpenter records a NodeClaim's status.nodeName at registration, which may land after the pods run there.
    group = wait_for(lambda: next((g for g in capacity.list_groups() if g.name == name and g.gpus == 8
                                   and len(g.nodes) == 2 and all(n.nodeclaim for n in g.nodes)), None),
                     timeout=30, what="the pool's status counting 8 GPUs and its nodes mapped to their NodeClaims")
    assert group.provider == "karpenter" and group.gpu_products == [L4]
    assert group.gpu_limit == 8 and group.at_gpu_limit and group.replicas is None
    assert group.budgets == USER_BUDGETS and group.frozen_by is None
    assert sorted(n.name for n in group.nodes) == sorted(str(p.spec.node_name) for p in pods)
    for n in group.nodes:
        assert (n.instance_type, n.gpus, n.gpus_used, n.gpu_product) == ("g6.12xlarge", 4, 3, L4)
        assert n.usd_per_hour == 4.6016 and n.nodeclaim and n.ready and not n.cordoned
    assert group.usd_per_hour == 9.2032
    with pytest.raises(GroupNotFoundError):
        capacity.get_group(f"missing-{taint}")

    # Freeze: our {nodes: "0"} after the user's budgets; another operation cannot take it; unfreeze restores them.
    capacity.freeze(name, "op-1")
    capacity.freeze(name, "op-1")  # a retried activity: no second entry
    frozen = karpenter.nodepool(name)
    assert frozen["spec"]["disruption"]["budgets"] == [*USER_BUDGETS, {"nodes": "0"}]
    assert frozen["metadata"]["annotations"][FROZEN_BY_ANNOTATION] == "op-1"
    with pytest.raises(FrozenByOtherError, match="op-1"):
        capacity.freeze(name, "op-2")
    capacity.unfreeze(name, "op-2")  # not its freeze: nothing changes
    assert capacity.get_group(name).frozen_by == "op-1"
    capacity.unfreeze(name, "op-1")
    capacity.unfreeze(name, "op-1")
    thawed = karpenter.nodepool(name)
    assert thawed["spec"]["disruption"]["budgets"] == USER_BUDGETS
    assert FROZEN_BY_ANNOTATION not in (thawed["metadata"].get("annotations") or {})

    # Shield: Karpenter's node annotation, lifted only if ours; a user's own stays.
    first, second = (n.name for n in group.nodes)
    capacity.shield_node(first, True)
    assert cluster.admin.core.read_node(first).metadata.annotations[DO_NOT_DISRUPT] == "true"
    capacity.shield_node(first, False)
    assert DO_NOT_DISRUPT not in (cluster.admin.core.read_node(first).metadata.annotations or {})
    cluster.admin.core.patch_node(second, {"metadata": {"annotations": {DO_NOT_DISRUPT: "true"}}})
    capacity.shield_node(second, True)
    capacity.shield_node(second, False)
    assert cluster.admin.core.read_node(second).metadata.annotations[DO_NOT_DISRUPT] == "true"
    cluster.admin.core.patch_node(second, {"metadata": {"annotations": {DO_NOT_DISRUPT: None}}})

    # Cap the pool at 8 GPUs (it is there): a third pod (2 GPUs; 1 is free on each node) waits with no NodeClaim
    # for it; open it: one is launched.
    assert capacity.set_gpu_limit(name, 8) == 8
    apps.create_namespaced_deployment(namespace, gpu_workload("more", taint=taint, gpus=2))

    def karpenter_refused() -> bool:
        events = cluster.admin.core.list_namespaced_event(namespace, field_selector="reason=FailedScheduling").items
        return any("exceed limits for nodepool" in (e.message or "") for e in events)

    wait_for(karpenter_refused, timeout=60, what="Karpenter refusing the third pod at the pool's GPU limit")
    assert len(karpenter.nodeclaims(name)) == 2
    assert capacity.set_gpu_limit(name, None) == 8
    assert "limits" not in karpenter.nodepool(name)["spec"] or \
        "nvidia.com/gpu" not in karpenter.nodepool(name)["spec"]["limits"]
    wait_for(lambda: len(karpenter.nodeclaims(name)) == 3, timeout=60, what="a NodeClaim once the limit is lifted")
    wait_for(lambda: _running(cluster, namespace, "more", 1), timeout=60, what="the third pod running")

    # Remove exactly one node: its NodeClaim goes, and its Node; the others stay.
    foreign = _foreign_node(cluster, taint)
    try:
        with pytest.raises(NodeNotInGroupError):
            capacity.remove_node(name, foreign)
    finally:
        cluster.admin.core.delete_node(foreign)
    apps.delete_namespaced_deployment("more", namespace)
    more_node = next(n.name for n in capacity.get_group(name).nodes if n.name not in (first, second))
    capacity.remove_node(name, more_node)
    capacity.remove_node(name, more_node)
    wait_for(lambda: capacity.node_gone(name, more_node), timeout=180, what=f"node {more_node} and its NodeClaim gone")
    assert sorted(n.name for n in capacity.get_group(name).nodes) == sorted((first, second))
    capacity.remove_node(name, more_node)  # gone: a no-op


def _foreign_node(cluster: Cluster, taint: str) -> str:
    name = f"plain-{taint}"
    cluster.create_kwok_node(name, taints=[client.V1Taint(key="gpu.kubeon.io/karpenter-test", value=f"x{taint}",
                                                          effect="NoSchedule")])
    return name


def test_static_pool_removal_decrements_replicas_once(cluster: Cluster, karpenter: Karpenter,
                                                      optimizer: Kube) -> None:
    taint = uuid.uuid4().hex[:8]
    name = f"static-{taint}"
    # Static NodeClaims are not scheduled: the kwok provider needs the pool to name the instance type.
    body = gpu_nodepool(name, taint=taint, instance_types=("g6.xlarge",))
    body["spec"]["replicas"] = 2
    body["spec"]["limits"] = {"nodes": "3"}
    del body["spec"]["disruption"]["consolidationPolicy"]
    karpenter.create_nodepool(body)
    capacity = KarpenterCapacity(optimizer.api)
    try:
        def initialized() -> bool:
            claims = karpenter.nodeclaims(name)
            return len(claims) == 2 and all(
                any(c["type"] == "Initialized" and c["status"] == "True"
                    for c in (claim.get("status") or {}).get("conditions") or []) for claim in claims)

        wait_for(initialized, timeout=60, what="the static pool's two NodeClaims initialized")
        nodes = karpenter.nodes(name)
        victim = str(nodes[0].metadata.name)
        assert capacity.get_group(name).replicas == 2
        capacity.remove_node(name, victim)
        capacity.remove_node(name, victim)  # retried: decremented once
        assert karpenter.nodepool(name)["spec"]["replicas"] == 1
        wait_for(lambda: len(karpenter.nodes(name)) == 1 and len(karpenter.nodeclaims(name)) == 1, timeout=60,
                 what="the static pool down to one node")
        with pytest.raises(CapacityError, match="static"):
            capacity.set_gpu_limit(name, 4)
    finally:
        karpenter.delete_nodepool(name)


def test_launchable_instance_types_are_those_the_requirements_name_priced_at_the_highest_known(
        karpenter: Karpenter, optimizer: Kube) -> None:
    """What a dollar budget values a pool at: the types its instance-type requirement names (less NotIn; its GPU
    product requirement is not judged), each at the catalogue's highest list price; an uncatalogued type is
    unpriced; a pool naming no type may launch any, so none is known."""
    taint = uuid.uuid4().hex[:8]
    named, unpriced, unnamed = f"named-{taint}", f"unpriced-{taint}", f"unnamed-{taint}"
    capacity = KarpenterCapacity(optimizer.api)
    try:
        body = gpu_nodepool(named, taint=taint, instance_types=("g6.xlarge", "g6.12xlarge", "a2-highgpu-1g"))
        body["spec"]["template"]["spec"]["requirements"].append(
            {"key": "node.kubernetes.io/instance-type", "operator": "NotIn", "values": ["g6.xlarge"]})
        karpenter.create_nodepool(body)
        karpenter.create_nodepool(gpu_nodepool(unpriced, taint=taint,
                                               instance_types=("g6.12xlarge", "g6.48xlarge")))
        karpenter.create_nodepool(gpu_nodepool(unnamed, taint=taint, gpu_counts=(4,)))
        group = capacity.get_group(named)
        assert group.launchable is not None and group.unpriced == []
        # NotIn takes g6.xlarge out; a2-highgpu-1g (an A100 type) stays although the pool requires L4: on a real
        # cloud that requirement need not filter types. Its price is GCP's highest region's (europe-west4).
        assert [(t.instance_type, t.gpus, t.usd_per_hour) for t in group.launchable] == [
            ("a2-highgpu-1g", 1, 3.856), ("g6.12xlarge", 4, 4.602)]
        group = capacity.get_group(unpriced)
        assert [t.instance_type for t in group.launchable or []] == ["g6.12xlarge"]
        assert group.unpriced == ["g6.48xlarge"]
        group = capacity.get_group(unnamed)
        assert group.launchable is None and group.unpriced == []
    finally:
        for pool in (named, unpriced, unnamed):
            karpenter.delete_nodepool(pool)
