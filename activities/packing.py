"""Activities of a packing round: plan it from the cluster, then one node at a time freeze its pool, cordon it,
evict its pods one by one through the Eviction API (a 429 is a PDB wait, reported), wait for each replacement
Ready on a kept node, remove the node through the capacity provider and confirm it gone; uncordon and unfreeze as
compensation. Every activity is idempotent (a retried cordon, freeze, eviction or removal is a no-op)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.capacity import CapacityError
from activities.capacity import CapacityProvider
from activities.capacity.facts import gather
from activities.clients.kube import PDB_PATTERN
from activities.clients.kube import KubeOps
from models.autoscaling import GpuProductsRequest
from models.packing import EvictOutcome
from models.packing import GroupRef
from models.packing import NodeRef2
from models.packing import PackPlan
from models.packing import PackPlanRequest
from models.packing import PodRef
from models.packing import ReplacementCheck
from models.packing import ReplacementState
from planning.packing import plan_packing

CAPACITY_REFUSED = "CapacityRefused"
T = TypeVar("T")


def _capacity_call(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except CapacityError as exc:
        raise ApplicationError(str(exc), type=CAPACITY_REFUSED, non_retryable=not exc.retryable) from None


def _owner_uid(pod: Any) -> str:
    owner = next((r for r in pod.metadata.owner_references or [] if r.controller), None)
    return str(owner.uid) if owner else ""


def _ready(pod: Any) -> bool:
    return bool(pod.spec.node_name) and any(c.type == "Ready" and c.status == "True"
                                            for c in (pod.status.conditions if pod.status else None) or [])


def plan_round(api: Any, capacity: CapacityProvider, req: PackPlanRequest, now: dt.datetime) -> PackPlan:
    """The round the cluster allows now (the watcher's proposal and the workflow's plan are made the same way)."""
    facts = _capacity_call(gather, api, capacity, req.groups, req.scope.node_labels)
    return plan_packing(facts.nodes, facts.pods, now=now, pdb_allowed=facts.pdb_allowed, max_nodes=req.max_nodes,
                        min_savings_usd_per_hour=req.min_savings_usd_per_hour, scope=req.scope)


class PackActivities:
    def __init__(self, kube: KubeOps, capacity: CapacityProvider,
                 clock: Callable[[], dt.datetime] | None = None) -> None:
        self.kube = kube
        self.capacity = capacity
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))

    @activity.defn(name="pack_plan", no_thread_cancel_exception=True)
    def pack_plan(self, req: PackPlanRequest) -> PackPlan:
        return plan_round(self.kube.api, self.capacity, req, self.clock())

    @activity.defn(name="pack_freeze", no_thread_cancel_exception=True)
    def pack_freeze(self, req: GroupRef) -> None:
        _capacity_call(self.capacity.freeze, req.group, req.operation)

    @activity.defn(name="pack_unfreeze", no_thread_cancel_exception=True)
    def pack_unfreeze(self, req: GroupRef) -> None:
        _capacity_call(self.capacity.unfreeze, req.group, req.operation)

    @activity.defn(name="pack_cordon", no_thread_cancel_exception=True)
    def pack_cordon(self, req: NodeRef2) -> bool:
        return self.kube.cordon(req.node)

    @activity.defn(name="pack_uncordon", no_thread_cancel_exception=True)
    def pack_uncordon(self, req: NodeRef2) -> bool:
        from kubernetes import client

        try:
            self.kube.core.patch_node(req.node, {"spec": {"unschedulable": False}})
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    @activity.defn(name="pack_pods_on_node", no_thread_cancel_exception=True)
    def pack_pods_on_node(self, req: NodeRef2) -> list[PodRef]:
        """The pods a packing round moves off the node (not DaemonSet, mirror or finished pods), each with its
        controller and how many of that controller's pods are Ready now, before any of them is evicted."""
        pods = [p for p in self.kube._evictable(self.kube.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={req.node}").items) if p.metadata.deletion_timestamp is None]
        ready: dict[tuple[str, str], int] = {}
        refs = []
        for p in pods:
            namespace, owner_uid = str(p.metadata.namespace), _owner_uid(p)
            if owner_uid and (namespace, owner_uid) not in ready:
                ready[(namespace, owner_uid)] = len([s for s in self._siblings(namespace, owner_uid) if _ready(s)])
            refs.append(PodRef(namespace=namespace, name=str(p.metadata.name), owner_uid=owner_uid,
                               ready_before=ready.get((namespace, owner_uid), 0)))
        return sorted(refs, key=lambda r: r.key)

    @activity.defn(name="pack_evict_pod", no_thread_cancel_exception=True)
    def pack_evict_pod(self, req: PodRef) -> EvictOutcome:
        """Evict the pod through the Eviction API: evicted (with its controller and how many of that controller's
        pods were Ready before, which its replacement restores), blocked by a PDB (429), or gone. A pod evicted
        already (a retried activity whose eviction went through before its worker died, or one deleted by someone
        else) is not evicted again, and its replacement is waited for as the node's listing counted it: the live
        count no longer holds the pod, and may or may not hold its replacement yet."""
        from kubernetes import client

        try:
            pod = self.kube.core.read_namespaced_pod(req.name, req.namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return EvictOutcome(outcome="gone", owner_uid=req.owner_uid, ready_before=req.ready_before)
            raise
        owner_uid = _owner_uid(pod)
        ready = len([p for p in self._siblings(req.namespace, owner_uid) if _ready(p)]) if owner_uid else 0
        if pod.metadata.deletion_timestamp is not None:
            listed = req.owner_uid == owner_uid and req.owner_uid != ""
            return EvictOutcome(outcome="evicted", owner_uid=owner_uid,
                                ready_before=req.ready_before if listed else ready)
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=req.name, namespace=req.namespace))
        try:
            self.kube.core.create_namespaced_pod_eviction(req.name, req.namespace, body)
        except client.ApiException as exc:
            if exc.status == 404:
                return EvictOutcome(outcome="gone", owner_uid=owner_uid, ready_before=ready)
            if exc.status == 429:
                match = PDB_PATTERN.search(exc.body or "")
                return EvictOutcome(outcome="blocked", pdb=match.group(1) if match else "(unknown)",
                                    owner_uid=owner_uid, ready_before=ready)
            raise
        return EvictOutcome(outcome="evicted", owner_uid=owner_uid, ready_before=ready)

    def _siblings(self, namespace: str, owner_uid: str) -> list[Any]:
        return [p for p in self.kube.core.list_namespaced_pod(namespace).items
                if any(r.uid == owner_uid for r in p.metadata.owner_references or [])
                and p.metadata.deletion_timestamp is None]

    @activity.defn(name="pack_replacement_ready", no_thread_cancel_exception=True)
    def pack_replacement_ready(self, req: ReplacementCheck) -> ReplacementState:
        """Whether the evicted pod is gone and its controller's pods are all Ready again, none on the node."""
        from kubernetes import client

        try:
            self.kube.core.read_namespaced_pod(req.pod.name, req.pod.namespace)
            return ReplacementState(ready=False, detail=f"{req.pod.key} still terminating")
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        if not req.owner_uid:
            return ReplacementState(ready=True)
        siblings = self._siblings(req.pod.namespace, req.owner_uid)
        ready = [p for p in siblings if _ready(p)]
        if len(ready) >= req.ready_before:
            return ReplacementState(ready=True)
        waiting = next((p for p in siblings if not _ready(p)), None)
        if waiting is None:
            return ReplacementState(ready=False, detail="its replacement is not created yet")
        where = ("Pending (no node has room for it)" if not waiting.spec.node_name
                 else f"not Ready on {waiting.spec.node_name}")
        return ReplacementState(ready=False, detail=f"replacement {waiting.metadata.name} {where}")

    @activity.defn(name="pack_remove_node", no_thread_cancel_exception=True)
    def pack_remove_node(self, req: NodeRef2) -> None:
        _capacity_call(self.capacity.remove_node, req.group, req.node)

    @activity.defn(name="pack_node_gone", no_thread_cancel_exception=True)
    def pack_node_gone(self, req: NodeRef2) -> bool:
        return bool(_capacity_call(self.capacity.node_gone, req.group, req.node))

    @activity.defn(name="set_gpu_products", no_thread_cancel_exception=True)
    def set_gpu_products(self, req: GpuProductsRequest) -> list[str]:
        """issue 23: the NodePool's GPU products requirement, absolute (a retry sets the same); the products it
        required before."""
        return _capacity_call(self.capacity.set_gpu_products, req.node_pool, req.products)

    def all(self) -> list[Callable[..., Any]]:
        return [self.set_gpu_products, self.pack_plan, self.pack_freeze, self.pack_unfreeze, self.pack_cordon,
                self.pack_uncordon, self.pack_pods_on_node, self.pack_evict_pod, self.pack_replacement_ready,
                self.pack_remove_node, self.pack_node_gone]
