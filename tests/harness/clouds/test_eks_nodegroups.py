"""EKS managed node groups on moto with the ASG the harness puts behind each (clouds/eks.py), driven by boto3's
eks and autoscaling clients: scaling both ways, removing one named instance, the kwok Nodes following."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.clouds.eks import EksNodeGroups
from tests.harness.clouds.eks import MotoRecorder
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import group_taints
from tests.harness.kube import wait_for

pytestmark = pytest.mark.aws


@pytest.fixture(scope="module")
def groups(eks_nodegroups: EksNodeGroups) -> EksNodeGroups:
    return eks_nodegroups


@pytest.fixture(scope="module")
def nodes(eks_nodes: NodeReconciler) -> NodeReconciler:
    return eks_nodes


@pytest.fixture
def group(groups: EksNodeGroups, nodes: NodeReconciler) -> Iterator[dict[str, Any]]:
    cluster, ng = f"train-{uuid.uuid4().hex[:6]}", "gpu"
    asg = groups.create(cluster, ng, instance_type="g6.12xlarge", min_size=1, max_size=4, desired=2,
                        labels={"kubeon.io/pool": "home"},
                        taints=[{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}])
    yield {"cluster": cluster, "ng": ng, "asg": asg, "eks": groups.client("eks"),
           "autoscaling": groups.client("autoscaling"), "ec2": groups.client("ec2")}
    groups.delete(cluster, ng)


def _asg(g: dict[str, Any]) -> dict[str, Any]:
    return dict(g["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=[g["asg"]])["AutoScalingGroups"][0])


def _scaling(g: dict[str, Any]) -> dict[str, int]:
    return dict(g["eks"].describe_nodegroup(clusterName=g["cluster"], nodegroupName=g["ng"])["nodegroup"][
        "scalingConfig"])


def _nodes_of(nodes: NodeReconciler, instance_ids: set[str]) -> dict[str, Any]:
    return {n.spec.provider_id.rsplit("/", 1)[1]: n for n in nodes.nodes().values()
            if n.spec.provider_id.rsplit("/", 1)[1] in instance_ids}


def test_the_node_group_has_its_asg_and_its_instances_are_gpu_nodes(group: dict[str, Any],
                                                                    nodes: NodeReconciler) -> None:
    described = group["eks"].describe_nodegroup(clusterName=group["cluster"], nodegroupName="gpu")["nodegroup"]
    assert described["resources"]["autoScalingGroups"] == [{"name": group["asg"]}]
    asg = _asg(group)
    assert (asg["MinSize"], asg["MaxSize"], asg["DesiredCapacity"]) == (1, 4, 2)
    tags = {t["Key"]: t["Value"] for t in asg["Tags"]}
    assert tags["eks:nodegroup-name"] == "gpu" and tags["eks:cluster-name"] == group["cluster"]
    ids = {i["InstanceId"] for i in asg["Instances"]}
    assert len(ids) == 2
    wait_for(lambda: set(_nodes_of(nodes, ids)) == ids, timeout=20, what="the node group's nodes")
    node = next(iter(_nodes_of(nodes, ids).values()))
    labels = node.metadata.labels
    assert labels["eks.amazonaws.com/nodegroup"] == "gpu" and labels["kubeon.io/pool"] == "home"
    assert node.spec.provider_id == f"aws:///{labels['topology.kubernetes.io/zone']}/" \
                                    f"{node.spec.provider_id.rsplit('/', 1)[1]}"
    assert node.status.capacity["nvidia.com/gpu"] == "4"
    assert group_taints(node) == [("nvidia.com/gpu", "true", "NoSchedule")]
    assert node.metadata.name.startswith("ip-") and node.metadata.name.endswith(".internal")  # its private DNS name


def test_update_nodegroup_config_is_followed_by_the_asg(group: dict[str, Any], nodes: NodeReconciler) -> None:
    group["eks"].update_nodegroup_config(clusterName=group["cluster"], nodegroupName="gpu",
                                         scalingConfig={"minSize": 1, "maxSize": 4, "desiredSize": 3})
    wait_for(lambda: _asg(group)["DesiredCapacity"] == 3 and len(_asg(group)["Instances"]) == 3, timeout=20,
             what="the ASG at desired 3")
    ids = {i["InstanceId"] for i in _asg(group)["Instances"]}
    wait_for(lambda: set(_nodes_of(nodes, ids)) == ids, timeout=20, what="3 nodes")


def test_terminate_with_decrement_removes_exactly_that_instance_and_the_node_group_follows(
        group: dict[str, Any], groups: EksNodeGroups, nodes: NodeReconciler) -> None:
    group["eks"].update_nodegroup_config(clusterName=group["cluster"], nodegroupName="gpu",
                                         scalingConfig={"minSize": 1, "maxSize": 4, "desiredSize": 3})
    wait_for(lambda: len(_asg(group)["Instances"]) == 3, timeout=20, what="3 instances")
    ids = sorted(i["InstanceId"] for i in _asg(group)["Instances"])
    wait_for(lambda: set(_nodes_of(nodes, set(ids))) == set(ids), timeout=20, what="3 nodes")
    victim = ids[1]
    group["autoscaling"].terminate_instance_in_auto_scaling_group(InstanceId=victim,
                                                                  ShouldDecrementDesiredCapacity=True)
    wait_for(lambda: _scaling(group)["desiredSize"] == 2, timeout=20, what="the node group's desiredSize at 2")
    assert _asg(group)["DesiredCapacity"] == 2
    assert {i["InstanceId"] for i in _asg(group)["Instances"]} == set(ids) - {victim}
    states = {i["InstanceId"]: i["State"]["Name"] for r in group["ec2"].describe_instances(InstanceIds=ids)[
        "Reservations"] for i in r["Instances"]}
    assert states[victim] in ("shutting-down", "terminated")
    assert all(states[i] == "running" for i in ids if i != victim)
    wait_for(lambda: set(_nodes_of(nodes, set(ids))) == set(ids) - {victim}, timeout=20,
             what=f"the node of {victim} gone, the others kept")
    assert [r for r in groups.removed if r["instance"] in ids] == [{"nodegroup": "gpu", "instance": victim}]


def test_terminate_without_decrement_is_replaced(group: dict[str, Any]) -> None:
    ids = {i["InstanceId"] for i in _asg(group)["Instances"]}
    victim = sorted(ids)[0]
    group["autoscaling"].terminate_instance_in_auto_scaling_group(InstanceId=victim,
                                                                  ShouldDecrementDesiredCapacity=False)
    after = {i["InstanceId"] for i in _asg(group)["Instances"]}
    assert victim not in after and len(after) == 2 and _asg(group)["DesiredCapacity"] == 2
    assert _scaling(group)["desiredSize"] == 2


def test_moto_does_not_validate_desired_against_max(group: dict[str, Any]) -> None:
    """What the eks-nodegroups provider must check itself (capacity.md §6): moto accepts desired 9 > max 4."""
    group["eks"].update_nodegroup_config(clusterName=group["cluster"], nodegroupName="gpu",
                                         scalingConfig={"minSize": 1, "maxSize": 4, "desiredSize": 9})
    assert _scaling(group) == {"minSize": 1, "maxSize": 4, "desiredSize": 9}


def _through(recorder: MotoRecorder, service: str, **config: Any) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(service, region_name="eu-central-1", endpoint_url=recorder.url,
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(retries={"total_max_attempts": 1}, **config))


def test_the_recorder_names_each_call_the_product_sends(group: dict[str, Any], eks_api: MotoRecorder) -> None:
    eks_api.clear()
    eks, autoscaling = _through(eks_api, "eks"), _through(eks_api, "autoscaling")
    eks.update_nodegroup_config(clusterName=group["cluster"], nodegroupName="gpu",
                                scalingConfig={"minSize": 1, "maxSize": 4, "desiredSize": 3})
    victim = sorted(i["InstanceId"] for i in _asg(group)["Instances"])[0]
    autoscaling.terminate_instance_in_auto_scaling_group(InstanceId=victim, ShouldDecrementDesiredCapacity=True)
    calls = [(r["service"], r["action"], r["params"]) for r in eks_api.requests()]
    assert calls == [
        ("eks", f"POST /clusters/{group['cluster']}/node-groups/gpu/update-config",
         {"scalingConfig": {"minSize": 1, "maxSize": 4, "desiredSize": 3}, "clientRequestToken": calls[0][2].get(
             "clientRequestToken")}),
        ("autoscaling", "TerminateInstanceInAutoScalingGroup",
         {"InstanceId": victim, "ShouldDecrementDesiredCapacity": "true"})]


def test_a_caller_gone_before_the_terminate_answer_still_removed_exactly_one(
        group: dict[str, Any], groups: EksNodeGroups, eks_api: MotoRecorder) -> None:
    from botocore.exceptions import ReadTimeoutError

    ids = sorted(i["InstanceId"] for i in _asg(group)["Instances"])
    eks_api.clear()
    eks_api.faults["slow_remove_seconds"] = 1.5
    impatient = _through(eks_api, "autoscaling", read_timeout=0.3)
    with pytest.raises(ReadTimeoutError):
        impatient.terminate_instance_in_auto_scaling_group(InstanceId=ids[0], ShouldDecrementDesiredCapacity=True)
    assert {i["InstanceId"] for i in _asg(group)["Instances"]} == set(ids[1:])
    wait_for(lambda: _scaling(group)["desiredSize"] == 1, timeout=20, what="the node group's desiredSize at 1")
    assert [r for r in groups.removed if r["instance"] in ids] == [{"nodegroup": "gpu", "instance": ids[0]}]
    assert [r["action"] for r in eks_api.requests()] == ["TerminateInstanceInAutoScalingGroup"]
