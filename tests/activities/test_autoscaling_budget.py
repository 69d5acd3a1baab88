"""planning.autoscaling: the GPU limits an Autoscaling policy's budgets (maxGpus, maxUsdPerHour) leave each of its
NodePools, and the pools whose worst case cannot be priced."""

from __future__ import annotations

import pytest

from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.capacity import InstanceTypePrice
from planning.autoscaling import plan_limits
from planning.autoscaling import worst_usd_per_gpu_hour

L4_1 = InstanceTypePrice(instance_type="g6.xlarge", gpus=1, usd_per_hour=0.805)
L4_4 = InstanceTypePrice(instance_type="g6.12xlarge", gpus=4, usd_per_hour=4.602)  # 1.1505 $/GPU-h
A100_8 = InstanceTypePrice(instance_type="a2-highgpu-8g", gpus=8, usd_per_hour=30.848)  # 3.856 $/GPU-h


def _group(name: str, launchable: list[InstanceTypePrice] | None, unpriced: tuple[str, ...] = (),
           **kw: object) -> HomeNodeGroup:
    return HomeNodeGroup(provider="karpenter", name=name, launchable=launchable, unpriced=list(unpriced), **kw)


def test_the_worst_case_is_the_most_expensive_gpu_hour_of_the_launchable_types() -> None:
    assert worst_usd_per_gpu_hour(_group("a", [L4_1, L4_4])) == (1.1505, "")
    assert worst_usd_per_gpu_hour(_group("a", [])) == (0.0, "")  # launches nothing: costs nothing more
    none, why = worst_usd_per_gpu_hour(_group("a", None))
    assert none is None and "NodePool a names no instance types" in why
    none, why = worst_usd_per_gpu_hour(_group("a", [L4_4], ("g6.48xlarge", "x9")))
    assert none is None and why == "NodePool a may launch instance types without a price: g6.48xlarge, x9"


def test_a_running_node_of_a_type_the_pool_no_longer_launches_counts_at_its_own_price() -> None:
    # Its GPUs count in the limit: a p4d (4.097 $/GPU-h) left from before the requirement named L4 types only.
    old = GroupNode(name="n1", instance_type="p4d.24xlarge", gpus=8, usd_per_hour=32.773)
    assert worst_usd_per_gpu_hour(_group("a", [L4_4], nodes=[old])) == (32.773 / 8, "")
    # A node of a launchable type is valued with its type (the provider folds its price label in).
    same = GroupNode(name="n2", instance_type="g6.12xlarge", gpus=4, usd_per_hour=None)
    assert worst_usd_per_gpu_hour(_group("a", [L4_4], nodes=[same])) == (1.1505, "")
    unknown = GroupNode(name="n3", instance_type="x9.large", gpus=2, usd_per_hour=None)
    none, why = worst_usd_per_gpu_hour(_group("a", [L4_4], nodes=[unknown]))
    assert none is None and why == "NodePool a runs GPU nodes without a price: x9.large"
    # No GPU on it (a CPU node of the pool): not counted.
    cpu = GroupNode(name="n4", instance_type="m5.large", gpus=0, usd_per_hour=None)
    assert worst_usd_per_gpu_hour(_group("a", [L4_4], nodes=[cpu])) == (1.1505, "")


def test_one_pool_gets_the_largest_gpu_count_within_the_budget_and_max_gpus_wins_when_smaller() -> None:
    groups: dict[str, HomeNodeGroup | str] = {"a": _group("a", [L4_1, L4_4])}
    # $10/h at 1.1505 $/GPU-h: 8 GPUs cost 9.204, 9 would cost 10.35.
    plan = plan_limits(["a"], groups, max_gpus=None, max_usd_per_hour=10.0)
    assert plan.held and plan.pool("a").limit == 8 and plan.pool("a").budget_gpus == 8
    assert plan.worst_usd_per_hour == 9.204 and plan.reason == ""
    assert plan_limits(["a"], groups, max_gpus=4, max_usd_per_hour=10.0).pool("a").limit == 4
    assert plan_limits(["a"], groups, max_gpus=12, max_usd_per_hour=10.0).pool("a").limit == 8
    # Exactly the cost of 8 GPUs (float error aside) leaves 8; a cent less leaves 7.
    assert plan_limits(["a"], groups, max_gpus=None, max_usd_per_hour=8 * 1.1505).pool("a").limit == 8
    assert plan_limits(["a"], groups, max_gpus=None, max_usd_per_hour=9.19).pool("a").limit == 7
    # Less than one GPU-hour: 0 (no new GPU node).
    assert plan_limits(["a"], groups, max_gpus=None, max_usd_per_hour=1.0).pool("a").limit == 0


