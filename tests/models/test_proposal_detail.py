"""A batch proposal's report detail: the plan as the hub reads it, within the hub's limit."""

from __future__ import annotations

from hub.plans import parse_plan
from models.hub import REPORT_DETAIL_LIMIT, proposal_detail
from models.provisioning import BatchPlan, Offering, PlannedNode


def _plan(nodes: int, pods_each: int) -> BatchPlan:
    offering = Offering(location="aws/eu-central-1", instance_type="g6.12xlarge", gpus=4, gpu_product="NVIDIA-L4",
                        instance_usd_per_hour=4.6, transfer_usd_per_gpu_hour=0.02)
    return BatchPlan(plan_id="plan-0123abcd", batch="op-0123456789ab", policy="inference-burst", new_nodes=[
        PlannedNode(offering=offering, pods=[f"ml/infer-{i}-{j}" for j in range(pods_each)]) for i in range(nodes)])


def test_a_small_plan_is_sent_whole() -> None:
    plan = _plan(2, 3)
    read = parse_plan(proposal_detail(plan, plan.batch))
    assert read is not None and read.plan_id == plan.plan_id and read.batch == plan.batch
    assert [n.pods for n in read.nodes] == [n.pods for n in plan.new_nodes]
    assert read.nodes[0].compute_usd_per_hour == 4.6 and read.nodes[0].transfer_usd_per_hour == 0.08
    assert read.total == plan.total_usd_per_hour


def test_a_large_plan_keeps_its_plan_id_within_the_limit() -> None:
    plan = _plan(200, 40)
    detail = proposal_detail(plan, plan.batch)
    assert len(detail) <= REPORT_DETAIL_LIMIT
    read = parse_plan(detail)
    assert read is not None and read.plan_id == plan.plan_id and read.total == plan.total_usd_per_hour
    assert "200 node(s)" in read.summary
