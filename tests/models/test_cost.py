"""Cost on actuals (issue 27): compute hours x the instance's $/h plus measured egress bytes / 2^30 x the
location's $/GB, the same rate table the proposal's estimate uses; without a measurement the estimate stands."""

from __future__ import annotations

from datetime import UTC
from datetime import datetime
from datetime import timedelta

import pytest

from models.cost import BYTES_PER_GB
from models.cost import TransferReading
from models.cost import actual_cost
from models.locations import LocationConfig
from models.locations import transfer_usd_per_gb
from models.locations import transfer_usd_per_gpu_hour
from models.provisioning import Offering

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def offering(gpus: int = 2, instance: float = 3.0, transfer_gpu_h: float = 0.09) -> Offering:
    return Offering(location="gcp/europe-west4", instance_type="g2-standard-24", gpus=gpus, gpu_product="NVIDIA-L4",
                    instance_usd_per_hour=instance, transfer_usd_per_gpu_hour=transfer_gpu_h)


def test_measured_egress_is_priced_per_2_30_bytes_at_the_locations_rate() -> None:
    reading = TransferReading(rx_bytes=5 * BYTES_PER_GB, tx_bytes=123, measured_at=1.0, usd_per_gb=0.09)
    cost = actual_cost(offering(), T0, T0 + timedelta(hours=2), reading, final=True)
    assert cost.compute_hours == 2 and cost.compute_usd == 6.0
    assert cost.transfer_measured and cost.egress_bytes == 5 * BYTES_PER_GB and cost.ingress_bytes == 123
    assert cost.transfer_usd == pytest.approx(0.45)  # ingress (tx) is not billed
    assert cost.total_usd == pytest.approx(6.45)
    assert cost.usd_per_gpu_hour == pytest.approx(6.45 / 4, abs=1e-4)  # 2 h x 2 GPUs
    # The estimate for the same hours: compute + 0.09 $/GPU-h x 2 GPUs x 2 h.
    assert cost.estimated_usd == pytest.approx(6.36) and cost.estimated_usd_per_gpu_hour == 1.59
    assert "measured 5.000 GB egress" in cost.describe() and cost.final


@pytest.mark.parametrize("reading", [None, TransferReading(measured_at=0, rx_bytes=0, usd_per_gb=0.09),
                                     TransferReading(error="gateway down")])
def test_without_a_measurement_the_estimate_stands_labelled_estimated(reading: TransferReading | None) -> None:
    cost = actual_cost(offering(), T0, T0 + timedelta(minutes=30), reading)
    assert not cost.transfer_measured and cost.egress_bytes == 0
    assert cost.transfer_usd == pytest.approx(0.09 * 2 * 0.5) and cost.total_usd == cost.estimated_usd
    assert "estimated, not measured" in cost.describe() and not cost.final


def test_zero_hours_gives_the_offerings_rate_not_a_division_by_zero() -> None:
    cost = actual_cost(offering(), T0, T0, TransferReading(rx_bytes=1, measured_at=1.0, usd_per_gb=0.09))
    assert cost.compute_usd == 0 and cost.usd_per_gpu_hour == offering().usd_per_gpu_hour


def test_the_rate_is_the_one_the_estimate_uses() -> None:
    gcp = LocationConfig.model_validate({"name": "gcp/europe-west4", "credentials": {
        "gcpServiceAccount": "kubeon-burst@acme-ml1.iam.gserviceaccount.com"}})
    assert transfer_usd_per_gb("aws/us-east-1", gcp) == 0.09  # other cloud
    assert transfer_usd_per_gpu_hour("aws/us-east-1", gcp) == 0.09  # 1 GB/GPU-h by default
    aws = LocationConfig.model_validate({"name": "aws/eu-west-1", "transfer": {"egressGbPerGpuHour": 3}})
    assert transfer_usd_per_gb("aws/us-east-1", aws) == 0.02 and transfer_usd_per_gpu_hour("aws/us-east-1", aws) == 0.06
    own = LocationConfig.model_validate({"name": "sim/x", "transfer": {"usdPerGb": 0.05}})
    assert transfer_usd_per_gb("aws/us-east-1", own) == 0.05
    assert transfer_usd_per_gb("aws/us-east-1", LocationConfig(name="onprem/dc1")) == 0.0


def test_on_over_budget_defaults_to_report_and_refuses_anything_but_report_or_drain() -> None:
    from pydantic import ValidationError

    from models.policy import Limits

    assert Limits.model_validate({"maxNodes": 1, "maxGpuHour": 2.0}).on_over_budget == "Report"
    assert Limits.model_validate({"maxNodes": 1, "maxGpuHour": 2.0, "onOverBudget": "Drain"}).on_over_budget == "Drain"
    with pytest.raises(ValidationError, match="onOverBudget"):
        Limits.model_validate({"maxNodes": 1, "maxGpuHour": 2.0, "onOverBudget": "Terminate"})
