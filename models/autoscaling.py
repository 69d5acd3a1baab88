"""issue 23: an Autoscaling policy's GPU products, held as a NodePool requirement (``nvidia.com/gpu.product In
[...]``). Changing a NodePool's requirements drifts its nodes (Karpenter replaces every node the new requirements
exclude, within the pool's disruption budgets), so the change is a durable operation made only with approval."""

from __future__ import annotations

import hashlib

from pydantic import Field

from models.base import Model
from models.base import OperationViewBase
from models.labels import LABEL_GPU_PRODUCT


class GpuProductsChange(Model):
    """A NodePool's GPU products requirement from ``current`` (empty: any product) to ``wanted``."""

    node_pool: str
    current: list[str] = Field(default_factory=list)
    wanted: list[str]
    # The pool's nodes whose product ``wanted`` excludes: Karpenter drifts (replaces) them once it is made.
    drifted: list[str] = Field(default_factory=list)

    @property
    def change_id(self) -> str:
        """The same change (pool, from, to) has one ID: it is proposed once, decided once."""
        text = f"{self.node_pool}|{','.join(sorted(self.current))}|{','.join(sorted(self.wanted))}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def summary(self) -> str:
        now = f"In [{', '.join(self.current)}]" if self.current else "any product"
        drift = (f"Karpenter drifts {len(self.drifted)} node(s) of other products ({', '.join(self.drifted[:5])}"
                 f"{', ...' if len(self.drifted) > 5 else ''}), replacing each within the pool's disruption budgets"
                 if self.drifted else "no node of the pool drifts (none is of another product)")
        return (f"NodePool {self.node_pool}: require {LABEL_GPU_PRODUCT} In [{', '.join(self.wanted)}] "
                f"(now {now}); {drift}")


class GpuProductsInput(Model):
    cluster: str
    policy: str
    change: GpuProductsChange
    approval_timeout_seconds: float = 86400.0


class GpuProductsView(OperationViewBase):
    phase: str
    change: GpuProductsChange | None = None


class GpuProductsRequest(Model):
    node_pool: str
    products: list[str]


def gpu_products_workflow_id(cluster: str, policy: str, change: GpuProductsChange) -> str:
    return f"gpu-products/{cluster}/{policy}/{change.node_pool}/{change.change_id}"
