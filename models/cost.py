"""A burst node's cost on actuals (issue 27): compute hours from launch to termination and the egress measured
at the gateway, priced at the same per-location rates the proposal's estimate used (``models.locations``).

Unit: the clouds bill egress per "GB" of 2^30 bytes (AWS's data transfer GB and Google's GiB are both
1,073,741,824 bytes), so measured bytes are divided by ``BYTES_PER_GB`` = 2^30 before the location's USD/GB.
Only ``rxBytes`` (node -> home, the traffic leaving the remote cloud) is priced; ``txBytes`` (home -> node) is
ingress to the node's cloud, free on every cloud we price, and only shown."""

from __future__ import annotations

from datetime import datetime
from typing import Final

from pydantic import Field

from models.base import Model
from models.provisioning import Offering

BYTES_PER_GB: Final = 2 ** 30


class TransferReading(Model):
    """The node's tunnel counters as the gateway reported them, with the rate its location's egress costs."""

    rx_bytes: int = Field(default=0, ge=0)  # node -> home: the node's cloud's egress
    tx_bytes: int = Field(default=0, ge=0)  # home -> node
    measured_at: float = 0.0  # epoch seconds; 0: never measured (no tunnel at this gateway)
    usd_per_gb: float = Field(default=0.0, ge=0)
    error: str = ""  # the last read failed (the reading above is the last good one, if any)

    @property
    def measured(self) -> bool:
        return self.measured_at > 0


class ActualCost(Model):
    """What the node cost (or costs so far), beside the estimate made at the proposal."""

    compute_hours: float
    compute_usd: float
    transfer_measured: bool  # False: no measurement, transfer_usd is the estimate (labelled so)
    egress_bytes: int = 0
    ingress_bytes: int = 0
    transfer_usd: float
    total_usd: float
    usd_per_gpu_hour: float  # effective: total / (hours x GPUs)
    estimated_usd: float  # the proposal's estimate for the same hours (compute + estimated transfer)
    estimated_usd_per_gpu_hour: float
    final: bool = False  # the node is terminated: the hours are complete

    def describe(self) -> str:
        how = (f"measured {self.egress_bytes / BYTES_PER_GB:.3f} GB egress" if self.transfer_measured
               else "estimated, not measured")
        return (f"actual ${self.total_usd:.4f} (compute {self.compute_hours:.3f} h ${self.compute_usd:.4f} + "
                f"transfer ${self.transfer_usd:.4f}, {how}) = ${self.usd_per_gpu_hour:.4f}/GPU-h; "
                f"estimate ${self.estimated_usd:.4f} = ${self.estimated_usd_per_gpu_hour:.4f}/GPU-h")


def actual_cost(offering: Offering, launched_at: datetime, until: datetime, reading: TransferReading | None,
                *, final: bool = False) -> ActualCost:
    """Compute = the instance's USD/h x the hours from launch to ``until``; transfer = egress bytes / 2^30 x the
    location's USD/GB when measured, else the estimate (``offering.transfer_usd_per_hour`` x hours)."""
    hours = max(0.0, (until - launched_at).total_seconds() / 3600)
    compute = offering.instance_usd_per_hour * hours
    estimated_transfer = offering.transfer_usd_per_hour * hours
    measured = reading is not None and reading.measured
    if measured:
        assert reading is not None
        transfer = reading.rx_bytes / BYTES_PER_GB * reading.usd_per_gb
    else:
        transfer = estimated_transfer
    total = compute + transfer
    gpu_hours = hours * offering.gpus
    return ActualCost(
        compute_hours=round(hours, 6), compute_usd=round(compute, 6), transfer_measured=measured,
        egress_bytes=reading.rx_bytes if reading and measured else 0,
        ingress_bytes=reading.tx_bytes if reading and measured else 0,
        transfer_usd=round(transfer, 6), total_usd=round(total, 6),
        usd_per_gpu_hour=round(total / gpu_hours, 4) if gpu_hours else offering.usd_per_gpu_hour,
        estimated_usd=round(compute + estimated_transfer, 6),
        estimated_usd_per_gpu_hour=offering.usd_per_gpu_hour, final=final)


class CostCount(Model):
    """A finished node's cost, counted once into ``kubeon_burst_cost_usd_total{location,kind}``."""

    operation: str
    location: str
    compute_usd: float = Field(ge=0)
    transfer_usd: float = Field(ge=0)
