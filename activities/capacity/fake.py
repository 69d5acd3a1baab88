"""An in-memory capacity provider that records every call and injects failures: for workflow tests."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity import NodeNotInGroupError
from activities.recording import CallRecorder
from models.capacity import FREEZE_BUDGET
from models.capacity import HomeNodeGroup
from models.eks import GroupScaling


@dataclass
class FakeCapacity(CallRecorder):
    name: str = "fake"
    groups: dict[str, HomeNodeGroup] = field(default_factory=dict)
    shielded: set[str] = field(default_factory=set)

    def _group(self, group: str) -> HomeNodeGroup:
        try:
            return self.groups[group]
        except KeyError:
            raise GroupNotFoundError(f"NodePool {group} does not exist") from None

    def list_groups(self) -> list[HomeNodeGroup]:
        self._record("list_groups", "")
        return [g.model_copy(deep=True) for g in self.groups.values()]

    def get_group(self, group: str) -> HomeNodeGroup:
        self._record("get_group", group)
        return self._group(group).model_copy(deep=True)

    def remove_node(self, group: str, node: str) -> None:
        self._record("remove_node", f"{group}/{node}")
        g = self._group(group)
        if not any(n.name == node for n in g.nodes):
            if any(n.name == node for other in self.groups.values() for n in other.nodes):
                raise NodeNotInGroupError(f"node {node} is not in NodePool {group}")
            return
        removed = next(n for n in g.nodes if n.name == node)
        g.nodes = [n for n in g.nodes if n.name != node]
        g.gpus -= removed.gpus
        if g.replicas is not None:
            g.replicas -= 1

    def node_gone(self, group: str, node: str) -> bool:
        self._record("node_gone", f"{group}/{node}")
        return not any(n.name == node for n in self._group(group).nodes)

    def shield_node(self, node: str, shielded: bool) -> None:
        self._record("shield_node", f"{node}={shielded}")
        (self.shielded.add if shielded else self.shielded.discard)(node)

    def freeze(self, group: str, operation: str) -> None:
        self._record("freeze", f"{group}/{operation}")
        g = self._group(group)
        if g.frozen_by == operation:
            return
        if g.frozen_by:
            raise FrozenByOtherError(f"NodePool {group}'s disruption is held frozen by operation {g.frozen_by}")
        g.frozen_by = operation
        g.budgets = [*g.budgets, dict(FREEZE_BUDGET)]

    def unfreeze(self, group: str, operation: str) -> None:
        self._record("unfreeze", f"{group}/{operation}")
        g = self.groups.get(group)
        if g is None or g.frozen_by != operation:
            return
        for i in range(len(g.budgets) - 1, -1, -1):
            if g.budgets[i] == FREEZE_BUDGET:
                del g.budgets[i]
                break
        g.frozen_by = None

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        self._record("set_gpu_limit", f"{group}={gpus}")
        if gpus is not None and gpus < 0:
            raise CapacityError(f"GPU limit {gpus} for NodePool {group} is negative", retryable=False)
        g = self._group(group)
        previous, g.gpu_limit = g.gpu_limit, gpus
        return previous

    def set_gpu_products(self, group: str, products: list[str]) -> list[str]:
        self._record("set_gpu_products", f"{group}={','.join(products)}")
        g = self._group(group)
        previous, g.gpu_products = list(g.gpu_products), sorted(products)
        return previous

    def scale_up(self, group: str, desired: int) -> GroupScaling:
        self._record("scale_up", f"{group}={desired}")
        g = self._group(group)
        if g.scaling is None:
            raise CapacityError(f"NodePool {group}: Karpenter sizes it itself", retryable=False)
        if desired < g.scaling.desired_size or desired > g.scaling.max_size:  # refused as EKS and AKS refuse
            raise CapacityError(f"node group {group}: desired {desired} is outside {g.scaling.desired_size} .. "
                                f"{g.scaling.max_size}", retryable=False)
        g.scaling = g.scaling.model_copy(update={"desired_size": g.scaling.landed(desired)})
        return g.scaling
