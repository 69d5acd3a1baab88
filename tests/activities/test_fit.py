"""GPU type fit: peak framebuffer plus headroom against each candidate's reported memory, p95 activity against the
ceiling, cheapest first, with the saving per month."""

from __future__ import annotations

import pytest

from models.policy import FitRule
from models.policy import GpuOffering
from planning.fit import recommend
from planning.idle import PodMemory

A100 = GpuOffering(name="a100-80gb", memory_mib=81920, usd_per_hour=4.10)
RULE = FitRule(current=A100, candidates=[
    GpuOffering(name="l40s", memory_mib=46068, usd_per_hour=1.90, relative_compute=0.6),
    GpuOffering(name="l4", memory_mib=23034, usd_per_hour=0.80, relative_compute=0.3),
    GpuOffering(name="a100-80gb-mig-1g.10gb", memory_mib=9728, usd_per_hour=0.55, relative_compute=0.14, mig=True),
    GpuOffering(name="a100-80gb-mig-2g.20gb", memory_mib=19968, usd_per_hour=1.15, relative_compute=0.28, mig=True),
])


def pod(peak_gib: float, p95: float = 0.02, coverage: float = 1.0) -> PodMemory:
    return PodMemory(namespace="ml", pod="p", peak_used_mib=peak_gib * 1024, total_mib=81920, p95_activity=p95,
                     coverage=coverage)


def test_nine_gib_on_an_eighty_gib_gpu_gets_a_cheaper_type_with_its_saving() -> None:
    rec = recommend("ml/Deployment/llm", [pod(9)], 2, RULE)
    # 9 GiB + 20% = 10.8 GiB: too big for the 1g.10gb slice; the L4 (24 GB) is the cheapest that fits.
    assert rec.recommended == "l4" and not rec.mig
    assert rec.saving_usd_per_month == pytest.approx((4.10 - 0.80) * 730 * 2)
    assert "$4.1 -> $0.8 per GPU-hour" in rec.reason and "/month for 2 GPU(s)" in rec.reason
    assert rec.status()["savingUsdPerMonth"] == round((4.10 - 0.80) * 730 * 2, 2)


def test_seventy_gib_gets_no_recommendation() -> None:
    rec = recommend("ml/Deployment/big", [pod(70)], 1, RULE)
    assert rec.recommended == "" and rec.saving_usd_per_month == 0
    assert "no cheaper GPU type fits 84.0 GiB" in rec.reason


def test_a_mig_slice_when_it_is_the_cheapest_fit() -> None:
    rec = recommend("ml/Deployment/tiny", [pod(6, p95=0.05)], 1, RULE)
    assert rec.recommended == "a100-80gb-mig-1g.10gb" and rec.mig
    assert "MIG slice" in rec.reason


def test_a_busy_workload_is_not_moved_to_a_slower_gpu() -> None:
    rec = recommend("ml/Deployment/hot", [pod(9, p95=0.5)], 1, RULE)
    assert rec.recommended == ""
    assert "l4 would run at 167%" in rec.reason


def test_too_little_history_gets_no_recommendation() -> None:
    rec = recommend("ml/Deployment/new", [pod(9, coverage=0.3)], 1, RULE)
    assert rec.recommended == "" and "not enough history" in rec.reason


def test_the_largest_pod_decides() -> None:
    assert recommend("ml/Deployment/mixed", [pod(9), pod(30)], 2, RULE).recommended == "l40s"


# --- the NodePool requirement that would serve a recommendation (GPU type fit never sets it) ---------------------

L4 = GpuOffering(name="l4", memory_mib=23034, usd_per_hour=0.80, relative_compute=0.3, product="NVIDIA-L4")
PRODUCT_RULE = FitRule(current=A100, candidates=[
    L4, GpuOffering(name="l40s", memory_mib=46068, usd_per_hour=1.90, relative_compute=0.6),
    GpuOffering(name="a100-80gb-mig-1g.10gb", memory_mib=9728, usd_per_hour=0.55, relative_compute=0.14, mig=True),
])


def test_a_recommended_product_carries_its_requirement_per_nodepool() -> None:
    rec = recommend("ml/Deployment/llm", [pod(9)], 3, PRODUCT_RULE, node_pools=["gpu-b", "gpu-a", "gpu-b"])
    assert rec.recommended == "l4" and rec.product == "NVIDIA-L4"
    assert rec.status()["product"] == "NVIDIA-L4"
    assert rec.status()["nodePoolRequirements"] == [
        {"nodePool": "gpu-a", "key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]},
        {"nodePool": "gpu-b", "key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]
    assert "nvidia.com/gpu.product In [NVIDIA-L4] on NodePools gpu-a, gpu-b;" in rec.reason
    assert "set gpuProducts: [NVIDIA-L4] in an Autoscaling policy for those NodePools, an approved operation" \
        in rec.reason
    assert "drifts (replaces) the pool's nodes of other products" in rec.reason
    assert "in no NodePool" not in rec.reason


def test_pods_on_nodes_outside_any_nodepool_are_counted_in_the_reason() -> None:
    rec = recommend("ml/Deployment/llm", [pod(9)], 2, PRODUCT_RULE, node_pools=["gpu-a", ""])
    assert [r.node_pool for r in rec.node_pool_requirements] == ["gpu-a"]
    assert "on NodePool gpu-a (1 of its GPU pods' nodes are in no NodePool);" in rec.reason
    assert "an Autoscaling policy for that NodePool" in rec.reason


@pytest.mark.parametrize(("rule", "peak_gib", "pools", "says"), [
    (RULE, 9, ["gpu-a"], "no NodePool requirement: candidate l4 names no product"),
    (PRODUCT_RULE, 6, ["gpu-a"], "no NodePool requirement: a MIG slice is made by sharing a GPU (kind Sharing)"),
    (PRODUCT_RULE, 9, ["", ""], "no NodePool requirement: its GPU pods' nodes are in no Karpenter NodePool"),
    (PRODUCT_RULE, 9, [], "no NodePool requirement: its GPU pods' nodes are in no Karpenter NodePool"),
], ids=["no-product", "mig", "no-nodepool", "unscheduled"])
def test_no_requirement_and_the_reason_says_why(rule: FitRule, peak_gib: float, pools: list[str], says: str) -> None:
    rec = recommend("ml/Deployment/llm", [pod(peak_gib)], 1, rule, node_pools=pools)
    assert rec.recommended  # a recommendation, only without a requirement
    assert rec.node_pool_requirements == () and rec.status()["nodePoolRequirements"] == []
    assert says in rec.reason


def test_no_recommendation_no_requirement() -> None:
    rec = recommend("ml/Deployment/big", [pod(70)], 1, PRODUCT_RULE, node_pools=["gpu-a"])
    assert rec.recommended == "" and rec.product == "" and rec.node_pool_requirements == ()
    assert "NodePool" not in rec.reason
