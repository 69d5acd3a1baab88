"""The Node calls and reads every capacity provider makes alike: read one node (checking its group before a
removal), shield one from its autoscaler, a group's Nodes as its members. Each provider names its autoscaler's shield
annotation (Karpenter's do-not-disrupt, the cluster-autoscaler's scale-down-disabled)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import ClassVar

from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import NodeNotInGroupError
from activities.capacity import shield_patch
from activities.clients.kube import gpus_requested
from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.labels import GPU_RESOURCE

# A managed provider's group as its cloud describes it, its Nodes and their GPUs used -> the HomeNodeGroup.
GroupOf = Callable[[Any, list[client.V1Node], dict[str, int]], HomeNodeGroup]


def labelled(nodes: list[client.V1Node], label: str, group: str) -> Iterator[tuple[client.V1Node, dict[str, str]]]:
    """Each of ``nodes`` whose ``label`` names ``group``, with its labels."""
    for node in nodes:
        labels = node.metadata.labels or {}
        if labels.get(label) == group:
            yield node, labels


def group_node(node: client.V1Node, used: dict[str, int], **provider: Any) -> GroupNode:
    """``node`` as a group member: what every provider reads from the Node alike (its name, allocatable GPUs, the
    GPUs its pods use, Ready, cordoned); ``provider``: the fields each provider reads its own way."""
    allocatable = (node.status.allocatable or {}) if node.status else {}
    return GroupNode(
        name=node.metadata.name, gpus=int(allocatable.get(GPU_RESOURCE, "0")),
        gpus_used=used.get(str(node.metadata.name), 0),
        ready=any(c.type == "Ready" and c.status == "True"
                  for c in (node.status.conditions if node.status else None) or []),
        cordoned=bool(node.spec and node.spec.unschedulable), **provider)


class HomeNodes:
    """Mixed into a capacity provider that sets ``core`` (a ``CoreV1Api``) and names its ``SHIELD_ANNOTATION``."""

    SHIELD_ANNOTATION: ClassVar[str]
    core: client.CoreV1Api

    def set_gpu_products(self, group: str, products: list[str]) -> list[str]:
        """Managed node groups (EKS, GKE, AKS) have the GPU product of their instance type; Karpenter overrides."""
        raise CapacityError(f"node group {group}: its GPU product is its instance type's; an Autoscaling policy's "
                            "gpuProducts applies to Karpenter NodePools", retryable=False)

    def _node(self, node: str) -> client.V1Node | None:
        try:
            return self.core.read_node(node)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise CapacityError(f"reading node {node}: {exc.status} {exc.reason}") from exc

    def _node_in_group(self, node: str, group: str, label: str, kind: str) -> client.V1Node | None:
        """The Node ``node`` (None: gone), refused with NodeNotInGroupError unless its ``label`` names ``group``
        (a ``kind``: node group, node pool, ...): a removal never takes a node of another group."""
        found = self._node(node)
        if found is None:
            return None
        in_group = (found.metadata.labels or {}).get(label)
        if in_group != group:
            raise NodeNotInGroupError(f"node {node} is not in {kind} {group} ({label}={in_group})")
        return found

    def _gpus_used(self, node_names: set[str]) -> dict[str, int]:
        """The GPUs that the pods bound to each of ``node_names`` request (pods that ended hold none)."""
        used: dict[str, int] = defaultdict(int)
        if not node_names:
            return used
        for pod in self.core.list_pod_for_all_namespaces(
                field_selector="status.phase!=Succeeded,status.phase!=Failed").items:
            if pod.spec is not None and pod.spec.node_name and pod.spec.node_name in node_names:
                used[str(pod.spec.node_name)] += gpus_requested(pod)
        return used

    def _groups_with_nodes(self, label: str, described: list[Any], make: GroupOf,
                           group: str | None = None) -> list[HomeNodeGroup]:
        """Each of the ``described`` groups (as its cloud describes it) made a HomeNodeGroup by ``make`` with its
        Nodes (labelled ``label``, ``=group`` for one group) and the GPUs their pods use, read once for all."""
        if not described:
            return []
        nodes = self.core.list_node(label_selector=f"{label}={group}" if group else label).items
        used = self._gpus_used({str(n.metadata.name) for n in nodes if n.metadata is not None})
        return [make(d, nodes, used) for d in described]

    def shield_node(self, node: str, shielded: bool) -> None:
        found = self._node(node)
        if found is None:
            return
        annotations = (found.metadata.annotations if found.metadata else None) or {}
        patch = shield_patch(annotations, self.SHIELD_ANNOTATION, shielded)
        if patch is None:
            return
        try:
            self.core.patch_node(node, {"metadata": {"annotations": patch}})
        except client.ApiException as exc:
            if exc.status != 404:
                raise CapacityError(f"patching node {node}: {exc.status} {exc.reason}",
                                    retryable=exc.status not in (401, 403)) from exc
