"""activities.provisioning.scale_home_group, with the fake capacity provider that records every call: an absolute
target (a retry asks for the same size; a group someone grew past it is done), and a refusal or a cloud error
that names the group and its cause, non-retryable where retrying cannot help."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.capacity import CapacityError
from activities.capacity.fake import FakeCapacity
from activities.clients.audit_log import AuditLog
from activities.clients.gateway import HttpGatewayClient
from activities.clients.kube import KubeOps
from activities.context import BurstContext
from activities.provisioning import ProvisioningActivities
from models.capacity import HomeNodeGroup
from models.eks import GroupScaling
from models.locations import BurstConfig
from models.provisioning import HomeScaleRequest


def _activities(capacity: FakeCapacity, tmp_path: Path) -> ProvisioningActivities:
    # Neither the cluster nor the gateway is reached: scale_home_group asks only the capacity provider.
    return ProvisioningActivities(BurstContext(
        kube=KubeOps(client.ApiClient()), providers={}, gateway=HttpGatewayClient("https://127.0.0.1:9"),
        config=BurstConfig(), audit_log=AuditLog(tmp_path / "audit.jsonl"), capacity=capacity))


@pytest.fixture
def capacity() -> FakeCapacity:
    group = HomeNodeGroup(provider="eks-nodegroups", name="gpu", gpus_per_node=4,
                          scaling=GroupScaling(min_size=1, max_size=3, desired_size=1))
    return FakeCapacity(groups={"gpu": group, "karpenter": HomeNodeGroup(provider="karpenter", name="karpenter")})


def test_grows_to_the_target_once(capacity: FakeCapacity, tmp_path: Path) -> None:
    acts, env = _activities(capacity, tmp_path), ActivityEnvironment()
    assert env.run(acts.scale_home_group, HomeScaleRequest(group="gpu", to_size=2)).desired_size == 2
    assert env.run(acts.scale_home_group, HomeScaleRequest(group="gpu", to_size=2)).desired_size == 2  # a retry
    # Grown past the target meanwhile: the provider refuses to lower it, and the group read shows it done.
    assert env.run(acts.scale_home_group, HomeScaleRequest(group="gpu", to_size=1)).desired_size == 2
    assert capacity.calls == [("scale_up", "gpu=2"), ("scale_up", "gpu=2"), ("scale_up", "gpu=1"),
                              ("get_group", "gpu")]


def test_a_refusal_or_cloud_error_names_the_group_and_cause(capacity: FakeCapacity, tmp_path: Path) -> None:
    acts, env = _activities(capacity, tmp_path), ActivityEnvironment()
    with pytest.raises(ApplicationError, match=r"node group gpu: desired 4 is outside 1 \.\. 3") as refused:
        env.run(acts.scale_home_group, HomeScaleRequest(group="gpu", to_size=4))
    assert refused.value.non_retryable
    capacity.fail_next("scale_up", CapacityError("scaling node group gpu: ThrottlingException: Rate exceeded"))
    with pytest.raises(ApplicationError, match="ThrottlingException") as throttled:
        env.run(acts.scale_home_group, HomeScaleRequest(group="gpu", to_size=2))
    assert not throttled.value.non_retryable  # the activity's retry policy tries again
    with pytest.raises(ApplicationError, match="Karpenter sizes it itself") as karpenter:
        env.run(acts.scale_home_group, HomeScaleRequest(group="karpenter", to_size=2))
    assert karpenter.value.non_retryable
    with pytest.raises(ApplicationError, match="NodePool missing does not exist"):
        env.run(acts.scale_home_group, HomeScaleRequest(group="missing", to_size=2))
    assert capacity.groups["gpu"].scaling == GroupScaling(min_size=1, max_size=3, desired_size=1)  # nothing lost
