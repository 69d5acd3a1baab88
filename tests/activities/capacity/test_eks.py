"""The eks-nodegroups capacity provider with the official boto3 clients against moto (server mode) and the harness's
auto scaling group behind each node group (tests/harness/clouds/eks.py), its instances kwok Nodes on the real
control plane, read with the optimizer's own credentials (R5.1). Every AWS request the provider sends goes through
the ``MotoRecorder``; the harness's own calls do not."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import GroupNotFoundError
from activities.capacity import NodeNotInGroupError
from activities.capacity.eks import EksNodeGroupsCapacity
from models.capacity import HomeNodeGroup
from models.eks import NODEGROUP_LABEL
from models.provisioning import NodeRequirement
from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import live_pods
from tests.harness.workloads import node_group_pods
from tests.harness.workloads import unschedulable_once_settled

pytestmark = [pytest.mark.aws, pytest.mark.cluster]

TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}
# What would let the cloud choose the node (or lower the count behind our back): never sent by the provider.
CLOUD_CHOOSES = {"SetDesiredCapacity", "UpdateAutoScalingGroup", "DetachInstances"}


@pytest.fixture(scope="module")
def optimizer(cluster: Cluster) -> Kube:
    return grant(cluster, "kubeon-eks-capacity-test", OPTIMIZER_RULES)


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default credential chain the provider uses finds these (in the cluster: IRSA / EKS Pod Identity)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def group(eks_nodegroups: EksNodeGroups, eks_nodes: NodeReconciler, eks_api: MotoRecorder,
          optimizer: Kube) -> Iterator[dict[str, Any]]:
    """A 4-GPU L4 node group (g6.12xlarge, min 1, max 4, desired 2) in an EKS cluster of its own, its 2 Nodes
    registered, and the provider pointed at the recorder."""
    cluster, ng = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
    asg = eks_nodegroups.create(cluster, ng, instance_type="g6.12xlarge", min_size=1, max_size=4, desired=2,
                                labels={"kubeon.io/pool": "home"}, taints=[TAINT])
    g = {"cluster": cluster, "ng": ng, "asg": asg, "eks": eks_nodegroups.client("eks"),
         "autoscaling": eks_nodegroups.client("autoscaling")}
    wait_for(lambda: len(_ready(eks_nodes, ng)) == 2, timeout=30, what="the node group's 2 nodes Ready")
    eks_api.clear()
    g["capacity"] = EksNodeGroupsCapacity(optimizer.api, cluster=cluster, region=eks_nodegroups.region,
                                          endpoint_url=eks_api.url)
    yield g
    eks_nodegroups.delete(cluster, ng)


def _nodes(nodes: NodeReconciler, ng: str) -> dict[str, client.V1Node]:
    return nodes.group(NODEGROUP_LABEL, ng)


def _ready(nodes: NodeReconciler, ng: str) -> list[client.V1Node]:
    return nodes.ready(NODEGROUP_LABEL, ng)


def _asg(g: dict[str, Any]) -> dict[str, Any]:
    return dict(g["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=[g["asg"]])["AutoScalingGroups"][0])


def _desired(g: dict[str, Any]) -> int:
    return int(g["eks"].describe_nodegroup(clusterName=g["cluster"], nodegroupName=g["ng"])["nodegroup"][
        "scalingConfig"]["desiredSize"])


def g_scaling(g: dict[str, Any]) -> dict[str, int]:
    return dict(g["eks"].describe_nodegroup(clusterName=g["cluster"], nodegroupName=g["ng"])["nodegroup"][
        "scalingConfig"])


def _actions(recorder: MotoRecorder) -> list[str]:
    return [r["action"] for r in recorder.requests()]


def _mutations(recorder: MotoRecorder) -> list[dict[str, Any]]:
    return [r for r in recorder.requests() if r["action"] in (
        "TerminateInstanceInAutoScalingGroup", *CLOUD_CHOOSES) or r["action"].endswith("/update-config")]


def test_lists_the_gpu_node_groups_with_their_nodes(group: dict[str, Any], eks_nodegroups: EksNodeGroups,
                                                     eks_nodes: NodeReconciler, eks_api: MotoRecorder) -> None:
    cpu = f"cpu-{uuid.uuid4().hex[:6]}"
    eks_nodegroups.create(group["cluster"], cpu, instance_type="m5.large", min_size=1, max_size=2, desired=1)
    try:
        groups = group["capacity"].list_groups()
        assert [g.name for g in groups] == [group["ng"]]  # the CPU group is no GPU group
        found: HomeNodeGroup = groups[0]
        assert found.provider == "eks-nodegroups" and found.gpu_products == ["NVIDIA-L4"]
        assert found.scaling is not None
        assert (found.scaling.min_size, found.scaling.desired_size, found.scaling.max_size) == (1, 2, 4)
        assert found.scaling.auto_scaling_group == group["asg"] and found.scaling.status == "ACTIVE"
        assert found.gpu_limit == 16 and found.gpus == 8 and found.taints == ["nvidia.com/gpu"]
        assert NodeRequirement(key="kubeon.io/pool", operator="In", values=["home"]) in found.requirements
        registered = _nodes(eks_nodes, group["ng"])
        assert sorted(n.name for n in found.nodes) == sorted(registered)
        # Each node mapped to its instance through its providerID: exactly the ASG's instances.
        assert {n.instance for n in found.nodes} == {i["InstanceId"] for i in _asg(group)["Instances"]}
        for n in found.nodes:
            assert registered[n.name].spec.provider_id.endswith("/" + n.instance)
            assert (n.instance_type, n.gpus, n.gpu_product, n.capacity_type) == ("g6.12xlarge", 4, "NVIDIA-L4",
                                                                                 "ON_DEMAND")
            assert n.usd_per_hour == 4.602 and n.ready and not n.cordoned
        assert group["capacity"].get_group(group["ng"]).nodes == found.nodes
        with pytest.raises(GroupNotFoundError, match=cpu):
            group["capacity"].get_group(cpu)
        with pytest.raises(GroupNotFoundError):
            group["capacity"].get_group("missing")
        assert _mutations(eks_api) == []
    finally:
        eks_nodegroups.delete(group["cluster"], cpu)


def test_scale_up_for_the_pending_gpu_pods(group: dict[str, Any], cluster: Cluster, namespace: str,
                                           eks_api: MotoRecorder, eks_nodes: NodeReconciler) -> None:
    capacity: EksNodeGroupsCapacity = group["capacity"]
    # 11 one-GPU pods on 2 four-GPU nodes: 8 run, 3 wait.
    cluster.admin.apps.create_namespaced_deployment(
        namespace, node_group_pods("infer", NODEGROUP_LABEL, group["ng"], 11))

    waiting = wait_for(lambda: unschedulable_once_settled(cluster.admin.core, namespace, "infer", 11, 8), timeout=30,
                       what="8 pods running, 3 unschedulable")
    found = capacity.get_group(group["ng"])
    assert found.scaling is not None and sum(n.gpus_used for n in found.nodes) == 8
    per_node = max(n.gpus for n in found.nodes)
    desired = found.scaling.desired_size + math.ceil(len(waiting) / per_node)
    assert desired == 3
    after = capacity.scale_up(group["ng"], desired)
    capacity.scale_up(group["ng"], desired)  # a retried activity: the same size, nothing sent
    assert after.desired_size == 3 and _desired(group) == 3
    updates = _mutations(eks_api)
    assert [(r["action"], r["params"]["scalingConfig"]) for r in updates] == [
        (f"POST /clusters/{group['cluster']}/node-groups/{group['ng']}/update-config",
         {"minSize": 1, "maxSize": 4, "desiredSize": 3})]
    wait_for(lambda: len(_nodes(eks_nodes, group["ng"])) == 3, timeout=30, what="the third node")
    wait_for(lambda: all(p.status.phase == "Running" for p in live_pods(cluster.admin.core, namespace, "infer")),
             timeout=30, what="all 11 pods running")
    assert _asg(group)["DesiredCapacity"] == 3 and _desired(group) == 3


def test_desired_outside_min_max_or_below_now_is_refused_by_us(group: dict[str, Any], eks_api: MotoRecorder,
                                                                cluster: Cluster, namespace: str) -> None:
    capacity: EksNodeGroupsCapacity = group["capacity"]
    with pytest.raises(CapacityError, match=f"node group {group['ng']}: desired 5 is outside minSize 1 .. "
                                            "maxSize 4") as refused:
        capacity.scale_up(group["ng"], 5)
    assert refused.value.retryable is False
    with pytest.raises(CapacityError, match="below its current 2"):
        capacity.scale_up(group["ng"], 1)
    # cluster-autoscaler running: it owns desired, we never set it.
    cluster.admin.apps.create_namespaced_deployment(namespace, client.V1Deployment(
        metadata=client.V1ObjectMeta(name="cluster-autoscaler", labels={"app": "cluster-autoscaler"}),
        spec=client.V1DeploymentSpec(replicas=0, selector=client.V1LabelSelector(match_labels={"app": "ca"}),
                                     template=client.V1PodTemplateSpec(
                                         metadata=client.V1ObjectMeta(labels={"app": "ca"}),
                                         spec=client.V1PodSpec(containers=[client.V1Container(
                                             name="ca", image="registry.invalid/ca:1")])))))
    try:
        with pytest.raises(CapacityError, match=f"cluster-autoscaler runs \\({namespace}/cluster-autoscaler\\)"):
            capacity.scale_up(group["ng"], 3)
    finally:
        cluster.admin.apps.delete_namespaced_deployment("cluster-autoscaler", namespace)
    assert _mutations(eks_api) == [] and _desired(group) == 2


def _three_nodes(group: dict[str, Any], eks_nodes: NodeReconciler) -> HomeNodeGroup:
    group["capacity"].scale_up(group["ng"], 3)
    wait_for(lambda: len(_ready(eks_nodes, group["ng"])) == 3, timeout=30, what="3 nodes Ready")
    found: HomeNodeGroup = group["capacity"].get_group(group["ng"])
    assert len(found.nodes) == 3
    return found


def test_removes_exactly_the_named_node(group: dict[str, Any], eks_api: MotoRecorder, eks_nodes: NodeReconciler,
                                        eks_nodegroups: EksNodeGroups) -> None:
    capacity: EksNodeGroupsCapacity = group["capacity"]
    found = _three_nodes(group, eks_nodes)
    victim = found.nodes[1]
    kept = {n.instance for n in found.nodes} - {victim.instance}
    eks_api.clear()
    capacity.remove_node(group["ng"], victim.name)
    terminates = _mutations(eks_api)
    assert [(r["action"], r["params"]) for r in terminates] == [
        ("TerminateInstanceInAutoScalingGroup", {"InstanceId": victim.instance,
                                                 "ShouldDecrementDesiredCapacity": "true"})]
    assert not CLOUD_CHOOSES & set(_actions(eks_api))
    assert {i["InstanceId"] for i in _asg(group)["Instances"]} == kept
    wait_for(lambda: capacity.node_gone(group["ng"], victim.name), timeout=20, what=f"node {victim.name} gone")
    assert set(_nodes(eks_nodes, group["ng"])) == {n.name for n in found.nodes} - {victim.name}
    wait_for(lambda: _desired(group) == 2, timeout=20, what="the node group's desiredSize following to 2")
    assert [r for r in eks_nodegroups.removed if r["nodegroup"] == group["ng"]] == [
        {"nodegroup": group["ng"], "instance": victim.instance}]
    capacity.remove_node(group["ng"], victim.name)  # retried after it is gone: nothing sent
    assert len([a for a in _actions(eks_api) if a == "TerminateInstanceInAutoScalingGroup"]) == 1
    # A node of another group is never removed through this one.
    other = found.nodes[0]
    with pytest.raises(NodeNotInGroupError, match=other.name):
        capacity.remove_node(f"{group['ng']}-other", other.name)


def test_removal_below_min_size_is_refused(group: dict[str, Any], eks_api: MotoRecorder,
                                           eks_nodes: NodeReconciler) -> None:
    capacity: EksNodeGroupsCapacity = group["capacity"]
    found = capacity.get_group(group["ng"])  # min 1, desired 2
    capacity.remove_node(group["ng"], found.nodes[0].name)
    wait_for(lambda: _desired(group) == 1, timeout=20, what="desiredSize 1")
    with pytest.raises(CapacityError, match=f"node group {group['ng']}: removing {found.nodes[1].name} would take "
                                            "its auto scaling group .* below MinSize 1"):
        capacity.remove_node(group["ng"], found.nodes[1].name)
    assert [a for a in _actions(eks_api) if a == "TerminateInstanceInAutoScalingGroup"] == [
        "TerminateInstanceInAutoScalingGroup"]


def test_a_removal_whose_answer_comes_late_retried_removes_exactly_one(
        group: dict[str, Any], eks_api: MotoRecorder, eks_nodes: NodeReconciler, eks_nodegroups: EksNodeGroups,
        optimizer: Kube) -> None:
    found = _three_nodes(group, eks_nodes)
    victim = found.nodes[0]
    impatient = EksNodeGroupsCapacity(optimizer.api, cluster=group["cluster"], region=eks_nodegroups.region,
                                      endpoint_url=eks_api.url, client_config={"read_timeout": 0.5})
    eks_api.clear()
    eks_api.faults["slow_remove_seconds"] = 2.0
    # The terminate's answer times out; the provider re-reads the ASG: the instance left it, so it is done.
    impatient.remove_node(group["ng"], victim.name)
    nodegroup = f"GET /clusters/{group['cluster']}/node-groups/{group['ng']}"
    assert _actions(eks_api) == [nodegroup, "DescribeAutoScalingGroups", "TerminateInstanceInAutoScalingGroup",
                                 "DescribeAutoScalingGroups"]  # the re-read after the timed-out answer
    # The activity retried anyway (a worker that died before recording the result): a no-op.
    impatient.remove_node(group["ng"], victim.name)
    group["capacity"].remove_node(group["ng"], victim.name)
    assert [a for a in _actions(eks_api) if a == "TerminateInstanceInAutoScalingGroup"] == [
        "TerminateInstanceInAutoScalingGroup"]
    assert not CLOUD_CHOOSES & set(_actions(eks_api))
    wait_for(lambda: _desired(group) == 2, timeout=20, what="desiredSize 2 (3 less exactly one)")
    assert _asg(group)["DesiredCapacity"] == 2
    assert {i["InstanceId"] for i in _asg(group)["Instances"]} == {n.instance for n in found.nodes[1:]}
    assert [r for r in eks_nodegroups.removed if r["nodegroup"] == group["ng"]] == [
        {"nodegroup": group["ng"], "instance": victim.instance}]


def test_freeze_shield_and_doctor(group: dict[str, Any], eks_api: MotoRecorder, cluster: Cluster) -> None:
    from activities.capacity import FrozenByOtherError
    from activities.capacity.eks import FROZEN_TAG
    from models.eks import SCALE_DOWN_DISABLED
    from worker.doctor import check_capacity

    capacity: EksNodeGroupsCapacity = group["capacity"]

    def tags() -> dict[str, str]:
        return {t["Key"]: t["Value"] for t in _asg(group)["Tags"]}

    capacity.freeze(group["ng"], "op-1")
    capacity.freeze(group["ng"], "op-1")  # retried: the same holder
    assert tags()[FROZEN_TAG] == "op-1"
    with pytest.raises(FrozenByOtherError, match="op-1"):
        capacity.freeze(group["ng"], "op-2")
    capacity.unfreeze(group["ng"], "op-2")  # not its freeze
    assert tags()[FROZEN_TAG] == "op-1"
    capacity.unfreeze(group["ng"], "op-1")
    assert FROZEN_TAG not in tags() and tags()["eks:nodegroup-name"] == group["ng"]

    node = capacity.get_group(group["ng"]).nodes[0].name
    capacity.shield_node(node, True)
    assert cluster.admin.core.read_node(node).metadata.annotations[SCALE_DOWN_DISABLED] == "true"
    capacity.shield_node(node, False)
    assert SCALE_DOWN_DISABLED not in (cluster.admin.core.read_node(node).metadata.annotations or {})

    # The GPU cap is the node group's maxSize (4 GPUs a node); never below what runs or min, never "open".
    assert capacity.set_gpu_limit(group["ng"], 12) == 16
    assert g_scaling(group) == {"minSize": 1, "maxSize": 3, "desiredSize": 2}
    with pytest.raises(CapacityError, match="4 GPUs \\(1 nodes\\) is below its minSize 1 or desired 2"):
        capacity.set_gpu_limit(group["ng"], 4)
    with pytest.raises(CapacityError, match="capped by its maxSize"):
        capacity.set_gpu_limit(group["ng"], None)
    assert capacity.set_gpu_limit(group["ng"], 16) == 12
    assert g_scaling(group)["maxSize"] == 4

    found = check_capacity(cluster.admin.api, "eks-nodegroups", capacity)
    assert (found.name, found.status) == ("EKS node groups", "found")
    assert f"EKS cluster {group['cluster']} in eu-central-1: GPU node groups: 1 ({group['ng']} (1<=2<=4, 2 nodes))" \
        == found.detail
    wrong = EksNodeGroupsCapacity(cluster.admin.api, cluster="no-such-cluster", region="eu-central-1",
                                  endpoint_url=eks_api.url)
    missing = check_capacity(cluster.admin.api, "eks-nodegroups", wrong)
    assert missing.status == "missing" and "no-such-cluster" in missing.detail
    assert [r["params"]["scalingConfig"]["maxSize"] for r in _mutations(eks_api)] == [3, 4]  # the cap's two


def test_the_auto_scaling_groups_name_is_read_once_and_read_again_when_its_group_is_gone(
        group: dict[str, Any], eks_api: MotoRecorder) -> None:
    from activities.capacity.eks import FROZEN_TAG

    capacity: EksNodeGroupsCapacity = group["capacity"]
    nodegroup = f"GET /clusters/{group['cluster']}/node-groups/{group['ng']}"
    capacity.freeze(group["ng"], "op-1")
    capacity.unfreeze(group["ng"], "op-1")
    # The node group is described once (for its ASG's name); the unfreeze reads the ASG directly.
    assert _actions(eks_api) == [nodegroup, "DescribeAutoScalingGroups", "CreateOrUpdateTags",
                                 "DescribeAutoScalingGroups", "DeleteTags"]
    # A name remembered for an ASG that is gone (the node group deleted and re-created): described again.
    capacity._asg_names[group["ng"]] = "eks-gone-0000"
    eks_api.clear()
    capacity.freeze(group["ng"], "op-2")
    assert _actions(eks_api) == ["DescribeAutoScalingGroups", nodegroup, "DescribeAutoScalingGroups",
                                 "CreateOrUpdateTags"]
    assert {t["Key"]: t["Value"] for t in _asg(group)["Tags"]}[FROZEN_TAG] == "op-2"
    capacity.unfreeze(group["ng"], "op-2")


def test_the_worker_runtime_builds_the_provider_from_its_settings(
        worker_capacity: Callable[[dict[str, str]], object]) -> None:
    """capacity.provider eks-nodegroups -> this provider with the cluster, region and AWS endpoint of the settings;
    burst does not defer to it (nothing scales a node group up for a waiting pod yet)."""
    capacity = worker_capacity({"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "eks-nodegroups",
                                "KUBEON_CAPACITY_CLUSTER_NAME": "train", "KUBEON_CAPACITY_REGION": "eu-west-1",
                                "KUBEON_AWS_ENDPOINT_URL": "http://127.0.0.1:5999"})
    assert isinstance(capacity, EksNodeGroupsCapacity)
    assert (capacity.cluster, capacity.region, capacity.endpoint_url) == ("train", "eu-west-1",
                                                                          "http://127.0.0.1:5999")


REMOVER = """
import sys
from pathlib import Path
from activities.capacity.eks import EksNodeGroupsCapacity
from common.kube import kube_api
kubeconfig, cluster, region, endpoint, group, node = sys.argv[1:]
EksNodeGroupsCapacity(kube_api(Path(kubeconfig)), cluster=cluster, region=region,
                      endpoint_url=endpoint).remove_node(group, node)
