"""A packing round on an EKS managed node group (capacity.provider eks-nodegroups): the EKS API from moto with the
harness's auto scaling group behind the node group, its instances kwok Nodes on the real control plane, the
Temporal dev server and the official boto3 client inside the provider. Six 1-GPU pods over three 4-GPU nodes ->
one node emptied (its pods evicted one at a time, PDB honoured) and exactly that node's instance terminated with
decrement: no resize that lets the cloud choose is ever sent."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from activities.capacity.eks import EksNodeGroupsCapacity
from models.decisions import Approval
from models.eks import NODEGROUP_LABEL
from models.packing import PackView
from tests.harness import packing
from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import node_group_pods
from tests.harness.workloads import running_pods

pytestmark = [pytest.mark.cluster, pytest.mark.temporal, pytest.mark.aws]
CLOUD_CHOOSES = {"SetDesiredCapacity", "UpdateAutoScalingGroup", "DetachInstances"}


@pytest.fixture
def fragmented(cluster: Cluster, namespace: str, eks_nodegroups: EksNodeGroups, eks_nodes: NodeReconciler,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A node group of three 4-GPU nodes with six 1-GPU pods spread over them by the default scheduler."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    eks_cluster, ng = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
    asg = eks_nodegroups.create(eks_cluster, ng, instance_type="g6.12xlarge", min_size=1, max_size=4, desired=3,
                                taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}])
    # Ready (kwok lifts the not-ready taint), so the scheduler spreads over all three.
    wait_for(lambda: len(eks_nodes.ready(NODEGROUP_LABEL, ng)) == 3, timeout=30,
             what="the node group's 3 nodes Ready")
    apps = cluster.admin.apps
    labels = {"app": "serve"}
    apps.create_namespaced_deployment(namespace, node_group_pods("serve", NODEGROUP_LABEL, ng, 6))
    try:
        pods = running_pods(cluster.admin.core, namespace, "serve", 6)
        spread = Counter(str(p.spec.node_name) for p in pods)
        assert len(spread) == 3, spread
        cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="serve"),
            spec=client.V1PodDisruptionBudgetSpec(max_unavailable=1, selector=client.V1LabelSelector(
                match_labels=labels))))
        yield {"cluster": eks_cluster, "ng": ng, "asg": asg, "spread": dict(spread),
               "eks": eks_nodegroups.client("eks"), "autoscaling": eks_nodegroups.client("autoscaling")}
    finally:
        apps.delete_namespaced_deployment("serve", namespace)
        eks_nodegroups.delete(eks_cluster, ng)


@pytest.fixture
async def pack_worker(cluster: Cluster, temporal_dev_server: WorkflowEnvironment, eks_api: MotoRecorder,
                      fragmented: dict[str, Any]) -> AsyncIterator[str]:
    optimizer = grant(cluster, "kubeon-pack-eks-test", OPTIMIZER_RULES)
    capacity = EksNodeGroupsCapacity(optimizer.api, cluster=fragmented["cluster"], region="eu-central-1",
                                     endpoint_url=eks_api.url)
    queue = f"pack-eks-{uuid.uuid4().hex[:6]}"
    async with packing.pack_worker(temporal_dev_server.client, queue, optimizer.api, capacity):
        yield queue


async def test_approved_round_removes_exactly_the_planned_node(
        pack_worker: str, temporal_dev_server: WorkflowEnvironment, cluster: Cluster, namespace: str,
        fragmented: dict[str, Any], eks_api: MotoRecorder, eks_nodes: NodeReconciler,
        eks_nodegroups: EksNodeGroups) -> None:
    temporal, ng, spread = temporal_dev_server.client, fragmented["ng"], fragmented["spread"]
    instance_of = {name: n.spec.provider_id.rsplit("/", 1)[1]
                   for name, n in eks_nodes.group(NODEGROUP_LABEL, ng).items()}
    eks_api.clear()
    handle, proposal = await packing.proposed_round(temporal, pack_worker, [ng])
    assert proposal.plan is not None and len(proposal.plan.empty) == 1
    [planned] = proposal.plan.empty
    assert not [r for r in eks_api.requests() if r["action"] == "TerminateInstanceInAutoScalingGroup"]
    await handle.signal("approve", Approval(approver="test"))
    view: PackView = await handle.result()
    assert view.phase == "Done", view
    assert view.removed == [planned] and len(view.moved) == spread[planned]
    terminates = [r["params"] for r in eks_api.requests() if r["action"] == "TerminateInstanceInAutoScalingGroup"]
    assert terminates == [{"InstanceId": instance_of[planned], "ShouldDecrementDesiredCapacity": "true"}]
    assert not CLOUD_CHOOSES & {r["action"] for r in eks_api.requests()}
    # The group frozen for the round (its ASG tagged) and unfrozen at its end.
    tagging = [r["action"] for r in eks_api.requests() if r["action"] in ("CreateOrUpdateTags", "DeleteTags")]
    assert tagging == ["CreateOrUpdateTags", "DeleteTags"]
    assert [r for r in eks_nodegroups.removed if r["nodegroup"] == ng] == [
        {"nodegroup": ng, "instance": instance_of[planned]}]
    pods = running_pods(cluster.admin.core, namespace, "serve", 6)
    assert planned not in {p.spec.node_name for p in pods}
    assert set(eks_nodes.group(NODEGROUP_LABEL, ng)) == set(instance_of) - {planned}
    assert not any(n.spec.unschedulable for n in eks_nodes.group(NODEGROUP_LABEL, ng).values())
    wait_for(lambda: fragmented["eks"].describe_nodegroup(clusterName=fragmented["cluster"], nodegroupName=ng)[
        "nodegroup"]["scalingConfig"]["desiredSize"] == 2, timeout=20, what="the node group's desiredSize at 2")
    tags = {t["Key"] for t in fragmented["autoscaling"].describe_auto_scaling_groups(
        AutoScalingGroupNames=[fragmented["asg"]])["AutoScalingGroups"][0]["Tags"]}
    assert "kubeon.io/disruption-frozen-by" not in tags  # unfrozen at the end
