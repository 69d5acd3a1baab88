"""planning.home: when burst defers to home capacity (a Karpenter NodePool, a managed node group) and when it does
not, what the plan says, and how much a managed group grows for the pods it can serve."""

from __future__ import annotations

from datetime import UTC
from datetime import datetime
from datetime import timedelta

from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.capacity import LaunchingClaim
from models.eks import GroupScaling
from models.provisioning import NodeRequirement
from models.provisioning import PendingPod
from planning.home import HomePlan
from planning.home import home_verdict
from planning.home import plan_home

NOW = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)


def _pod(*, gpus: int = 1, product: str = "NVIDIA-L4", waited: float = 5.0,
         tolerations: tuple[str, ...] = ("nvidia.com/gpu",)) -> PendingPod:
    return PendingPod(namespace="ml", name="infer-0", gpus=gpus, node_selector={"nvidia.com/gpu.product": product},
                      tolerations=list(tolerations), unschedulable_since=NOW - timedelta(seconds=waited))


def _group(*, gpus: int = 0, limit: int | None = 8, launching: list[LaunchingClaim] | None = None) -> HomeNodeGroup:
    return HomeNodeGroup(provider="karpenter", name="gpu", gpus=gpus, gpu_limit=limit, taints=["nvidia.com/gpu"],
                         requirements=[NodeRequirement(key="nvidia.com/gpu.product", operator="In",
                                                       values=["NVIDIA-L4"])],
                         launching=launching or [])


def _verdict(pod: PendingPod, *groups: HomeNodeGroup) -> tuple[bool, str]:
    v = home_verdict(pod, list(groups), NOW, grace_seconds=60, register_seconds=300)
    return v.at_home, v.why


def test_no_fitting_pool_product_or_taint_is_burst() -> None:
    assert _verdict(_pod(), ) == (False, "no home NodePool fits it")
    assert _verdict(_pod(product="NVIDIA-A100-SXM4-40GB"), _group()) == (False, "no home NodePool fits it")
    assert _verdict(_pod(tolerations=()), _group()) == (False, "no home NodePool fits it")
    assert _verdict(_pod(tolerations=("*",)), _group())[0]


def test_at_the_limit_is_burst_with_the_numbers() -> None:
    assert _verdict(_pod(), _group(gpus=8)) == (False, "home NodePool gpu at its limit (8 of 8 GPUs)")
    assert _verdict(_pod(gpus=2), _group(gpus=7)) == (False,
                                                      "home NodePool gpu at its limit (7 of 8 GPUs; it needs 2)")
    assert _verdict(_pod(gpus=2), _group(gpus=6))[0]
    assert _verdict(_pod(gpus=64), _group(gpus=0, limit=None))[0]  # no limit


def test_launching_claim_defers_failed_or_unregistered_does_not() -> None:
    fresh = LaunchingClaim(name="gpu-abc", created_at=NOW - timedelta(seconds=10))
    assert _verdict(_pod(waited=600), _group(gpus=8, launching=[fresh])) == (
        True, "home NodePool gpu is launching NodeClaim gpu-abc")
    failed = LaunchingClaim(name="gpu-x", created_at=NOW, failed="InsufficientCapacity: no capacity")
    assert _verdict(_pod(waited=600), _group(launching=[failed])) == (
        False, "home NodeClaim gpu-x failed to launch: InsufficientCapacity: no capacity")
    stuck = LaunchingClaim(name="gpu-y", created_at=NOW - timedelta(seconds=301))
    assert _verdict(_pod(waited=600), _group(launching=[stuck])) == (
        False, "home NodeClaim gpu-y unregistered after 300s")
    registered = stuck.model_copy(update={"registered": True})
    assert _verdict(_pod(waited=600), _group(launching=[registered]))[0]


def test_grace_then_burst_when_karpenter_launches_nothing() -> None:
    assert _verdict(_pod(waited=5), _group()) == (
        True, "waiting for Karpenter to launch a node in home NodePool gpu (5s of 60s)")
    assert _verdict(_pod(waited=61), _group()) == (
        False, "Karpenter launched no node for it within 60s (no instance type of home NodePool gpu fits it)")


# -- managed node groups (eks-nodegroups, gke-nodepools, aks-nodepools): planned as a batch ---------------------

def _pods(count: int, *, gpus: int = 1, waited: float = 5.0) -> list[PendingPod]:
    return [_pod(gpus=gpus, waited=waited).model_copy(update={"name": f"infer-{i}"}) for i in range(count)]


