"""``capacity.provider: eks-nodegroups``: what the worker needs to reach the cluster's managed node groups (the
chart's ``capacity.eks``), checked at start naming the field."""

from __future__ import annotations

import math
from typing import Final

from pydantic import Field

from models.base import Model

# The node group a managed node's Node carries (EKS), and the annotation cluster-autoscaler honours on a node.
NODEGROUP_LABEL: Final = "eks.amazonaws.com/nodegroup"
SCALE_DOWN_DISABLED: Final = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
# AWS commercial, GovCloud and China regions with EKS (late 2026); another name is refused at start (a typo would
# otherwise be a provider that never finds its cluster).
AWS_REGIONS: Final = frozenset({
    "af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3", "ap-south-1",
    "ap-south-2", "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5",
    "ap-southeast-6", "ap-southeast-7", "ca-central-1", "ca-west-1", "cn-north-1", "cn-northwest-1",
    "eu-central-1", "eu-central-2", "eu-north-1", "eu-south-1", "eu-south-2", "eu-west-1", "eu-west-2",
    "eu-west-3", "il-central-1", "me-central-1", "me-south-1", "mx-central-1", "sa-east-1", "us-east-1",
    "us-east-2", "us-gov-east-1", "us-gov-west-1", "us-west-1", "us-west-2",
})


class GroupScaling(Model):
    """A managed node group's scaling config as EKS reports it (``describe_nodegroup().scalingConfig``)."""

    min_size: int = Field(ge=0)
    max_size: int = Field(ge=0)
    desired_size: int = Field(ge=0)
    # The auto scaling group behind the node group (``resources.autoScalingGroups[0].name``).
    auto_scaling_group: str = ""
    status: str = ""
    # What owns the group's size when not the optimizer ("" when nothing does): cluster-autoscaler (EKS, its
    # Deployment), the node pool's own autoscaling (GKE, AKS). Such a group is never resized by us: burst waits
    # for it as for Karpenter.
    autoscaler: str = ""
    # GKE: the pool's nodes per zone. A resize sets one count for every zone, so the pool grows in steps of its
    # zones (models the size ``scale_up`` leaves, see ``landed``); empty for EKS and AKS.
    zone_sizes: dict[str, int] = Field(default_factory=dict)

    def landed(self, desired: int) -> int:
        """The group's size after a scale up asked for ``desired`` nodes: never below its size now, and on GKE the
        smallest per-zone count that reaches it, times the zones."""
        if not self.zone_sizes or self.desired_size >= desired:
            return max(desired, self.desired_size)
        per_zone = max(math.ceil(desired / len(self.zone_sizes)), *self.zone_sizes.values())
        return per_zone * len(self.zone_sizes)
