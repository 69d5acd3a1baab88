"""What a packing round decides on, read from the cluster with the optimizer's own credentials (R5.1: nodes,
pods and PodDisruptionBudgets read; the home groups through the capacity provider): the group's GPU nodes with
their prices, the pods bound to them (controller kind, do-not-disrupt, start time, placement constraints, the
PDBs covering them) and each PDB's disruptions allowed now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes import client

from activities.capacity import CapacityProvider
from activities.clients.kube import pending_pod
from models.capacity import DO_NOT_DISRUPT
from models.packing import PackNode
from models.packing import PackPod


@dataclass
class PackFacts:
    nodes: list[PackNode]
    pods: list[PackPod]
    pdb_allowed: dict[str, int]


def selector_matches(selector: client.V1LabelSelector | None, labels: dict[str, str]) -> bool:
    """A PDB's label selector (matchLabels and matchExpressions); a null selector matches nothing, an empty one
    every pod of the namespace (policy/v1)."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.match_labels or {}).items()):
        return False
    for e in selector.match_expressions or []:
        values = set(e.values or [])
        present = e.key in labels
        if (e.operator == "In" and (not present or labels[e.key] not in values)) or \
                (e.operator == "NotIn" and present and labels[e.key] in values) or \
                (e.operator == "Exists" and not present) or (e.operator == "DoesNotExist" and present):
            return False
    return True


def _owner_kind(pod: client.V1Pod) -> str:
    for ref in pod.metadata.owner_references or []:
        if ref.controller:
            return str(ref.kind)
    return ""


def gather(api: client.ApiClient, capacity: CapacityProvider, groups: list[str],
           node_labels: dict[str, str] | None = None) -> PackFacts:
    """``node_labels``: only the groups' nodes carrying these labels."""
    core, policy = client.CoreV1Api(api), client.PolicyV1Api(api)
    nodes: list[PackNode] = []
    for name in groups:
        group = capacity.get_group(name)
        for member in group.nodes:
            try:
                node = core.read_node(member.name)
            except client.ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            if any((node.metadata.labels or {}).get(k) != v for k, v in (node_labels or {}).items()):
                continue
            taints = [t.key for t in (node.spec.taints or []) if t.effect in ("NoSchedule", "NoExecute")]
            nodes.append(PackNode(
                name=member.name, group=name, gpus=member.gpus, gpu_product=member.gpu_product,
                labels=dict(node.metadata.labels or {}), taints=sorted(set(taints)),
                usd_per_hour=member.usd_per_hour or 0.0, ready=member.ready, cordoned=member.cordoned,
                do_not_disrupt=(node.metadata.annotations or {}).get(DO_NOT_DISRUPT) == "true"))
    names = {n.name for n in nodes}
    bound = [p for p in core.list_pod_for_all_namespaces(
        field_selector="status.phase!=Succeeded,status.phase!=Failed").items
        if p.spec.node_name and p.spec.node_name in names and p.metadata.deletion_timestamp is None]
    pdbs = policy.list_pod_disruption_budget_for_all_namespaces().items
    allowed = {f"{b.metadata.namespace}/{b.metadata.name}": int((b.status.disruptions_allowed if b.status else 0) or 0)
               for b in pdbs}
    pods: list[PackPod] = []
    for p in bound:
        labels: dict[str, Any] = dict(p.metadata.labels or {})
        covering = [f"{b.metadata.namespace}/{b.metadata.name}" for b in pdbs
                    if b.metadata.namespace == p.metadata.namespace and selector_matches(b.spec.selector, labels)]
        pods.append(PackPod(
            pod=pending_pod(p), node=str(p.spec.node_name), owner_kind=_owner_kind(p),
            do_not_disrupt=(p.metadata.annotations or {}).get(DO_NOT_DISRUPT),
            started_at=p.status.start_time if p.status else None, pdbs=covering, labels=dict(labels),
            annotation_keys=sorted(p.metadata.annotations or {})))
    return PackFacts(nodes=nodes, pods=pods, pdb_allowed=allowed)
