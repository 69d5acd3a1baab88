"""Planning: only the policy's locations, priced per GPU-hour with transfer, cheapest eligible first."""

from __future__ import annotations

from activities.planning import rank_offerings
from models.locations import LocationConfig, TransferEstimate, transfer_usd_per_gpu_hour
from models.operation import Offering, PendingPod, PlanRequest, WorkloadGroup


def _offer(location: str, itype: str, price: float, gpus: int = 1, product: str = "NVIDIA-L4",
           transfer: float = 0.02) -> Offering:
    return Offering(location=location, instance_type=itype, gpus=gpus, gpu_product=product,
                    instance_usd_per_hour=price, transfer_usd_per_gpu_hour=transfer)


def _request(locations: list[str], max_gpu_hour: float = 4.5, gpus: int = 1,
             selector: dict[str, str] | None = None) -> PlanRequest:
    group = WorkloadGroup(namespace="ml", owner_kind="Deployment", owner_name="infer", pods=[
        PendingPod(namespace="ml", name="infer-1", gpus=gpus, node_selector=selector or {})])
    return PlanRequest(policy="p", locations=locations, max_gpu_hour=max_gpu_hour, group=group)


def test_cheapest_eligible_first_and_outside_locations_refused() -> None:
    plan = rank_offerings(_request(["aws/eu-central-1", "gcp/europe-west4"]), [
        _offer("aws/eu-central-1", "g6.xlarge", 0.805),
        _offer("gcp/europe-west4", "g2-standard-4", 0.70, transfer=0.09),
        _offer("aws/ap-south-1", "g6.xlarge", 0.30),  # cheaper, but not in the policy
    ])
    assert [(o.location, o.usd_per_gpu_hour) for o in plan.candidates] == [
        ("gcp/europe-west4", 0.79), ("aws/eu-central-1", 0.825)]
    assert any("ap-south-1" in r and "not in policy" in r for r in plan.refused)


def test_price_limit_includes_transfer() -> None:
    plan = rank_offerings(_request(["aws/eu-central-1"], max_gpu_hour=1.0), [
        _offer("aws/eu-central-1", "g5.xlarge", 0.99, transfer=0.02)])  # 1.01 with transfer: over the limit
    assert plan.best is None
    assert "over maxGpuHour" in plan.refused[0]
    assert plan.summary().startswith("no eligible location")


def test_gpu_type_and_size_must_fit_the_pods() -> None:
    plan = rank_offerings(_request(["aws/x"], gpus=4, selector={"nvidia.com/gpu.product": "NVIDIA-A10G"}), [
        _offer("aws/x", "g6.12xlarge", 4.6, gpus=4, product="NVIDIA-L4"),
        _offer("aws/x", "g5.xlarge", 1.0, gpus=1, product="NVIDIA-A10G"),
        _offer("aws/x", "g5.12xlarge", 5.672, gpus=4, product="NVIDIA-A10G"),
    ])
    assert [o.instance_type for o in plan.candidates] == ["g5.12xlarge"]
    assert len(plan.refused) == 2


def test_same_offerings_give_the_same_plan_id() -> None:
    offers = [_offer("aws/x", "g6.xlarge", 0.8)]
    assert rank_offerings(_request(["aws/x"]), offers).plan_id == rank_offerings(_request(["aws/x"]), offers).plan_id
    cheaper = [_offer("aws/x", "g6.xlarge", 0.7)]
    assert rank_offerings(_request(["aws/x"]), offers).plan_id != rank_offerings(_request(["aws/x"]), cheaper).plan_id


def test_transfer_estimate_by_provider() -> None:
    home = "aws/us-east-1"
    assert transfer_usd_per_gpu_hour(home, LocationConfig(name="aws/eu-central-1")) == 0.02
    gcp = {"name": "gcp/europe-west4", "credentials": {"gcpServiceAccount": "burst@acme-ml.iam.gserviceaccount.com"}}
    assert transfer_usd_per_gpu_hour(home, LocationConfig.model_validate(gcp)) == 0.09
    assert transfer_usd_per_gpu_hour(home, LocationConfig(name="onprem/dc1")) == 0.0
    custom = LocationConfig.model_validate({**gcp, "transfer": TransferEstimate(egress_gb_per_gpu_hour=3,
                                                                                usd_per_gb=0.05)})
    assert transfer_usd_per_gpu_hour(home, custom) == 0.15
