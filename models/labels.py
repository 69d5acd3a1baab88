"""Labels, tags, taints and resource names that burst nodes and instances carry."""

from __future__ import annotations

from typing import Final

from models.base import Model

BURST_TAINT_EFFECT: Final = "NoSchedule"

LABEL_LOCATION: Final = "gpu.kubeon.io/location"

LABEL_POLICY: Final = "gpu.kubeon.io/policy"

LABEL_OPERATION: Final = "gpu.kubeon.io/operation"

LABEL_GPU_PRODUCT: Final = "nvidia.com/gpu.product"

LABEL_INSTANCE_TYPE: Final = "node.kubernetes.io/instance-type"

TAG_BURST: Final = "kubeon.io/burst"

TAG_OPERATION: Final = "kubeon.io/operation"

GPU_RESOURCE: Final = "nvidia.com/gpu"


class Taint(Model):
    key: str
    value: str = "true"
    effect: str = BURST_TAINT_EFFECT



JOIN_REFUSED_ANNOTATION = "gpu.kubeon.io/join-refused"

# The gateway's refusal of a node (more GPUs than its offering, re-registered after removal): NoExecute, so nothing
# runs there, applied again from the gateway's slot record on every pass (the node cannot lift it for good).
JOIN_REFUSED_TAINT = Taint(key="gpu.kubeon.io/join-refused", value="true", effect="NoExecute")

# Nodes register with this taint too; the gateway lifts it once it has checked the registered Node against its
# ticket (labels, taints, capacity), so no pod lands before. A node cannot lift a taint itself (NodeRestriction).
JOINING_TAINT = Taint(key="gpu.kubeon.io/joining", value="true", effect="NoSchedule")

# issue 27, the burn-in gate: a node launched with this label (its ticket's) keeps its joining taint until the
# optimizer has annotated it burned in (the annotation's value says what passed); one that fails is terminated.
# Its value names the checks, dot-separated ("Gpus.Tunnel.GpuHealth"): the node program runs the GPU health check
# only when asked (a DCGM diagnostic takes a minute of the GPUs' time).
BURN_IN_LABEL: Final = "gpu.kubeon.io/burn-in"
BURNED_IN_ANNOTATION: Final = "gpu.kubeon.io/burned-in"
# The GPU health check's result, a condition the node posts on its own Node (node/health.py).
GPU_HEALTH_CONDITION: Final = "gpu.kubeon.io/GpuHealthy"


def burn_in_label(checks: list[str]) -> str:
    return ".".join(checks)


def burn_in_checks(labels: dict[str, str]) -> list[str]:
    """The checks a node's burn-in label names (none: no burn-in; "required", as nodes launched before the label
    named its checks were labelled, names none the node itself runs)."""
    value = labels.get(BURN_IN_LABEL, "")
    return [c for c in value.split(".") if c and c != "required"]
