"""The capacity provider interface (``capacity.provider``): home GPU capacity added and removed through the
cluster's own autoscaler, narrow and with typed errors like the cloud providers (activities/providers/base.py).

Implementations are synchronous (they run in the activity thread pool) and idempotent: removing a node already
gone, shielding a node already shielded, freezing a group the same operation froze are no-ops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from typing import Protocol

from models.capacity import HomeNodeGroup
from models.eks import GroupScaling


class CapacityError(Exception):
    """A capacity call failed; the message names the group and the cause. ``retryable`` is False when retrying
    cannot help (the object is not ours to change, the request is refused as invalid)."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class GroupNotFoundError(CapacityError):
    """The node group does not exist (or is not a GPU group)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class NodeNotInGroupError(CapacityError):
    """The node exists but belongs to another group (or to none): never removed through this group."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class FrozenByOtherError(CapacityError):
    """Another operation holds the group's disruption frozen: one operation per group at a time."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class ConflictError(CapacityError):
    """The object changed while we changed it (optimistic concurrency); retried."""


class CapacityProvider(Protocol):
    name: str

    def list_groups(self) -> list[HomeNodeGroup]:
        """The home GPU node groups with their nodes, limits, usage and prices."""
        ...

    def get_group(self, group: str) -> HomeNodeGroup: ...

    def remove_node(self, group: str, node: str) -> None:
        """Remove exactly this node (it should be empty of our workloads first); gone already is a no-op."""
        ...

    def node_gone(self, group: str, node: str) -> bool:
        """Whether the node and whatever backs it (its NodeClaim) no longer exist."""
        ...

    def shield_node(self, node: str, shielded: bool) -> None:
        """Keep the autoscaler's own disruption off this node (or let it back) while an operation works on it."""
        ...

    def freeze(self, group: str, operation: str) -> None:
        """Stop the autoscaler's automated disruption of the group, leaving the user's settings as they were."""
        ...

    def unfreeze(self, group: str, operation: str) -> None:
        """Undo ``freeze`` of this operation (a no-op when it holds no freeze)."""
        ...

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        """Cap (or, with None, open) the group's GPU capacity; returns the previous limit."""
        ...

    def set_gpu_products(self, group: str, products: list[str]) -> list[str]:
        """Require the group's nodes to be of ``products`` (a NodePool's ``nvidia.com/gpu.product In``
        requirement; its nodes of other products drift); returns the products required before (empty: any).
        Managed node groups take their product from their instance type: refused."""
        ...

    def scale_up(self, group: str, desired: int) -> GroupScaling:
        """Grow a managed node group to ``desired`` nodes (absolute, so a retry asks for the same size; never
        lowers it, never past its maximum, refused where an autoscaler owns its size). Returns its scaling after.
        Karpenter sizes its NodePools itself: refused."""
        ...


# Marks a shield as the optimizer's: only such a shield is ever lifted by it (a user's own stays theirs).
SHIELDED_ANNOTATION: Final = "gpu.kubeon.io/shielded"


def shield_patch(annotations: Mapping[str, str], key: str, shielded: bool) -> dict[str, str | None] | None:
    """The node annotations that shield a node from its autoscaler (``key`` set to "true" and marked ours) or lift
    our shield; None when there is nothing to change (shielded already, or a shield that is not ours)."""
    if shielded:
        if annotations.get(key) == "true":
            return None
        return {key: "true", SHIELDED_ANNOTATION: "true"}
    if annotations.get(SHIELDED_ANNOTATION) != "true":
        return None
    return {key: None, SHIELDED_ANNOTATION: None}

