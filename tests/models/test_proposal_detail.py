"""Proposals' report details (a burst batch, a ScaleToZero, a Sharing change): the plan as the hub reads it, within
the hub's limit."""

from __future__ import annotations

from hub.plans import parse_plan
from models.hub import REPORT_DETAIL_LIMIT
from models.hub import pack_proposal_detail
from models.hub import proposal_detail
from models.hub import scale_proposal_detail
from models.hub import sharing_proposal_detail
from models.provisioning import BatchPlan
from models.provisioning import Offering
from models.provisioning import PlannedNode


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


def test_a_sharing_proposal_names_its_node_change_saving_and_risk() -> None:
    detail = sharing_proposal_detail(plan_id="op-1-ts-r2", node="gpu-a100-0", gpus=4,
                                     change="time-slicing 2 replicas per GPU", summary="share gpu-a100-0 2 ways",
                                     reason="p95 use 5 % < 40 %", risk="noisy neighbours", saving_usd_per_hour=16.4)
    read = parse_plan(detail)
    assert read is not None and read.plan_id == "op-1-ts-r2" and read.nodes == []
    assert (read.node, read.gpus, read.change, read.saving_usd_per_hour) == (
        "gpu-a100-0", 4, "time-slicing 2 replicas per GPU", 16.4)
    assert (read.summary, read.reason, read.risk) == ("share gpu-a100-0 2 ways", "p95 use 5 % < 40 %",
                                                      "noisy neighbours")


def test_a_scale_proposal_names_its_workload_replicas_and_idle_evidence() -> None:
    read = parse_plan(scale_proposal_detail(plan_id="op-2-r3", summary="scale ml/Deployment/infer from 3 to 0",
                                            workload="ml/Deployment/infer", replicas=3, idle_evidence="0 % for 30m"))
    assert read is not None and (read.plan_id, read.workload, read.replicas, read.idle_evidence) == (
        "op-2-r3", "ml/Deployment/infer", 3, "0 % for 30m")


def test_long_texts_are_cut_to_what_the_hub_reads_and_the_plan_id_stays() -> None:
    # The hub reads at most 2,000 characters of each text (a longer one would hide the whole plan), and at most
    # REPORT_DETAIL_LIMIT of the detail.
    detail = sharing_proposal_detail(plan_id="op-3-mig", node="n", gpus=8, change="MIG geometry all-1g.10gb",
                                     summary="s" * 5000, reason="r" * 5000, risk="k" * 5000,
                                     saving_usd_per_hour=1.5)
    assert len(detail) <= REPORT_DETAIL_LIMIT
    read = parse_plan(detail)
    assert read is not None and read.plan_id == "op-3-mig" and read.saving_usd_per_hour == 1.5
    assert len(read.summary) == 2000 and len(read.risk) == 2000


def test_a_packing_proposal_names_the_nodes_removed_and_the_pods_moved_within_the_limit() -> None:
    moves = [f"ml/infer-{i}-{'x' * 40}: gpu-l4-{i % 50} -> gpu-l4-{50 + i % 50}" for i in range(400)]
    detail = pack_proposal_detail(plan_id="op-4", summary="empty 50 node(s)", remove=[f"gpu-l4-{i}" for i in range(50)],
                                  moves=moves, saving_usd_per_hour=230.0)
    assert len(detail) <= REPORT_DETAIL_LIMIT
    read = parse_plan(detail)
    assert read is not None and read.plan_id == "op-4" and len(read.remove) == 50 and read.saving_usd_per_hour == 230
    assert read.moves and read.moves == moves[:len(read.moves)]  # cut, in order
    small = parse_plan(pack_proposal_detail(plan_id="op-5", summary="s", remove=["a"], moves=["ml/p: a -> b"],
                                            saving_usd_per_hour=1.0))
    assert small is not None and small.moves == ["ml/p: a -> b"]
