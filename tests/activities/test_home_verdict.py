"""planning.home: when burst defers to a home Karpenter NodePool and when it does not, and what the plan says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from models.capacity import HomeNodeGroup, LaunchingClaim
from models.provisioning import NodeRequirement, PendingPod
from planning.home import home_verdict

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
