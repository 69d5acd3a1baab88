"""The serve's budget check on actuals (issue 27): a measured reading whose cost per GPU-hour so far exceeds
maxGpuHour is reported once (Report) or every time (Drain: it ends the serve); nothing without a measurement."""

from __future__ import annotations

import datetime as dt

from activities.serve import over_budget
from models.cost import BYTES_PER_GB
from models.cost import TransferReading
from models.node import ServeCheckRequest
from models.provisioning import Offering

OFFER = Offering(location="sim/x", instance_type="sim.l4.1", gpus=1, gpu_product="NVIDIA-L4",
                 instance_usd_per_hour=0.9, transfer_usd_per_gpu_hour=0.1)


def request(**kw: object) -> ServeCheckRequest:
    values: dict[str, object] = {"node_name": "n", "return_home": True, "offering": OFFER, "max_gpu_hour": 1.5,
                                 "launched_at": dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)}
    values.update(kw)
    return ServeCheckRequest.model_validate(values)


def test_a_reading_over_max_gpu_hour_is_reported_once_with_report_and_always_with_drain() -> None:
    # 20 GB x $0.05 = $1.00 over one hour on top of $0.90 compute: $1.90/GPU-h > $1.50.
    dear = TransferReading(rx_bytes=20 * BYTES_PER_GB, measured_at=1.0, usd_per_gb=0.05)
    said = over_budget(request(), dear)
    assert said.startswith("over budget on actuals: $1.9") and "maxGpuHour $1.5000" in said, said
    assert over_budget(request(over_budget_reported=True), dear) == ""
    assert "onOverBudget Drain" in over_budget(request(on_over_budget="Drain", over_budget_reported=True), dear)


def test_under_budget_unmeasured_or_without_a_budget_is_not_reported() -> None:
    cheap = TransferReading(rx_bytes=2 * BYTES_PER_GB, measured_at=1.0, usd_per_gb=0.05)  # $1.00/GPU-h
    assert over_budget(request(), cheap) == ""
    unmeasured = TransferReading(rx_bytes=0, measured_at=0, usd_per_gb=0.05)
    assert over_budget(request(max_gpu_hour=0.5), unmeasured) == "" and over_budget(request(), None) == ""
    dear = TransferReading(rx_bytes=20 * BYTES_PER_GB, measured_at=1.0, usd_per_gb=0.05)
    assert over_budget(request(max_gpu_hour=0), dear) == "" and over_budget(request(offering=None), dear) == ""
