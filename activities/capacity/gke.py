"""``capacity.provider: gke-nodepools``: home GPU capacity through GKE node pools (google-cloud-container's REST
transport and google-cloud-compute for each pool's managed instance groups, both imported lazily). Shared notes
capacity.md §3, §4, §7.

- Groups: ``list_node_pools``; a pool is a GPU group when its machine type is a GPU type of the catalogue, it has
  accelerators, or its taints name ``nvidia.com/gpu``. Its nodes are the Nodes labelled
  ``cloud.google.com/gke-nodepool=<pool>``, each mapped to its VM by providerID ``gce://<project>/<zone>/<vm>``.
  Sizes are per zone: each zone's MIG (``NodePool.instance_group_urls``) read with ``InstanceGroupManagers.get``.
- Scale up: ``set_node_pool_size(node_count=N)``, N **per zone**, an absolute size (a retry finds it reached and
  sends nothing). N is never below any zone's current size (setSize would shrink that zone and let GKE choose the
  node). With the pool's autoscaling enabled the autoscaler owns the size: nothing is set.
- Remove exactly one node (the caller cordoned and evicted it, PDB-safe, first): compute
  ``InstanceGroupManagers.delete_instances(instances=["zones/<z>/instances/<vm>"])`` on its zone's MIG (targetSize
  goes down by one), sent once (no SDK resend), confirmed with ``list_managed_instances`` (the VM DELETING or gone);
  a retried removal reads the MIG first and is a no-op when the VM has left it or is being deleted.
- Container operations polled with ``get_operation`` until DONE, ``error`` checked. One operation per cluster at a
  time: ours are serialized per cluster in this process, and a ``CLUSTER_ALREADY_HAS_OPERATION`` (someone else's)
  or 429 is retried after an exponential back-off, a bounded number of times.
- Shield a node: ``cluster-autoscaler.kubernetes.io/scale-down-disabled`` (GKE's autoscaler honours it). Freeze a
  group: the pool's Nodes annotated ``gpu.kubeon.io/disruption-frozen-by=<operation>`` (one operation per group).
- GPU cap: not set through this provider (a pool's bound is its autoscaling's max, which is the user's).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from typing import ClassVar
from typing import Final

from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity.nodes import HomeNodes
from activities.capacity.nodes import group_node
from activities.capacity.nodes import labelled
from activities.providers.adaptors import LazyImport
from activities.providers.catalog import GCP_GPU_INSTANCES
from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.eks import SCALE_DOWN_DISABLED
from models.eks import GroupScaling
from models.gke import FROZEN_BY_ANNOTATION
from models.gke import NODEPOOL_LABEL
from models.gke import region_of
from models.labels import GPU_RESOURCE
from models.provisioning import NodeRequirement

container_v1 = LazyImport("google.cloud.container_v1")
compute_v1 = LazyImport("google.cloud.compute_v1")
google_exceptions = LazyImport("google.api_core.exceptions")
google_credentials = LazyImport("google.auth.credentials")

PROVIDER_ID: Final = re.compile(r"^gce://(?P<project>[^/]+)/(?P<zone>[^/]+)/(?P<instance>[^/]+)$")
BUSY: Final = "CLUSTER_ALREADY_HAS_OPERATION"
# GKE's quota of nodes per node pool per zone: a pool without autoscaling has no maximum of its own.
MAX_NODES_PER_ZONE: Final = 1000
# Errors retrying cannot help with (by the api_core exception's class name).
FINAL: Final = ("PermissionDenied", "Unauthenticated", "Forbidden", "Unauthorized", "InvalidArgument",
                "MethodNotImplemented", "DefaultCredentialsError")


def vm_of(provider_id: str | None) -> tuple[str, str]:
    """(zone, VM name) in a Node's providerID (``gce://<project>/<zone>/<vm>``), or ("", "")."""
    found = PROVIDER_ID.match(provider_id or "")
    return (found.group("zone"), found.group("instance")) if found else ("", "")


