"""Built-in GPU instance catalogues with list prices (USD/hour, on-demand, as published late 2026).

Availability comes from the cloud (DescribeInstanceTypeOfferings); prices from here unless the location
configures ``offerings`` of its own (negotiated rates, a rate card for onprem pools)."""

from __future__ import annotations

from models.locations import OfferingSpec

AWS_GPU_INSTANCES: tuple[OfferingSpec, ...] = (
    OfferingSpec(instance_type="g6.xlarge", gpus=1, gpu_product="NVIDIA-L4", usd_per_hour=0.805),
    OfferingSpec(instance_type="g5.xlarge", gpus=1, gpu_product="NVIDIA-A10G", usd_per_hour=1.006),
    OfferingSpec(instance_type="g6e.xlarge", gpus=1, gpu_product="NVIDIA-L40S", usd_per_hour=1.861),
    OfferingSpec(instance_type="g5.12xlarge", gpus=4, gpu_product="NVIDIA-A10G", usd_per_hour=5.672),
    OfferingSpec(instance_type="g6.12xlarge", gpus=4, gpu_product="NVIDIA-L4", usd_per_hour=4.602),
    OfferingSpec(instance_type="p4d.24xlarge", gpus=8, gpu_product="NVIDIA-A100-SXM4-40GB", usd_per_hour=32.773),
    OfferingSpec(instance_type="p5.48xlarge", gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3", usd_per_hour=98.32),
)