print("returned", flush=True)
"""


def test_a_worker_killed_after_the_terminate_is_sent_then_retried_removes_exactly_one(
        group: dict[str, Any], eks_api: MotoRecorder, eks_nodes: NodeReconciler, eks_nodegroups: EksNodeGroups,
        cluster: Cluster) -> None:
    """SIGKILL of the process removing a node after its terminate reached AWS and before the answer: the activity's
    retry (here: the same call in a new process's place) sends nothing, one instance is removed, desired 3 -> 2."""
    from tests.harness.processes import killed_once

    found = _three_nodes(group, eks_nodes)
    victim = found.nodes[2]
    eks_api.clear()
    eks_api.faults["slow_remove_seconds"] = 5.0
    killed_once(REMOVER, [str(cluster.plane.admin_kubeconfig), group["cluster"], eks_nodegroups.region, eks_api.url,
                          group["ng"], victim.name],
                lambda: "TerminateInstanceInAutoScalingGroup" in _actions(eks_api), what="the terminate sent",
                timeout=20)
    group["capacity"].remove_node(group["ng"], victim.name)  # the retry
    assert [a for a in _actions(eks_api) if a == "TerminateInstanceInAutoScalingGroup"] == [
        "TerminateInstanceInAutoScalingGroup"]
    assert not CLOUD_CHOOSES & set(_actions(eks_api))
    wait_for(lambda: _desired(group) == 2, timeout=20, what="desiredSize 2 (3 less exactly one)")
    assert {i["InstanceId"] for i in _asg(group)["Instances"]} == {n.instance for n in found.nodes[:2]}
    assert [r for r in eks_nodegroups.removed if r["nodegroup"] == group["ng"]] == [
        {"nodegroup": group["ng"], "instance": victim.instance}]
    wait_for(lambda: group["capacity"].node_gone(group["ng"], victim.name), timeout=20, what="its node gone")


def test_kubeon_gpu_doctor_reports_the_node_groups(group: dict[str, Any], eks_api: MotoRecorder, cluster: Cluster,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`kubeon-gpu doctor --json` with capacity.provider eks-nodegroups lists the GPU node groups it finds."""
    import json

    from worker.cli import main

    for var, value in {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "eks-nodegroups",
                       "KUBEON_CAPACITY_CLUSTER_NAME": group["cluster"], "KUBEON_CAPACITY_REGION": "eu-central-1",
                       "KUBEON_AWS_ENDPOINT_URL": eks_api.url}.items():
        monkeypatch.setenv(var, value)
    assert main(["doctor", "--kubeconfig", str(cluster.plane.admin_kubeconfig), "--json"]) == 0
    [eks] = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "EKS node groups"]
    assert eks["status"] == "found"
    assert f"EKS cluster {group['cluster']} in eu-central-1: GPU node groups: 1 ({group['ng']} (1<=2<=4, 2 nodes))" \
        == eks["detail"]