def test_without_a_dollar_budget_max_gpus_alone_is_the_limit_even_for_an_unpriced_pool() -> None:
    plan = plan_limits(["a"], {"a": _group("a", None)}, max_gpus=6, max_usd_per_hour=None)
    assert plan.pool("a").limit == 6 and not plan.held and plan.reason == ""


def test_the_budget_is_shared_between_pools_and_a_pool_capped_by_max_gpus_leaves_the_rest() -> None:
    groups: dict[str, HomeNodeGroup | str] = {"l4": _group("l4", [L4_4]), "a100": _group("a100", [A100_8])}
    # $40/h, no maxGpus: $20 each: 17 L4 GPUs (19.56), 5 A100 GPUs (19.28).
    plan = plan_limits(["l4", "a100"], groups, max_gpus=None, max_usd_per_hour=40.0)
    assert (plan.pool("l4").limit, plan.pool("a100").limit) == (17, 5)
    assert plan.worst_usd_per_hour is not None and plan.worst_usd_per_hour <= 40.0
    # maxGpus 8: the L4 pool's 8 cost 9.204 < its $20 part; the A100 pool gets the other 30.796 -> 7 GPUs
    # (26.99), within maxGpus.
    plan = plan_limits(["l4", "a100"], groups, max_gpus=8, max_usd_per_hour=40.0)
    assert (plan.pool("l4").limit, plan.pool("a100").limit) == (8, 7)
    assert plan.worst_usd_per_hour == round(8 * 1.1505 + 7 * 3.856, 4)


@pytest.mark.parametrize(("groups", "named"), [
    ({"a": None}, "NodePool a names no instance types (node.kubernetes.io/instance-type In)"),
    ({"a": ("g6.48xlarge",)}, "NodePool a may launch instance types without a price: g6.48xlarge"),
], ids=["no-instance-types", "unpriced"])
def test_a_pool_that_cannot_be_priced_leaves_the_dollar_budget_unheld_and_max_gpus_applied(
        groups: dict[str, tuple[str, ...] | None], named: str) -> None:
    unknown = groups["a"]
    read: dict[str, HomeNodeGroup | str] = {
        "a": _group("a", None) if unknown is None else _group("a", [L4_4], unknown),
        "b": _group("b", [L4_4])}
    plan = plan_limits(["a", "b"], read, max_gpus=6, max_usd_per_hour=5.0)
    # Not held for any pool (the other's part of a total is unknown): maxGpus alone, not b's 4 of the budget.
    assert not plan.held and plan.worst_usd_per_hour is None
    assert (plan.pool("a").limit, plan.pool("b").limit) == (6, 6)
    assert plan.pool("a").budget_gpus is None and plan.pool("b").budget_gpus is None
    assert plan.reason.startswith("the budget of $5/h cannot be held: ") and named in plan.reason
    assert plan.reason.endswith("only maxGpus (6) is held")
    # Without maxGpus nothing is set.
    plan = plan_limits(["a", "b"], read, max_gpus=None, max_usd_per_hour=5.0)
    assert (plan.pool("a").limit, plan.pool("b").limit) == (None, None)
    assert plan.reason.endswith("no limit is set for it")


def test_a_pool_that_cannot_be_read_leaves_the_dollar_budget_unheld() -> None:
    plan = plan_limits(["a", "b"], {"a": "NodePool a not found", "b": _group("b", [L4_4])}, max_gpus=None,
                       max_usd_per_hour=50.0)
    assert not plan.held and "NodePool a cannot be read (NodePool a not found)" in plan.reason
    assert plan.pool("b").limit is None
