"""Built-in GPU instance catalogues with list prices (USD/hour, on-demand, as published late 2026).

Availability comes from the cloud (DescribeInstanceTypeOfferings); prices from here unless the location
configures ``offerings`` of its own (negotiated rates, a rate card for onprem pools)."""

from __future__ import annotations

from collections.abc import Mapping

from models.locations import LocationConfig
from models.locations import OfferingSpec

from .errors import ProviderError

AWS_GPU_INSTANCES: tuple[OfferingSpec, ...] = (
    OfferingSpec(instance_type="g6.xlarge", gpus=1, gpu_product="NVIDIA-L4", usd_per_hour=0.805),
    OfferingSpec(instance_type="g5.xlarge", gpus=1, gpu_product="NVIDIA-A10G", usd_per_hour=1.006),
    OfferingSpec(instance_type="g6e.xlarge", gpus=1, gpu_product="NVIDIA-L40S", usd_per_hour=1.861),
    OfferingSpec(instance_type="g5.12xlarge", gpus=4, gpu_product="NVIDIA-A10G", usd_per_hour=5.672),
    OfferingSpec(instance_type="g6.12xlarge", gpus=4, gpu_product="NVIDIA-L4", usd_per_hour=4.602),
    OfferingSpec(instance_type="p4d.24xlarge", gpus=8, gpu_product="NVIDIA-A100-SXM4-40GB", usd_per_hour=32.773),
    OfferingSpec(instance_type="p5.48xlarge", gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3", usd_per_hour=98.32),
)


def _specs(gpu_product: str, rows: tuple[tuple[str, int, float], ...], ratio: float = 1.0) -> tuple[OfferingSpec, ...]:
    # Scaled per GPU, so sizes priced linearly stay exactly linear (the planner ranks by USD per GPU-hour).
    return tuple(OfferingSpec(instance_type=name, gpus=gpus, gpu_product=gpu_product,
                              usd_per_hour=round(round(usd / gpus * ratio, 4) * gpus, 4)) for name, gpus, usd in rows)


# Google Compute Engine, Linux on-demand, VM + attached GPUs (USD/hour). Source: GCE "GPU pricing" and "VM instance
# pricing" pages as captured in SkyPilot's catalog v7 (skypilot-org/skypilot-catalog, commit 017e2502) and checked
# against the us-central1 list prices; europe-west4 is us-central1 times the ratio of the two regions' G2 rows
# (0.742 / 0.707), as that snapshot's europe-west4 A100/H100 rows are inconsistent. Curated 2026-12-01.
GCP_CATALOG_SOURCE = "cloud.google.com/compute/gpus-pricing via skypilot-catalog v7 (017e2502); curated 2026-12-01"
_GCP_US_CENTRAL1: tuple[tuple[str, tuple[tuple[str, int, float], ...]], ...] = (
    ("NVIDIA-L4", (("g2-standard-4", 1, 0.7068), ("g2-standard-8", 1, 0.8536), ("g2-standard-12", 1, 1.0004),
                   ("g2-standard-16", 1, 1.1472), ("g2-standard-24", 2, 2.0008), ("g2-standard-32", 1, 1.7344),
                   ("g2-standard-48", 4, 4.0016))),
    ("NVIDIA-A100-SXM4-40GB", (("a2-highgpu-1g", 1, 3.6734), ("a2-highgpu-2g", 2, 7.3468),
                               ("a2-highgpu-4g", 4, 14.6936), ("a2-highgpu-8g", 8, 29.3872))),
    ("NVIDIA-H100-80GB-HBM3", (("a3-highgpu-8g", 8, 88.2539),)),
)
GCP_GPU_INSTANCES: dict[str, tuple[OfferingSpec, ...]] = {
    region: tuple(spec for product, rows in _GCP_US_CENTRAL1 for spec in _specs(product, rows, ratio))
    for region, ratio in (("us-central1", 1.0), ("europe-west4", 1.0497))
}

# Azure Virtual Machines, Linux pay-as-you-go (USD/hour). Source: Azure Retail Prices API
# (prices.azure.com/api/retail/prices) as snapshotted by Karpenter-azure's zz_generated.pricing.go (generated
# 2023-12-18T14:34:50Z, westeurope) and SkyPilot's catalog v6 (eastus); westeurope sizes missing from the snapshot are
# eastus times the ratio of the series' westeurope / eastus rows. Only sizes with whole GPUs (NVadsA10_v5 below
# NV36ads shares one A10). Curated 2026-12-01.
AZURE_CATALOG_SOURCE = ("prices.azure.com retail prices via karpenter-azure (2023-12-18) and skypilot v6; "
                        "curated 2026-12-01")
_AZURE_EASTUS: tuple[tuple[str, float, tuple[tuple[str, int, float], ...]], ...] = (
    # (gpu product, westeurope / eastus, sizes)
    ("Tesla-T4", 0.658 / 0.526, (("Standard_NC4as_T4_v3", 1, 0.526), ("Standard_NC8as_T4_v3", 1, 0.752),
                                 ("Standard_NC16as_T4_v3", 1, 1.204), ("Standard_NC64as_T4_v3", 4, 4.352))),
    ("NVIDIA-A10", 4.160 / 3.20, (("Standard_NV36ads_A10_v5", 1, 3.20), ("Standard_NV72ads_A10_v5", 2, 6.52))),
    ("NVIDIA-A100-80GB-PCIe", 4.775 / 3.673, (("Standard_NC24ads_A100_v4", 1, 3.673),
                                              ("Standard_NC48ads_A100_v4", 2, 7.346),
                                              ("Standard_NC96ads_A100_v4", 4, 14.692))),
    ("NVIDIA-H100-80GB-HBM3", 127.816 / 98.32, (("Standard_ND96isr_H100_v5", 8, 98.32),)),
)
AZURE_GPU_INSTANCES: dict[str, tuple[OfferingSpec, ...]] = {
    "eastus": tuple(spec for product, _, rows in _AZURE_EASTUS for spec in _specs(product, rows)),
    "westeurope": tuple(spec for product, ratio, rows in _AZURE_EASTUS for spec in _specs(product, rows, ratio)),
}


def region_offerings(loc: LocationConfig, built_in: Mapping[str, tuple[OfferingSpec, ...]]) -> tuple[OfferingSpec, ...]:
    """The location's configured offerings, else the built-in prices of its region (a region without any is a
    configuration error: retrying cannot help)."""
    if loc.offerings:
        return tuple(loc.offerings)
    if loc.region not in built_in:
        raise ProviderError(f"{loc.name}: no built-in prices for {loc.region}; configure offerings", retryable=False)
    return built_in[loc.region]