def _managed(*, desired: int = 1, registered: int = 1, max_size: int = 3, autoscaler: str = "",
             zone_sizes: dict[str, int] | None = None) -> HomeNodeGroup:
    nodes = [GroupNode(name=f"ip-10-0-0-{i}", gpus=4, usd_per_hour=5.67, ready=True) for i in range(registered)]
    return HomeNodeGroup(
        provider="eks-nodegroups", name="gpu", gpus=4 * registered, gpu_limit=4 * max_size, gpus_per_node=4,
        taints=["nvidia.com/gpu"], nodes=nodes,
        requirements=[NodeRequirement(key="nvidia.com/gpu.product", operator="In", values=["NVIDIA-L4"])],
        scaling=GroupScaling(min_size=0, max_size=max_size, desired_size=desired, autoscaler=autoscaler,
                             zone_sizes=zone_sizes or {}))


def _home(pods: list[PendingPod], *groups: HomeNodeGroup, scaled: dict[str, datetime] | None = None) -> HomePlan:
    return plan_home(pods, list(groups), NOW, grace_seconds=60, register_seconds=300, scaled=scaled or {})


def test_a_group_nothing_else_sizes_grows_by_the_fewest_nodes_its_pods_need() -> None:
    plan = _home(_pods(5), _managed())  # five 1-GPU pods onto 4-GPU nodes: two nodes
    assert [(h.group, h.from_size, h.to_size, len(h.pods)) for h in plan.scale] == [("gpu", 1, 3, 5)]
    assert not plan.burst
    assert set(plan.at_home.values()) == {"home node group gpu scaling from 1 to 3 nodes"}
    assert len(_home(_pods(4), _managed()).scale[0].pods) == 4 and _home(_pods(4), _managed()).scale[0].to_size == 2


def test_pods_past_the_maxsize_are_burst_with_the_numbers() -> None:
    plan = _home(_pods(5), _managed(max_size=2))
    assert [(h.to_size, len(h.pods)) for h in plan.scale] == [(2, 4)]
    assert list(plan.burst.values()) == ["home node group gpu at its maxSize (2 of 2 nodes)"]
    full = _home(_pods(1), _managed(desired=3, registered=3))
    assert not full.scale and list(full.burst.values()) == ["home node group gpu at its maxSize (3 of 3 nodes)"]


def test_nodes_launching_take_pods_first_until_they_fail_to_register() -> None:
    group = _managed(desired=2, registered=1)
    plan = _home(_pods(5), group, scaled={"gpu": NOW - timedelta(seconds=10)})
    assert sorted(plan.at_home.values()) == (["home node group gpu is launching 1 node(s) (1 of 2 registered)"] * 4
                                             + ["home node group gpu scaling from 2 to 3 nodes"])
    assert [(h.from_size, h.to_size, len(h.pods)) for h in plan.scale] == [(2, 3, 1)]
    stale = _home(_pods(2), group, scaled={"gpu": NOW - timedelta(seconds=301)})
    assert not stale.scale and not stale.at_home
    assert set(stale.burst.values()) == {"home node group gpu: 1 node(s) not registered 300s after it was scaled "
                                         "to 2"}
    # Launching for someone else (a user raised desired): held only while the pod is within grace + register.
    assert _home(_pods(1, waited=100), group).at_home
    assert _home(_pods(1, waited=400), group).scale[0].to_size == 3


def test_a_group_an_autoscaler_sizes_is_waited_for_never_resized() -> None:
    owner = "cluster-autoscaler kube-system/cluster-autoscaler"
    within = _home(_pods(2), _managed(autoscaler=owner))
    assert not within.scale and not within.burst
    assert set(within.at_home.values()) == {f"waiting for {owner} to grow home node group gpu (5s of 60s)"}
    past = _home(_pods(1, waited=61), _managed(autoscaler=owner))
    assert not past.scale and list(past.burst.values()) == [
        f"{owner} added no node to home node group gpu for it within 60s"]


def test_a_gke_pool_grows_in_steps_of_its_zones() -> None:
    pool = _managed(desired=2, registered=2, max_size=2000, zone_sizes={"europe-west4-a": 1, "europe-west4-b": 1})
    plan = _home(_pods(5), pool)  # one more node per zone takes 8 GPUs: all five pods
    assert [(h.from_size, h.to_size, len(h.pods)) for h in plan.scale] == [(2, 4, 5)]


def test_a_pod_larger_than_the_groups_nodes_is_burst_saying_so() -> None:
    plan = _home(_pods(1, gpus=8), _managed())
    assert not plan.scale and list(plan.burst.values()) == ["home node group gpu's nodes have 4 GPU(s); it needs 8"]
    assert list(_home(_pods(1), _managed().model_copy(update={"taints": ["other"]})).burst.values()) == [
        "no home node group fits it"]


def test_a_group_being_packed_is_not_grown() -> None:
    packed = _managed().model_copy(update={"frozen_by": "op-1a2b"})
    assert not _home(_pods(1), packed).scale
    assert list(_home(_pods(1), packed).at_home.values()) == [
        "home node group gpu is being packed by operation op-1a2b (5s of 60s)"]
    assert list(_home(_pods(1, waited=61), packed).burst.values()) == [
        "home node group gpu is being packed by operation op-1a2b"]