def _mig(url: str) -> tuple[str, str]:
    """(zone, MIG name) of an instance group URL (``.../zones/<z>/instanceGroupManagers/<mig>``)."""
    return url.split("/zones/", 1)[1].split("/", 1)[0], url.rsplit("/", 1)[-1]


class GkeNodePoolsCapacity(HomeNodes):
    name = "gke-nodepools"
    SHIELD_ANNOTATION = SCALE_DOWN_DISABLED
    # One container operation per GKE cluster at a time from this process (GKE refuses a second one).
    _cluster_locks: ClassVar[dict[str, threading.Lock]] = {}
    _locks_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, api: client.ApiClient, *, project: str, location: str, cluster: str,
                 endpoint_url: str | None = None, prices: Callable[[str], float | None] | None = None,
                 backoff: tuple[float, float] = (1.0, 30.0), attempts: int = 8, poll_seconds: float = 1.0,
                 operation_deadline: float = 900.0, confirm_seconds: float = 60.0) -> None:
        self.core = client.CoreV1Api(api)
        self.project, self.location, self.cluster = project, location, cluster
        self.endpoint_url = endpoint_url
        specs = {s.instance_type: s for s in GCP_GPU_INSTANCES.get(region_of(location))
                 or GCP_GPU_INSTANCES["us-central1"]}
        self.gpu_types = specs
        self._price = prices or (lambda t: specs[t].usd_per_hour if t in specs else None)
        self._backoff, self._attempts, self._poll = backoff, attempts, poll_seconds
        self._deadline, self._confirm = operation_deadline, confirm_seconds
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"

    # -- clients ---------------------------------------------------------------------------------------------------
    def _client(self, kind: str) -> Any:
        """The REST client (``container`` or ``migs``): on GKE with the pod's workload identity (the default
        credentials); against an emulator (tests, make dev) with anonymous credentials (no Google token leaves)."""
        with self._lock:
            if kind not in self._clients:
                options: dict[str, Any] = {"api_endpoint": self.endpoint_url} if self.endpoint_url else {}
                creds = google_credentials.AnonymousCredentials() if self.endpoint_url else None
                make = (container_v1.ClusterManagerClient if kind == "container"
                        else compute_v1.InstanceGroupManagersClient)
                self._clients[kind] = make(credentials=creds, transport="rest", client_options=options)
            return self._clients[kind]

    def _gcp(self, what: str, call: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return call(**kwargs)
        except Exception as exc:
            raise self._error(what, exc) from exc

    @staticmethod
    def _error(what: str, exc: Exception) -> CapacityError:
        kind = type(exc).__name__
        if kind == "NotFound":
            return GroupNotFoundError(f"{what}: {exc}")
        return CapacityError(f"{what}: {exc}", retryable=kind not in FINAL)

    def _busy(self, exc: Exception) -> bool:
        """Another operation runs on the cluster (GKE's 400 CLUSTER_ALREADY_HAS_OPERATION) or the concurrent
        operations quota is exhausted (429): retried after a back-off."""
        return (isinstance(exc, google_exceptions.TooManyRequests)
                or (isinstance(exc, google_exceptions.GoogleAPICallError) and getattr(exc, "reason", "") == BUSY))

    def _cluster_lock(self) -> threading.Lock:
        with self._locks_lock:
            return self._cluster_locks.setdefault(f"{self.project}/{self.location}/{self.cluster}",
                                                  threading.Lock())

    def _operation(self, what: str, send: Callable[[], Any], needed: Callable[[], bool]) -> None:
        """Send one container mutation and wait until its operation is DONE; while the cluster is busy with
        another operation (or the quota is exhausted) back off and try again, first asking ``needed`` (a retry
        whose change is there already sends nothing)."""
        delay, cap = self._backoff
        with self._cluster_lock():
            for attempt in range(self._attempts):
                if attempt and not needed():
                    return
                try:
                    op = send()
                except Exception as exc:
                    if not self._busy(exc) or attempt == self._attempts - 1:
                        raise self._error(what, exc) from exc
                    time.sleep(delay)
                    delay = min(delay * 2, cap)
                    continue
                self._wait(what, op)
                return

    def _wait(self, what: str, op: Any) -> None:
        """Poll ``get_operation`` until DONE (bounded), then check its ``error``."""
        name = f"projects/{self.project}/locations/{self.location}/operations/{op.name}"
        done = container_v1.Operation.Status.DONE
        deadline = time.monotonic() + self._deadline
        while op.status != done:
            if time.monotonic() > deadline:
                raise CapacityError(f"{what}: operation {op.name} not DONE after {self._deadline:.0f}s")
            time.sleep(self._poll)
            op = self._gcp(f"{what}: reading operation {op.name}", self._client("container").get_operation,
                           name=name)
        if op.error and op.error.message:
            raise CapacityError(f"{what}: operation {op.name} failed: {op.error.message}")

    # -- reading ---------------------------------------------------------------------------------------------------
    def _pool(self, group: str) -> Any:
        return self._gcp(f"reading node pool {group} of GKE cluster {self.cluster}",
                         self._client("container").get_node_pool, name=f"{self.parent}/nodePools/{group}")

    def _zone_sizes(self, pool: Any) -> dict[str, int]:
        """Each zone's MIG target size (a node pool's count is per zone)."""
        sizes = {}
        for url in pool.instance_group_urls:
            zone, mig = _mig(url)
            sizes[zone] = int(self._gcp(f"reading instance group {mig} of node pool {pool.name}",
                                        self._client("migs").get, project=self.project, zone=zone,
                                        instance_group_manager=mig).target_size)
        return sizes

    def is_gpu_pool(self, pool: Any) -> bool:
        spec = self.gpu_types.get(pool.config.machine_type)
        if (spec and spec.gpus > 0) or list(pool.config.accelerators):
            return True
        return any(t.key == GPU_RESOURCE for t in pool.config.taints)

    def list_groups(self) -> list[HomeNodeGroup]:
        pools = [p for p in self._gcp(f"listing node pools of GKE cluster {self.cluster}",
                                      self._client("container").list_node_pools, parent=self.parent).node_pools
                 if self.is_gpu_pool(p)]
        return self._groups_with_nodes(NODEPOOL_LABEL, pools, self._group)

    def get_group(self, group: str) -> HomeNodeGroup:
        pool = self._pool(group)
        if not self.is_gpu_pool(pool):
            raise GroupNotFoundError(f"node pool {group} of GKE cluster {self.cluster} has no GPU machine type, "
                                     "accelerators or taints")
        return self._groups_with_nodes(NODEPOOL_LABEL, [pool], self._group, group)[0]

    def _limits(self, pool: Any, zones: int) -> tuple[int, int | None]:
        """The pool's total (min, max) nodes from its autoscaling (per zone unless total_*), or (0, None)."""
        a = pool.autoscaling
        if not a or not a.enabled:
            return 0, None
        if a.total_max_node_count:
            return int(a.total_min_node_count), int(a.total_max_node_count)
        return int(a.min_node_count) * zones, int(a.max_node_count) * zones

    def _group(self, pool: Any, nodes: list[client.V1Node], used: dict[str, int]) -> HomeNodeGroup:
        machine = str(pool.config.machine_type)
        spec = self.gpu_types.get(machine)
        members: list[GroupNode] = []
        frozen: str | None = None
        for node, labels in labelled(nodes, NODEPOOL_LABEL, pool.name):
            frozen = frozen or (node.metadata.annotations or {}).get(FROZEN_BY_ANNOTATION)
            members.append(group_node(
                node, used, instance=vm_of(node.spec.provider_id if node.spec else None)[1],
                instance_type=labels.get("node.kubernetes.io/instance-type", machine),
                capacity_type="SPOT" if labels.get("cloud.google.com/gke-spot") == "true" else "ON_DEMAND",
                gpu_product=labels.get("nvidia.com/gpu.product", spec.gpu_product if spec else ""),
                usd_per_hour=self._price(machine)))
        sizes = self._zone_sizes(pool)
        low, high = self._limits(pool, len(sizes))
        requirements = [NodeRequirement(key=k, operator="In", values=[v])
                        for k, v in sorted(dict(pool.config.labels).items())]
        requirements.append(NodeRequirement(key=NODEPOOL_LABEL, operator="In", values=[pool.name]))
        per_node = spec.gpus if spec else 0
        return HomeNodeGroup(
            provider=self.name, name=pool.name, gpu_products=[spec.gpu_product] if spec else [],
            gpu_limit=high * per_node if high is not None and per_node else None,
            gpus=sum(m.gpus for m in members), nodes=sorted(members, key=lambda m: m.name), gpus_per_node=per_node,
            requirements=requirements, frozen_by=frozen,
            taints=sorted({t.key for t in pool.config.taints if t.effect in (
                container_v1.NodeTaint.Effect.NO_SCHEDULE, container_v1.NodeTaint.Effect.NO_EXECUTE)}),
            scaling=GroupScaling(min_size=low, max_size=high if high is not None else MAX_NODES_PER_ZONE * len(sizes),
                                 desired_size=sum(sizes.values()),
                                 auto_scaling_group=",".join(f"{z}={n}" for z, n in sorted(sizes.items())),
                                 status=container_v1.NodePool.Status(pool.status).name,
                                 autoscaler="GKE node pool autoscaling" if high is not None else "",
                                 zone_sizes=sizes))

    # -- changing --------------------------------------------------------------------------------------------------
    def scale_up(self, group: str, desired: int) -> GroupScaling:
        """Grow the pool to at least ``desired`` nodes in all with one setSize of N per zone, N the smallest that
        reaches ``desired`` and shrinks no zone (a pool at ``desired`` or above already: nothing sent, so a retry
        is a no-op; nodes are removed one by one with remove_node, never by a resize that lets GKE choose).
        Returns the scaling afterwards (desired_size: the pool's total then)."""
        pool = self._pool(group)
        sizes = self._zone_sizes(pool)
        if pool.autoscaling and pool.autoscaling.enabled:
            raise CapacityError(f"node pool {group}: its autoscaling is enabled and owns its size; not set directly",
                                retryable=False)
        per_zone = max(math.ceil(desired / max(len(sizes), 1)), *sizes.values(), 0)
        status = container_v1.NodePool.Status(pool.status).name
        scaling = GroupScaling(min_size=0, max_size=per_zone * len(sizes), desired_size=per_zone * len(sizes),
                               auto_scaling_group=",".join(f"{z}={per_zone}" for z in sorted(sizes)), status=status)
        if sum(sizes.values()) >= desired or all(n == per_zone for n in sizes.values()):
            return scaling.model_copy(update={"desired_size": sum(sizes.values()), "auto_scaling_group": ",".join(
                f"{z}={n}" for z, n in sorted(sizes.items()))})
        request = container_v1.SetNodePoolSizeRequest(name=f"{self.parent}/nodePools/{group}", node_count=per_zone)
        self._operation(f"resizing node pool {group} of GKE cluster {self.cluster} to {per_zone} per zone",
                        lambda: self._client("container").set_node_pool_size(request=request, retry=None),
                        lambda: any(n != per_zone for n in self._zone_sizes(self._pool(group)).values()))
        return scaling

    def _managed(self, zone: str, mig: str) -> dict[str, str]:
        """The MIG's VMs: name -> current action (NONE, CREATING, DELETING, ...)."""
        found = self._gcp(f"listing the instances of instance group {mig}",
                          self._client("migs").list_managed_instances, project=self.project, zone=zone,
                          instance_group_manager=mig)
        return {str(m.name or str(m.instance).rsplit("/", 1)[-1]): str(m.current_action) for m in found}

    def remove_node(self, group: str, node: str) -> None:
        found = self._node_in_group(node, group, NODEPOOL_LABEL, "node pool")
        if found is None:
            return  # gone, with its VM (the cloud controller deletes the Node after the VM)
        zone, vm = vm_of(found.spec.provider_id if found.spec else None)
        if not vm:
            raise CapacityError(f"node {node} has no GCE providerID (gce://<project>/<zone>/<vm>): "
                                f"{found.spec.provider_id if found.spec else None!r}", retryable=False)
        migs = [m for _, m in (_mig(u) for u in self._pool(group).instance_group_urls if _mig(u)[0] == zone)]
        if not migs:
            raise CapacityError(f"node pool {group} has no instance group in zone {zone} (node {node})",
                                retryable=False)
        mig = migs[0]
        if self._managed(zone, mig).get(vm, "DELETING") == "DELETING":
            return  # removed already (a retried removal whose first answer came late)
        request = compute_v1.InstanceGroupManagersDeleteInstancesRequest(
            instances=[f"zones/{zone}/instances/{vm}"], skip_instances_on_validation_error=True)
        try:
            self._client("migs").delete_instances_unary(
                project=self.project, zone=zone, instance_group_manager=mig, retry=None,
                instance_group_managers_delete_instances_request_resource=request)
        except Exception as exc:
            # The answer may be lost after GCE acted on it: re-read before saying it failed.
            if self._managed(zone, mig).get(vm, "DELETING") == "DELETING":
                return
            raise self._error(f"deleting {vm} (node {node}) from instance group {mig} of node pool {group}",
                              exc) from exc
        # The operation is DONE when the deletion is *scheduled*: confirm the VM is leaving the MIG.
        deadline = time.monotonic() + self._confirm
        while self._managed(zone, mig).get(vm, "DELETING") != "DELETING":
            if time.monotonic() > deadline:
                raise CapacityError(f"node pool {group}: {vm} (node {node}) still in instance group {mig} "
                                    f"{self._confirm:.0f}s after its deleteInstances")
            time.sleep(self._poll)

    def node_gone(self, group: str, node: str) -> bool:
        return self._node(node) is None

    def _annotate(self, group: str, value: str | None, when: Callable[[str | None], bool]) -> None:
        for node in self.core.list_node(label_selector=f"{NODEPOOL_LABEL}={group}").items:
            if when((node.metadata.annotations or {}).get(FROZEN_BY_ANNOTATION)):
                try:
                    self.core.patch_node(str(node.metadata.name),
                                         {"metadata": {"annotations": {FROZEN_BY_ANNOTATION: value}}})
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise CapacityError(f"annotating node {node.metadata.name} of node pool {group}: "
                                            f"{exc.status} {exc.reason}") from exc

    def freeze(self, group: str, operation: str) -> None:
        holders = {(n.metadata.annotations or {}).get(FROZEN_BY_ANNOTATION)
                   for n in self.core.list_node(label_selector=f"{NODEPOOL_LABEL}={group}").items} - {None}
        if holders - {operation}:
            raise FrozenByOtherError(f"node pool {group} is held frozen by operation "
                                     f"{sorted(h for h in holders if h and h != operation)[0]}")
        self._annotate(group, operation, lambda holder: holder != operation)

    def unfreeze(self, group: str, operation: str) -> None:
        self._annotate(group, None, lambda holder: holder == operation)

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        raise CapacityError(f"node pool {group}: a GKE node pool's GPUs are bounded by its autoscaling maximum, "
                            "which stays the user's; not set by the optimizer", retryable=False)
