"""``capacity.provider: aks-nodepools``: home GPU capacity through AKS agent pools (azure-mgmt-containerservice with
azure-identity, imported lazily: a cluster on Karpenter never loads them). Shared notes capacity.md §3, §4, §8.

- Groups: ``agent_pools.list`` / ``get``; a pool is a GPU pool when its VM size is a GPU size of the catalogue, or
  its node labels or taints name ``nvidia.com/gpu``. Its nodes are the Nodes labelled
  ``kubernetes.azure.com/agentpool=<pool>``.
- Every change is GET-modify-PUT of the whole properties (``begin_create_or_update``) with the pool's ETag
  (``If-Match``): a pool changed meanwhile is a 412, re-read and retried (bounded), so a count we did not see is
  never written back. Long-running operations are polled (``Azure-AsyncOperation``) up to a deadline.
- Scale up: ``count`` set to an absolute size (a retried call asks for the same size again: nothing sent). Never
  lowered: a count decrease lets AKS choose the node. Refused with the pool's own autoscaler on (it owns the count).
- Remove exactly one node (the caller cordoned and evicted it, PDB-safe, first): its machine (``machines.list``,
  matched on the node's providerID) through ``begin_delete_machines``; a retried removal is a no-op when the
  machine is gone and waits (retryable error) while the pool's operation still runs. System pools never below 1,
  a pool with its autoscaler never below its minCount.
- Shield a node: cluster-autoscaler's ``scale-down-disabled`` annotation (AKS's autoscaler honours it). Freeze a
  pool: the pool tag ``kubeon.io/disruption-frozen-by=<operation>`` (one operation per pool at a time).
- GPU capacity cap: ``maxCount`` of a pool with its autoscaler on, else the pool tag ``kubeon.io/gpu-limit``
  (scale up never passes it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from typing import Final

from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import ConflictError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity.nodes import HomeNodes
from activities.capacity.nodes import group_node
from activities.capacity.nodes import labelled
from activities.providers.adaptors import LazyImport
from activities.providers.catalog import AZURE_GPU_INSTANCES
from models.aks import AGENTPOOL_LABEL
from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.eks import SCALE_DOWN_DISABLED
from models.eks import GroupScaling
from models.labels import GPU_RESOURCE
from models.locations import OfferingSpec
from models.provisioning import NodeRequirement

azure_identity = LazyImport("azure.identity")
azure_core = LazyImport("azure.core")
azure_exceptions = LazyImport("azure.core.exceptions")
containerservice = LazyImport("azure.mgmt.containerservice")
cs_models = LazyImport("azure.mgmt.containerservice.models")

# A size's spec (GPUs, product); prices per region (eastus when the node names no region).
GPU_SIZES: Final[dict[str, OfferingSpec]] = {o.instance_type: o for o in AZURE_GPU_INSTANCES["eastus"]}
FROZEN_TAG: Final = "kubeon.io/disruption-frozen-by"
LIMIT_TAG: Final = "kubeon.io/gpu-limit"
BUSY: Final = ("Creating", "Updating", "Deleting", "Scaling", "Upgrading", "Starting", "Stopping")
# AKS's own bound on a pool's node count.
MAX_COUNT: Final = 1000
ATTEMPTS: Final = 5
OPERATION_DEADLINE: Final = 600.0
SCOPE: Final = "https://management.azure.com/.default"


def _price(size: str, region: str) -> float | None:
    for spec in AZURE_GPU_INSTANCES.get(region) or AZURE_GPU_INSTANCES["eastus"]:
        if spec.instance_type == size:
            return spec.usd_per_hour
    return None


def _text(value: Any) -> str:
    """An SDK enum (AgentPoolMode.USER) or string as the API spells it ("User")."""
    return str(getattr(value, "value", value) or "")


def vm_id(provider_id: str | None) -> str:
    """The VMSS VM's resource id in a Node's providerID (``azure:///subscriptions/...``), lowercased, or ""."""
    text = provider_id or ""
    return text.removeprefix("azure://").lower() if text.startswith("azure:///subscriptions/") else ""


class AksNodePoolsCapacity(HomeNodes):
    name = "aks-nodepools"
    SHIELD_ANNOTATION = SCALE_DOWN_DISABLED

    def __init__(self, api: client.ApiClient, *, subscription: str, resource_group: str, cluster: str,
                 endpoint_url: str | None = None, ca_file: str | None = None, client_id: str | None = None,
                 polling_interval: float = 5.0, operation_deadline: float = OPERATION_DEADLINE,
                 client_kwargs: dict[str, Any] | None = None,
                 prices: Callable[[str, str], float | None] | None = None) -> None:
        self.core = client.CoreV1Api(api)
        self.subscription = subscription
        self.resource_group = resource_group
        self.cluster = cluster
        self.endpoint_url = endpoint_url  # None: https://management.azure.com
        self.ca_file = ca_file
        self.client_id = client_id or os.environ.get("AZURE_CLIENT_ID") or None
        self.polling_interval = polling_interval
        self.operation_deadline = operation_deadline
        self._kwargs = dict(client_kwargs or {})
        self._price = prices or _price
        self._client: Any = None
        # ETag conflicts met (each re-read and retried), for the record and the tests.
        self.conflicts = 0

    # -- the client --------------------------------------------------------------------------------------------
    def _aks(self) -> Any:
        """ContainerServiceClient; credentials: ManagedIdentityCredential (AKS workload identity through the
        federated token file the webhook mounts, else the managed identity of the VM)."""
        if self._client is None:
            kwargs: dict[str, Any] = {"polling_interval": self.polling_interval, "retry_total": 3, **self._kwargs}
            if self.endpoint_url:
                kwargs["base_url"] = self.endpoint_url
                kwargs["credential_scopes"] = [SCOPE]
            if self.ca_file:
                kwargs["connection_verify"] = self.ca_file
            credential = azure_identity.ManagedIdentityCredential(client_id=self.client_id)
            self._client = containerservice.ContainerServiceClient(credential, self.subscription, **kwargs)
        return self._client

    def _where(self) -> str:
        return f"AKS cluster {self.cluster} (resource group {self.resource_group})"

    def _error(self, what: str, exc: Exception) -> CapacityError:
        err = getattr(exc, "error", None)
        code = str(getattr(err, "code", "") or "")
        status = int(getattr(exc, "status_code", 0) or 0)
        message = f"{what}: {code or type(exc).__name__}: {getattr(err, 'message', None) or exc}"
        if status == 404:
            return GroupNotFoundError(message)
        if status == 412:
            return ConflictError(message)
        final = type(exc).__name__ in ("ClientAuthenticationError", "CredentialUnavailableError") or status in (
            400, 401, 403)
        return CapacityError(message, retryable=not final)

    def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            raise self._error(what, exc) from exc

    def _wait(self, what: str, poller: Any) -> Any:
        """A long-running operation polled until it ends (its error raised) or the deadline passes."""
        try:
            poller.wait(timeout=self.operation_deadline)
            if not poller.done():
                raise CapacityError(f"{what}: still running after {self.operation_deadline:.0f}s")
            return poller.result()
        except CapacityError:
            raise
        except Exception as exc:
            raise self._error(what, exc) from exc

    # -- reading -------------------------------------------------------------------------------------------------
    def _pool(self, group: str) -> Any:
        return self._call(f"reading agent pool {group} of {self._where()}", self._aks().agent_pools.get,
                          self.resource_group, self.cluster, group)

    @staticmethod
    def is_gpu_pool(pool: Any) -> bool:
        p = pool.properties
        spec = GPU_SIZES.get(p.vm_size or "")
        if spec is not None and spec.gpus > 0:
            return True
        if any(k.startswith("nvidia.com/") for k in p.node_labels or {}):
            return True
        return any(t.split("=", 1)[0].split(":", 1)[0] == GPU_RESOURCE for t in p.node_taints or [])

    def list_groups(self) -> list[HomeNodeGroup]:
        pools = [p for p in self._call(f"listing agent pools of {self._where()}", lambda: list(
            self._aks().agent_pools.list(self.resource_group, self.cluster))) if self.is_gpu_pool(p)]
        return self._groups_with_nodes(AGENTPOOL_LABEL, pools, self._group)

    def get_group(self, group: str) -> HomeNodeGroup:
        pool = self._pool(group)
        if not self.is_gpu_pool(pool):
            raise GroupNotFoundError(f"agent pool {group} of {self._where()} has no GPU VM size, labels or taints")
        return self._groups_with_nodes(AGENTPOOL_LABEL, [pool], self._group, group)[0]

    @staticmethod
    def _bounds(p: Any) -> tuple[int, int, int | None]:
        """(min, max, GPU-limit tag) of a pool's properties: the count's floor (1 for System pools, minCount with
        the autoscaler) and ceiling (maxCount with the autoscaler, else our cap, else AKS's own)."""
        per_node = GPU_SIZES[p.vm_size].gpus if p.vm_size in GPU_SIZES else 0
        tag = (p.tags or {}).get(LIMIT_TAG)
        limit = int(tag) if tag and tag.isdigit() else None
        low = 1 if _text(p.mode) == "System" else 0
        if p.enable_auto_scaling:
            return max(low, int(p.min_count or 0)), int(p.max_count or MAX_COUNT), limit
        high = limit // per_node if limit is not None and per_node else MAX_COUNT
        return low, high, limit

    def _group(self, pool: Any, nodes: list[client.V1Node], used: dict[str, int]) -> HomeNodeGroup:
        p, name = pool.properties, str(pool.name)
        size = str(p.vm_size or "")
        spec = GPU_SIZES.get(size)
        members: list[GroupNode] = []
        for node, labels in labelled(nodes, AGENTPOOL_LABEL, name):
            node_size = labels.get("node.kubernetes.io/instance-type", size)
            members.append(group_node(
                node, used, instance=vm_id(node.spec.provider_id if node.spec else None),
                instance_type=node_size,
                capacity_type="spot" if _text(p.scale_set_priority) == "Spot" else "on-demand",
                gpu_product=labels.get("nvidia.com/gpu.product", spec.gpu_product if spec else ""),
                usd_per_hour=self._price(node_size, labels.get("topology.kubernetes.io/region", ""))))
        low, high, limit = self._bounds(p)
        per_node = spec.gpus if spec else 0
        capped = p.enable_auto_scaling or limit is not None
        requirements = [NodeRequirement(key=k, operator="In", values=[v]) for k, v in sorted(
            (p.node_labels or {}).items())]
        requirements.append(NodeRequirement(key=AGENTPOOL_LABEL, operator="In", values=[name]))
        taints = sorted({t.split(":", 1)[0].split("=", 1)[0] for t in p.node_taints or []
                         if t.rsplit(":", 1)[-1] in ("NoSchedule", "NoExecute")})
        return HomeNodeGroup(
            provider=self.name, name=name, gpu_products=[spec.gpu_product] if spec else [],
            gpu_limit=(limit if limit is not None else high * per_node) if capped and per_node else None,
            gpus=sum(m.gpus for m in members), nodes=sorted(members, key=lambda m: m.name),
            requirements=requirements, taints=taints, frozen_by=(p.tags or {}).get(FROZEN_TAG), gpus_per_node=per_node,
            scaling=GroupScaling(min_size=low, max_size=high, desired_size=int(p.count or 0),
                                 auto_scaling_group=_text(p.mode), status=_text(p.provisioning_state),
                                 autoscaler="AKS cluster autoscaler" if p.enable_auto_scaling else ""))

    # -- changing ------------------------------------------------------------------------------------------------
    def _update(self, group: str, what: str, change: Callable[[Any], bool]) -> Any:
        """GET, ``change`` the properties (False: nothing to change), PUT them whole with the ETag read, poll the
        operation. A 412 (the pool changed meanwhile) is re-read and retried, at most ATTEMPTS times."""
        for _ in range(ATTEMPTS):
            pool = self._pool(group)
            if not change(pool.properties):
                return pool
            try:
                poller = self._aks().agent_pools.begin_create_or_update(
                    self.resource_group, self.cluster, group, pool, etag=pool.properties.e_tag,
                    match_condition=azure_core.MatchConditions.IfNotModified)
            except azure_exceptions.ResourceModifiedError:
                self.conflicts += 1
                continue
            except Exception as exc:
                raise self._error(f"{what} (agent pool {group} of {self._where()})", exc) from exc
            return self._wait(f"{what} (agent pool {group} of {self._where()})", poller)
        raise ConflictError(f"{what}: agent pool {group} of {self._where()} kept changing ({ATTEMPTS} ETag "
                            "conflicts)")

    def scale_up(self, group: str, count: int) -> GroupScaling:
        """Set the pool's node count to ``count`` (absolute: a retry asks for the same size); never lowers it,
        never past its bounds. Returns the scaling afterwards."""

        def change(p: Any) -> bool:
            now = int(p.count or 0)
            if count < now:
                raise CapacityError(f"agent pool {group}: count {count} is below its current {now}; nodes are "
                                    "removed one by one (remove_node), never by lowering the count",
                                    retryable=False)
            if p.enable_auto_scaling and count != now:
                raise CapacityError(f"agent pool {group}: its cluster autoscaler is on and owns the count; not set "
                                    "directly", retryable=False)
            low, high, _ = self._bounds(p)
            if not low <= count <= high:
                raise CapacityError(f"agent pool {group}: count {count} is outside {low} .. {high}", retryable=False)
            if count == now:
                return False
            p.count = count
            return True

        p = self._update(group, f"scaling to {count}", change).properties  # the pool the operation left
        low, high, _ = self._bounds(p)
        return GroupScaling(min_size=low, max_size=high, desired_size=int(p.count or 0),
                            auto_scaling_group=_text(p.mode), status=_text(p.provisioning_state))

    def _machine(self, group: str, node: client.V1Node) -> str | None:
        """The pool's machine behind the node (its VMSS VM is the node's providerID), or None when gone."""
        wanted = vm_id(node.spec.provider_id if node.spec else None)
        machines = self._call(f"listing machines of agent pool {group}", lambda: list(
            self._aks().machines.list(self.resource_group, self.cluster, group)))
        for m in machines:
            rid = str(getattr(m.properties, "resource_id", "") or "").lower()
            if (wanted and rid == wanted) or (not wanted and m.name == node.metadata.name):
                return str(m.name)
        return None

    def remove_node(self, group: str, node: str) -> None:
        found = self._node_in_group(node, group, AGENTPOOL_LABEL, "agent pool")
        if found is None:
            return  # gone, with its machine (the cloud controller deletes the Node after the VM)
        # The pool first, then its machines: an operation ending between the two reads shows as busy (retried),
        # never as a machine still there in a pool at rest (that would send a second deleteMachines).
        pool = self._pool(group)
        machine = self._machine(group, found)
        if machine is None:
            return  # removed already (a retried removal whose first answer came late)
        low, _, _ = self._bounds(pool.properties)
        count = int(pool.properties.count or 0)
        if _text(pool.properties.provisioning_state) in BUSY:
            # Ours may be the operation running (an answer lost): never a second request; retried later.
            raise CapacityError(f"agent pool {group} is {_text(pool.properties.provisioning_state)}: removing "
                                f"{node} waits for that operation")
        if count - 1 < low:
            raise CapacityError(f"agent pool {group}: removing {node} would take it below {low} node(s) "
                                f"({_text(pool.properties.mode)} pool, count {count})", retryable=False)
        what = f"deleting machine {machine} (node {node}) of agent pool {group}"
        try:
            poller = self._call(what, self._aks().agent_pools.begin_delete_machines, self.resource_group,
                                self.cluster, group,
                                cs_models.AgentPoolDeleteMachinesParameter(machine_names=[machine]))
            self._wait(what, poller)
        except CapacityError:
            # The answer may be lost after AKS acted on it: re-read before saying it failed.
            if self._machine(group, found) is None:
                return
            raise

    def _tag(self, group: str, what: str, key: str, value: str | None, unless: Callable[[str | None], bool]) -> None:
        def change(p: Any) -> bool:
            held = (p.tags or {}).get(key)
            if unless(held):
                return False
            tags = dict(p.tags or {})
            if value is None:
                tags.pop(key, None)
            else:
                tags[key] = value
            p.tags = tags
            return True

        self._update(group, what, change)

    def freeze(self, group: str, operation: str) -> None:
        def held(holder: str | None) -> bool:
            if holder and holder != operation:
                raise FrozenByOtherError(f"agent pool {group} is held frozen by operation {holder}")
            return holder == operation

        self._tag(group, f"freezing for {operation}", FROZEN_TAG, operation, held)

    def unfreeze(self, group: str, operation: str) -> None:
        try:
            self._tag(group, f"unfreezing for {operation}", FROZEN_TAG, None, lambda holder: holder != operation)
        except GroupNotFoundError:
            return

    def node_gone(self, group: str, node: str) -> bool:
        return self._node(node) is None

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        pool = self._pool(group)
        p = pool.properties
        spec = GPU_SIZES.get(p.vm_size or "")
        if spec is None or not spec.gpus:
            raise CapacityError(f"agent pool {group}: GPUs per node unknown for {p.vm_size}", retryable=False)
        previous = self._group(pool, [], {}).gpu_limit
        if gpus is not None and (gpus < 0 or gpus // spec.gpus < max(int(p.count or 0), self._bounds(p)[0])):
            raise CapacityError(f"agent pool {group}: {gpus} GPUs ({gpus // spec.gpus} nodes) is below its count "
                                f"{p.count} or minimum", retryable=False)
        if p.enable_auto_scaling:
            if gpus is None:
                raise CapacityError(f"agent pool {group}: a pool with its autoscaler on is capped by its maxCount; "
                                    "None cannot be set", retryable=False)
            nodes = gpus // spec.gpus

            def change(q: Any) -> bool:
                if q.max_count == nodes:
                    return False
                q.max_count = nodes
                return True

            self._update(group, f"capping at {nodes} nodes", change)
            return previous
        self._tag(group, f"capping at {gpus} GPUs", LIMIT_TAG, None if gpus is None else str(gpus),
                  lambda held: held == (None if gpus is None else str(gpus)))
        return previous

