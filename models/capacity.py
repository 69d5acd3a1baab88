"""Home GPU capacity (``capacity.provider``): the node groups GPU capacity is added to and removed from at home
(Karpenter NodePools today; managed node groups behind the same interface later), as they cross activity
boundaries."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from typing import Final

from pydantic import Field

from models.base import Model
from models.eks import GroupScaling
from models.provisioning import NodeRequirement

# Karpenter's keys (karpenter.sh/v1; sigs.k8s.io/karpenter pkg/apis/v1/labels.go).
NODEPOOL_LABEL: Final = "karpenter.sh/nodepool"
DO_NOT_DISRUPT: Final = "karpenter.sh/do-not-disrupt"
# Set on a NodePool while an operation of ours holds its disruption frozen (value: the operation).
FROZEN_BY_ANNOTATION: Final = "gpu.kubeon.io/disruption-frozen-by"
# The budget entry we add to freeze a pool (and the only one we ever remove).
FREEZE_BUDGET: Final = {"nodes": "0"}


class GroupNode(Model):
    """One node of a home group."""

    name: str
    # The Karpenter NodeClaim behind it ("" when the node has none, e.g. a managed group's node).
    nodeclaim: str = ""
    instance_type: str = ""
    capacity_type: str = ""
    gpu_product: str = ""
    gpus: int = 0
    # GPUs requested by the pods bound to it (not Succeeded/Failed).
    gpus_used: int = 0
    usd_per_hour: float | None = None
    ready: bool = False
    cordoned: bool = False
    # -- managed node groups (eks-nodegroups) --
    # The cloud instance behind the node (from its providerID), e.g. i-0abc...; "" for Karpenter's nodes.
    instance: str = ""


class LaunchingClaim(Model):
    """A NodeClaim of the group whose node is not initialized yet (Karpenter is launching it)."""

    name: str
    created_at: datetime | None = None
    registered: bool = False
    # Launched=False with its reason and message (e.g. InsufficientCapacity): the launch failed.
    failed: str = ""


class InstanceTypePrice(Model):
    """An instance type a group may launch: its GPUs and the highest $/h the product knows for it (the catalogue's
    on-demand list price, or a higher price one of the group's nodes of that type carries)."""

    instance_type: str
    gpus: int
    usd_per_hour: float

    @property
    def usd_per_gpu_hour(self) -> float:
        return self.usd_per_hour / self.gpus


class HomeNodeGroup(Model):
    """A group of home GPU nodes (a Karpenter NodePool with GPU requirements)."""

    provider: str
    name: str
    # GPU products the group's requirements allow (empty: any product).
    gpu_products: list[str] = Field(default_factory=list)
    # limits["nvidia.com/gpu"]; None when the group has no GPU limit.
    gpu_limit: int | None = None
    # GPUs of the group's nodes now (NodePool status.resources).
    gpus: int = 0
    # Static NodePool (spec.replicas): nodes are removed by decrementing replicas.
    replicas: int | None = None
    budgets: list[dict[str, Any]] = Field(default_factory=list)
    # The operation holding the group's disruption frozen, if any.
    frozen_by: str | None = None
    nodes: list[GroupNode] = Field(default_factory=list)
    # What a node of the group would be: the template's requirements and the keys of its NoSchedule/NoExecute
    # taints (a pod must tolerate them all).
    requirements: list[NodeRequirement] = Field(default_factory=list)
    taints: list[str] = Field(default_factory=list)
    launching: list[LaunchingClaim] = Field(default_factory=list)
    # The instance types the group may launch, priced (Karpenter: the types its node.kubernetes.io/instance-type
    # "In" requirement names, less "NotIn"); None when the group does not name them (any type of the cloud that
    # fits: the product cannot price what it cannot list).
    launchable: list[InstanceTypePrice] | None = None
    # Types the group may launch that the product has no price (or GPU count) for.
    unpriced: list[str] = Field(default_factory=list)
    # -- managed node groups (eks-nodegroups) --
    # The group's scaling config (min <= desired <= max) and what backs it; None for Karpenter NodePools.
    scaling: GroupScaling | None = None
    # GPUs of one node of the group (its instance type's); 0 when unknown. A managed group's nodes are all alike.
    gpus_per_node: int = 0

    @property
    def at_gpu_limit(self) -> bool:
        return self.gpu_limit is not None and self.gpus >= self.gpu_limit

    @property
    def usd_per_hour(self) -> float:
        return round(sum(n.usd_per_hour or 0.0 for n in self.nodes), 4)
