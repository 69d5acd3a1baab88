"""Kubernetes side effects with the optimizer's own credentials (R5.1): read pods, nodes, policies; patch
nodes (cordon); evict through the Eviction API only. Nothing here creates or deletes a Node."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple
from typing import TypeVar

from kubernetes import client

from common.kube import raw_items
from common.kube import raw_list
from common.kube import read_or_none
from common.watch import Json
from common.watch import WatchedList
from common.watch import object_key
from models.drain import EvictionResult
from models.labels import GPU_RESOURCE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.node import NodeExpectation
from models.node import ServeCheckRequest
from models.node import ServeCheckResult
from models.node import VerifyResult
from models.policy import API_GROUP
from models.policy import PLURAL
from models.policy import GpuPolicy
from models.policy import PolicyError
from models.policy import parse_policy
from models.provisioning import NodeRequirement
from models.provisioning import PendingPod
from planning.burst import pod_matches

Heartbeat = Callable[..., None]
PDB_PATTERN = re.compile(r"disruption budget ([a-z0-9]([-a-z0-9.]*[a-z0-9])?)")


class NodeJoinTimeout(Exception):
    pass


class VerificationFailed(Exception):
    pass


def gpus_requested(pod: client.V1Pod) -> int:
    total = 0
    for c in pod.spec.containers or []:
        res = c.resources
        for source in ((res.limits or {}), (res.requests or {})) if res else ():
            if GPU_RESOURCE in source:
                total += int(source[GPU_RESOURCE])
                break
    return total


def tolerates(pod: client.V1Pod, taint_key: str) -> bool:
    for t in pod.spec.tolerations or []:
        key_ok = t.key == taint_key or (t.key in (None, "") and t.operator == "Exists")
        if key_ok and t.effect in (None, "", "NoSchedule"):
            return True
    return False


class WaitingPod(NamedTuple):
    """What the "could a waiting pod still come here?" question keeps of a pending, unbound pod."""
    facts: PendingPod
    deleting: bool


def waiting_pod(pod: client.V1Pod) -> WaitingPod:
    return WaitingPod(facts=pending_pod(pod), deleting=pod.metadata.deletion_timestamp is not None)


def could_take(node: client.V1Node, pod: WaitingPod, taint_key: str) -> bool:
    """Whether a waiting pod is one this burst node is for: it tolerates the burst taint, its nodeSelector and
    required node affinity match the node and its GPU request fits the node."""
    if pod.deleting or not pod.facts.tolerates(taint_key):
        return False
    if not pod_matches(pod.facts, dict(node.metadata.labels or {})):
        return False
    allocatable = int((node.status.allocatable or {}).get(GPU_RESOURCE, "0")) if node.status else 0
    return 0 < pod.facts.gpus <= allocatable


def _pod_terminal(pod: client.V1Pod) -> bool:
    return bool(pod.status and pod.status.phase in ("Succeeded", "Failed"))


def is_live(pod: client.V1Pod) -> bool:
    """Neither terminating nor finished."""
    return pod.metadata.deletion_timestamp is None and not _pod_terminal(pod)


T = TypeVar("T")
R = TypeVar("R")

# How stale the home capacity a serving node's return-home check reads may be while the watches of the cluster's
# Nodes and Pods are not following (starting, or lost): one list a second then serves every serving node.
HOME_VIEW_SECONDS = 1.0
# How stale the waiting pods a verifying or idle serving node asks about may be ("could a waiting pod still come
# here?") while the watch of them is not following: 200 nodes verifying at once asked the API server for every
# pending pod twice a second each, a third of the worker's CPU in the one-shape bench; one watch serves them all,
# else one list a second. A pod younger than this is not one a node was launched for, and a serving node asks
# again at its next check.
WAITING_VIEW_SECONDS = 1.0
# The pods that wait for a node: pending and not bound.
WAITING_SELECTOR = "status.phase=Pending,spec.nodeName="
# How long a verifying node waits to be woken by a pod bound to it before it asks again whether anything still
# waits for it (well inside the activity's 15 s heartbeat timeout).
VERIFY_WATCH_SECONDS = 5
# Taints of a node that is not capacity yet or any more (registering, being disrupted or removed, not ready): its
# GPUs are never counted as home capacity that a burst node could go home to.
NOT_CAPACITY_TAINTS = frozenset({
    "karpenter.sh/unregistered", "karpenter.sh/disrupted", "ToBeDeletedByClusterAutoscaler",
    "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", "node.kubernetes.io/unschedulable",
    "node.cloudprovider.kubernetes.io/uninitialized",
})


class NodeFacts(NamedTuple):
    """What the join wait and the return-home check keep of a Node: its labels, whether it is Ready, and its
    allocatable GPUs if it is home capacity now (no burst location label, schedulable, Ready, no taint of a node
    that is not capacity), else 0."""
    name: str
    labels: dict[str, str]
    ready: bool
    home_gpus: int


def node_facts(node: Json) -> NodeFacts:
    meta, spec, status = node.get("metadata", {}), node.get("spec", {}), node.get("status", {})
    labels = dict(meta.get("labels") or {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    capacity = (ready and LABEL_LOCATION not in labels and not spec.get("unschedulable")
                and not any(t.get("key") in NOT_CAPACITY_TAINTS for t in spec.get("taints") or []))
    gpus = int((status.get("allocatable") or {}).get(GPU_RESOURCE, "0")) if capacity else 0
    return NodeFacts(name=str(meta.get("name", "")), labels=labels, ready=ready, home_gpus=gpus)


class BoundPod(NamedTuple):
    """What the verification and serving checks keep of a Pod: namespace/name, the node it runs on (None: not
    bound, or finished), the GPUs it requests, and whether it counts as the node's workload (``KubeOps._evictable``
    and not being deleted)."""
    key: str
    node: str | None
    gpus: int
    serving: bool


def bound_pod(pod: Json) -> BoundPod:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
    gpus = 0
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        for source in (res.get("limits") or {}, res.get("requests") or {}):
            if GPU_RESOURCE in source:
                gpus += int(source[GPU_RESOURCE])
                break
    serving = not (meta.get("deletionTimestamp") or "kubernetes.io/config.mirror" in (meta.get("annotations") or {})
                   or any(r.get("kind") == "DaemonSet" for r in meta.get("ownerReferences") or []))
    return BoundPod(key=object_key(pod), node=None if finished else spec.get("nodeName") or None, gpus=gpus,
                    serving=serving)


def pods_by_node(pods: Mapping[str, BoundPod]) -> dict[str, list[BoundPod]]:
    out: dict[str, list[BoundPod]] = {}
    for p in pods.values():
        if p.node:
            out.setdefault(p.node, []).append(p)
    return out


def gpus_used_by_node(pods: Mapping[str, BoundPod]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in pods.values():
        if p.node:
            out[p.node] = out.get(p.node, 0) + p.gpus
    return out


def home_nodes(nodes: Mapping[str, NodeFacts]) -> list[NodeFacts]:
    return [n for n in nodes.values() if n.home_gpus]


class Wakeups:
    """An event per node name that a watch sets when something about that node changed, for the threads waiting
    on it (a join for its Node, a verification for a pod bound to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # name -> (its event, how many wait on it): an activity retried while its earlier attempt still waits
        # shares the event, and it stays until the last of them is done.
        self._events: dict[str, tuple[threading.Event, int]] = {}

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[threading.Event]:
        with self._lock:
            event, count = self._events.get(name, (threading.Event(), 0))
            self._events[name] = (event, count + 1)
        try:
            yield event
        finally:
            with self._lock:
                event, count = self._events[name]
                if count > 1:
                    self._events[name] = (event, count - 1)
                else:
                    del self._events[name]

    def wake(self, name: str | None) -> None:
        with self._lock:
            found = self._events.get(name or "")
        if found is not None:
            found[0].set()


def _values(objects: Mapping[str, T]) -> list[T]:
    return list(objects.values())


class KubeOps:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        # A ReplicaSet's controller never changes: (namespace, name) -> (kind, name) of its owner.
        self._rs_owner: dict[tuple[str, str], tuple[str, str]] = {}
        # Joins waiting for their Node to turn Ready, and verifications for a pod bound to their node, woken by
        # the watches below.
        self._node_changed = Wakeups()
        self._bound_here = Wakeups()
        # The view of the cluster the joins, verifications and serving checks read: every serving node checks
        # every serve_check_seconds, and a list of every Node and Pod a second was the worker's largest cost with
        # 200 nodes serving (issue 26). One watch each keeps what the checks need of them; while a watch is not
        # following, a list at most a second old serves (HOME_VIEW_SECONDS, WAITING_VIEW_SECONDS).
        self._node_watch = WatchedList(self.core.list_node, node_facts, name="node-watch",
                                       on_change=lambda node: self._node_changed.wake(node["metadata"]["name"]),
                                       fallback_seconds=HOME_VIEW_SECONDS)
        self._pod_watch = WatchedList(self.core.list_pod_for_all_namespaces, bound_pod, name="bound-pod-watch",
                                      on_change=self._pod_changed, fallback_seconds=HOME_VIEW_SECONDS,
                                      field_selector="status.phase!=Succeeded")
        # The pods waiting for a node, for every verifying or idle serving node's "could one still come here?".
        self._waiting_watch = WatchedList(self.core.list_pod_for_all_namespaces, self._waiting_pod_of_json,
                                          name="waiting-pod-watch", fallback_seconds=WAITING_VIEW_SECONDS,
                                          field_selector=WAITING_SELECTOR)

    # -- policies ----------------------------------------------------------------------------------------
    def read_policy(self, name: str) -> GpuPolicy:
        """A Burst policy (a policy of another kind is an error naming its kind)."""
        doc = self.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, name)
        policy = parse_policy(doc)
        if not isinstance(policy, GpuPolicy):
            raise PolicyError([("spec.kind", f"policy {name} is {policy.spec.kind}, not Burst")])
        return policy

    def policy_status(self, name: str) -> dict[str, Any] | None:
        """The policy's status as stored (None when the policy does not exist)."""
        try:
            doc: dict[str, Any] = self.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, name)  # type: ignore[assignment]
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(doc.get("status") or {})

    def list_policies(self) -> list[GpuPolicy]:
        """The valid Burst policies."""
        out = []
        listed: dict[str, Any] = self.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL)  # type: ignore[assignment]
        for doc in listed.get("items", []):
            try:
                policy = parse_policy(doc)
            except ValueError:
                continue  # an invalid policy is never enforced; the sync reports it in its status
            if isinstance(policy, GpuPolicy):
                out.append(policy)
        return out

    # -- ownership ---------------------------------------------------------------------------------------
    def owner_of(self, pod: client.V1Pod) -> tuple[str, str]:
        """(kind, name) of the workload a pod belongs to: Deployment through its ReplicaSet, Job, StatefulSet,
        or the pod itself."""
        refs = [r for r in pod.metadata.owner_references or [] if r.controller]
        if not refs:
            return "Pod", str(pod.metadata.name)
        ref = refs[0]
        if ref.kind == "ReplicaSet":
            key = (str(pod.metadata.namespace), str(ref.name))
            if key not in self._rs_owner:
                try:
                    rs = self.apps.read_namespaced_replica_set(key[1], key[0])
                except client.ApiException:
                    return "ReplicaSet", str(ref.name)
                owners = [r for r in rs.metadata.owner_references or [] if r.controller]
                self._rs_owner[key] = (str(owners[0].kind), str(owners[0].name)) if owners else ("ReplicaSet",
                                                                                                   key[1])
            return self._rs_owner[key]
        return str(ref.kind), str(ref.name)

    def waiting_and_used(self, uids: set[str], nodes: set[str]) -> tuple[set[str], dict[str, int]]:
        """Which of these pods still wait for a node (Pending, not bound, not being deleted), and the GPUs the pods
        bound to each of these nodes request, both as of one resourceVersion: read one after the other, a pod
        that binds in between counts both waiting and on its node, and the plan buys it a second node. Both read
        as plain JSON (``raw_list``): into the client's models, a plan with 1,000 pods bound paid 0.4 s of CPU."""
        pending = raw_list(self.core.list_pod_for_all_namespaces(field_selector="status.phase=Pending,spec.nodeName=",
                                                                  _preload_content=False))
        waiting = {uid for p in pending["items"]
                   if (uid := p["metadata"].get("uid")) in uids and not p["metadata"].get("deletionTimestamp")}
        used = dict.fromkeys(nodes, 0)
        if nodes:
            bound = raw_items(self.core.list_pod_for_all_namespaces(
                field_selector="spec.nodeName!=", resource_version=pending["metadata"]["resourceVersion"],
                resource_version_match="Exact", _preload_content=False))
            for p in map(bound_pod, bound):
                if p.node in used:
                    used[p.node] += p.gpus
        return waiting, used

    def waiting_for(self, node: client.V1Node, taint_key: str) -> int:
        """How many waiting pods (any namespace, any group) this burst node could take, from a view of the cluster's
        pending pods as the watch of them last saw it (while it is not following: a list at most
        WAITING_VIEW_SECONDS old)."""
        return len([p for p in self._waiting_watch.current(_values)
                    if could_take(node, p, taint_key)])

    def _waiting_pod_of_json(self, pod: Json) -> WaitingPod:
        # As the client's own watch does (Watch.unmarshal_event): the event's object into the client's model, so the
        # facts come from the one reading of a pod the planner and the pod watcher use (pending_pod).
        return waiting_pod(self.api.deserialize(json.dumps(pod), "V1Pod", "application/json"))

    # -- join ----------------------------------------------------------------------------------------------
    def wait_node_ready(self, node_name: str, operation: str, timeout: float, heartbeat: Heartbeat) -> str:
        """Wait for the Node to register and turn Ready, woken by the watch of the cluster's Nodes (one for every
        joining node, instead of a read and a watch of its own per node); heartbeat between waits. While the watch
        is not following, the Node is read each second."""
        deadline = time.monotonic() + timeout
        with self._node_changed.waiting(node_name) as changed:
            while True:
                heartbeat(f"waiting for node {node_name}")
                self._node_watch.start()
                following, node = self._node_watch.lookup(node_name)
                if not following:
                    read: Any = read_or_none(lambda: self.core.read_node(node_name, _preload_content=False))
                    node = node_facts(json.loads(read.data)) if read is not None else None
                if node is not None:
                    if node.labels.get(LABEL_OPERATION) != operation:
                        raise VerificationFailed(f"node {node_name} exists but belongs to another operation")
                    if node.ready:
                        return node_name
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NodeJoinTimeout(f"node {node_name} did not become Ready within {timeout:.0f}s")
                changed.wait(min(VERIFY_WATCH_SECONDS if following else HOME_VIEW_SECONDS, remaining))
                changed.clear()  # before the view is read again: a change after this sets it anew

    # -- verify --------------------------------------------------------------------------------------------
    def verify_node(self, expect: NodeExpectation, heartbeat: Heartbeat) -> VerifyResult:
        node = self.core.read_node(expect.node_name)
        taints = node.spec.taints or []
        if not any(t.key == expect.taint_key and t.effect == "NoSchedule" for t in taints):
            raise VerificationFailed(f"node {expect.node_name} lacks the taint {expect.taint_key}:NoSchedule")
        labels = node.metadata.labels or {}
        wrong = {k: labels.get(k) for k, v in expect.labels.items() if labels.get(k) != v}
        if wrong:
            raise VerificationFailed(f"node {expect.node_name} has wrong or missing labels: {wrong}")
        deadline = time.monotonic() + expect.timeout_seconds
        with self._bound_here.waiting(expect.node_name) as bound:
            while True:
                heartbeat(f"waiting for pods on {expect.node_name}")
                # Any opted-in pod may land on a burst node, whatever its namespace or group.
                placed = sorted(p.key for p in self._pod_watch.current(pods_by_node).get(
                    expect.node_name, ()) if p.serving)
                if placed:
                    return VerifyResult(node_name=expect.node_name, pods_on_node=placed)
                if self.waiting_for(node, expect.taint_key) == 0:
                    # Nothing waits that this node could take (its pods found room elsewhere or are gone): verified
                    # but idle; serving notices that and returns it home.
                    return VerifyResult(node_name=expect.node_name, pods_on_node=[])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise VerificationFailed(
                        f"no waiting pod was scheduled on {expect.node_name} within {expect.timeout_seconds}s")
                # Woken by the pod watch the moment a pod is bound here (one watch for every verifying node,
                # instead of a list and a watch of its own per node each window); while the watch is not following,
                # the view is a list at most HOME_VIEW_SECONDS old, read again each such interval.
                window = VERIFY_WATCH_SECONDS if self._pod_watch.following else HOME_VIEW_SECONDS
                bound.wait(min(window, remaining))
                bound.clear()  # before the view is read again: a pod bound after this sets it anew

    def _pod_changed(self, pod: Json) -> None:
        """Wake a verification waiting for a pod on the node this pod is bound to (the view already holds it)."""
        self._bound_here.wake(pod.get("spec", {}).get("nodeName"))

    # -- serve ---------------------------------------------------------------------------------------------
    def check_serving(self, req: ServeCheckRequest) -> ServeCheckResult:
        """Done when the burst node is idle (nothing runs on it and no waiting pod could take it), or (returnHome)
        when home nodes have room for everything on it. A burst node serves whatever opted-in pods the scheduler
        puts there, whichever batch they were planned in.

        A node with pods is seen in the watched view of the cluster's pods (one watch for every serving node,
        instead of a list per node per check: half the worker's CPU with 200 nodes serving); a pod gone just now
        only delays the end to the next check. "Nothing on it" is never taken from the view: that ends the node, so
        it is read now, as is what waits for it."""
        gpus_on_node = [p.gpus for p in self._pod_watch.current(pods_by_node).get(
            req.node_name, ()) if p.serving]
        if not gpus_on_node:
            on_node = self._evictable(self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={req.node_name}").items)
            on_node = [p for p in on_node if p.metadata.deletion_timestamp is None]
            if not on_node:
                waiting = self.waiting_for(self.core.read_node(req.node_name), req.taint_key) if req.taint_key else 0
                if waiting == 0:
                    return ServeCheckResult(done=True, reason="workload gone from the burst node", pods_on_node=0)
                return ServeCheckResult(done=False, pods_on_node=0)
            gpus_on_node = [gpus_requested(p) for p in on_node]
        if req.return_home:
            need = sum(gpus_on_node)
            free = self.home_free_gpus(req.node_selector)
            if free >= need:
                return ServeCheckResult(done=True, reason=f"home capacity is back ({free} GPU(s) free)",
                                        pods_on_node=len(gpus_on_node))
        return ServeCheckResult(done=False, pods_on_node=len(gpus_on_node))

    def home_free_gpus(self, node_selector: dict[str, str]) -> int:
        """Free GPUs on Ready, schedulable home nodes (no burst location label) matching the selector, from the
        watched view of the cluster (while the watches are not following: a list at most HOME_VIEW_SECONDS old)."""
        nodes = [n for n in self._node_watch.current(home_nodes)
                 if all(n.labels.get(k) == v for k, v in node_selector.items())]
        if not nodes:
            return 0
        used = self._pod_watch.current(gpus_used_by_node)
        return sum(max(0, n.home_gpus - used.get(n.name, 0)) for n in nodes)

    def close(self) -> None:
        """Stop the watches (the worker's runtime closes this on shutdown)."""
        for watched in (self._node_watch, self._pod_watch, self._waiting_watch):
            watched.stop()

    # -- drain ---------------------------------------------------------------------------------------------
    def cordon(self, node_name: str) -> bool:
        """Mark the node unschedulable. False if the node is gone."""
        try:
            self.core.patch_node(node_name, {"spec": {"unschedulable": True}})
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def evict_pods(self, node_name: str, *, gpu_only: bool = False) -> EvictionResult:
        """Evict every evictable pod on the node (``gpu_only``: those requesting GPUs) through the Eviction API. A
        PDB refusal (429) is reported, not forced: the caller retries with backoff."""
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node_name}").items
        if gpu_only:
            pods = [p for p in pods if gpus_requested(p)]
        remaining: list[str] = []
        blocked: dict[str, str] = {}
        for pod in self._evictable(pods):
            meta = pod.metadata
            key = f"{meta.namespace}/{meta.name}"
            remaining.append(key)
            if meta.deletion_timestamp is not None:
                continue  # already going
            body = client.V1Eviction(metadata=client.V1ObjectMeta(name=meta.name, namespace=meta.namespace))
            try:
                self.core.create_namespaced_pod_eviction(str(meta.name), str(meta.namespace), body)
            except client.ApiException as exc:
                if exc.status == 404:
                    remaining.remove(key)
                elif exc.status == 429:
                    match = PDB_PATTERN.search(exc.body or "")
                    blocked[key] = f"blocked by PDB {match.group(1) if match else '(unknown)'}"
                else:
                    raise
        return EvictionResult(remaining=remaining, blocked=blocked)

    @staticmethod
    def _evictable(pods: Iterable[client.V1Pod]) -> list[client.V1Pod]:
        out = []
        for p in pods:
            if _pod_terminal(p):
                continue
            refs = p.metadata.owner_references or []
            if any(r.kind == "DaemonSet" for r in refs):
                continue  # DaemonSet pods go with the node
            if "kubernetes.io/config.mirror" in (p.metadata.annotations or {}):
                continue
            out.append(p)
        return out

    def node_exists(self, node_name: str) -> bool:
        return read_or_none(lambda: self.core.read_node(node_name)) is not None


def _affinity_terms(pod: client.V1Pod) -> list[list[NodeRequirement]]:
    affinity = pod.spec.affinity.node_affinity if pod.spec.affinity else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
    if required is None:
        return []
    return [[NodeRequirement(key=e.key, operator=e.operator, values=list(e.values or []))
             for e in term.match_expressions or []] for term in required.node_selector_terms or []]


def _tolerated(pod: client.V1Pod) -> list[str]:
    keys = []
    for t in pod.spec.tolerations or []:
        if t.effect not in (None, "", "NoSchedule"):
            continue
        keys.append("*" if t.key in (None, "") and t.operator == "Exists" else str(t.key))
    return sorted(set(keys))


def pending_pod(pod: client.V1Pod) -> PendingPod:
    """The facts of a waiting pod that planning needs."""
    meta = pod.metadata
    since = None
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            since = cond.last_transition_time
    return PendingPod(namespace=meta.namespace, name=meta.name, uid=meta.uid or "", gpus=gpus_requested(pod),
                      node_selector=dict(pod.spec.node_selector or {}), affinity_terms=_affinity_terms(pod),
                      tolerations=_tolerated(pod), unschedulable_since=since)
