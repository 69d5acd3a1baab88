"""Choosing where to burst: only the policy's locations, priced per GPU-hour with transfer, cheapest first."""

from __future__ import annotations

import hashlib

from models.operation import LABEL_GPU_PRODUCT, LABEL_INSTANCE_TYPE, Offering, Plan, PlanRequest


def rank_offerings(request: PlanRequest, offerings: list[Offering]) -> Plan:
    """A plan from priced offerings. Refused offerings are listed with why, so the proposal explains itself."""
    need_total = request.group.gpus
    need_pod = max(request.group.max_pod_gpus, 1)
    selector = request.group.node_selector
    eligible: list[Offering] = []
    refused: list[str] = []
    allowed = set(request.locations)
    for o in offerings:
        what = f"{o.instance_type} in {o.location}"
        if o.location not in allowed:
            refused.append(f"{what}: location not in policy")
            continue
        if LABEL_GPU_PRODUCT in selector and selector[LABEL_GPU_PRODUCT] != o.gpu_product:
            refused.append(f"{what}: GPU {o.gpu_product}, pods need {selector[LABEL_GPU_PRODUCT]}")
            continue
        if LABEL_INSTANCE_TYPE in selector and selector[LABEL_INSTANCE_TYPE] != o.instance_type:
            refused.append(f"{what}: pods need instance type {selector[LABEL_INSTANCE_TYPE]}")
            continue
        if o.gpus < need_pod:
            refused.append(f"{what}: {o.gpus} GPU(s), a pod needs {need_pod}")
            continue
        if o.usd_per_gpu_hour > request.max_gpu_hour:
            refused.append(f"{what}: ${o.usd_per_gpu_hour:.2f}/GPU-h over maxGpuHour ${request.max_gpu_hour:.2f}")
            continue
        eligible.append(o)

    # Per GPU-hour first (the policy's unit); then the cheaper machine, so a 1-GPU workload does not take an
    # 8-GPU instance at the same unit price.
    eligible.sort(key=lambda o: (o.usd_per_gpu_hour, o.instance_usd_per_hour, o.location, o.instance_type))
    digest = hashlib.sha256(
        "|".join(f"{o.location}:{o.instance_type}:{o.usd_per_gpu_hour}" for o in eligible).encode()
        + request.group.key.encode()
    ).hexdigest()[:10]
    return Plan(plan_id=f"plan-{digest}", policy=request.policy, gpus_needed=need_total, candidates=eligible,
                refused=refused)
