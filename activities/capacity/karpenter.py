"""``capacity.provider: karpenter``: home GPU capacity through Karpenter NodePools and NodeClaims (karpenter.sh/v1).

Only what R5.1 grants is used: NodePools and NodeClaims get/list/patch/delete, Nodes get/list/patch, pods list.
- A node is removed by deleting its NodeClaim (Karpenter drains what is left and deletes the instance and the
  Node; manual deletion is not budget-limited). In a static NodePool (``spec.replicas``) a deleted NodeClaim is
  re-created, so there ``replicas`` is decremented instead, once per node (recorded on the pool), after the node
  was emptied: Karpenter's static scale-down removes empty nodes first (designs/static-capacity.md).
- A node is shielded by the node annotation ``karpenter.sh/do-not-disrupt: "true"``; a user's own is never removed.
- A pool's disruption is frozen by appending the budget ``{nodes: "0"}`` (behavioural, no drift) and marking the
  pool with the operation; unfreezing removes that one entry, so the user's budgets stay as they were.
- GPU capacity is capped or opened through ``limits["nvidia.com/gpu"]`` (behavioural, existing nodes untouched).
- The instance types a pool may launch (``HomeNodeGroup.launchable``, for a dollar budget) are known only when its
  requirements name them (``node.kubernetes.io/instance-type In``): otherwise Karpenter may launch any type of its
  cloud that fits, and the catalogue is no complete list of those. Each is priced at the highest the product knows:
  the catalogue's on-demand list price (GCP: the highest of its regions; the AWS catalogue has one price per type;
  a spot offering costs less), or more when one of the pool's nodes of that type carries a higher price label; a
  type the catalogue lacks, at the price an on-demand node of the pool of that type shows. A type without either
  is ``unpriced``.
Every change is a merge patch carrying the object's resourceVersion: a concurrent change is a 409, re-read and
retried (a few times, then ``ConflictError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any
from typing import Final
from typing import TypeVar
from typing import cast

from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import ConflictError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity.nodes import HomeNodes
from activities.capacity.nodes import group_node
from activities.capacity.nodes import labelled
from activities.providers.catalog import AWS_GPU_INSTANCES
from activities.providers.catalog import GCP_GPU_INSTANCES
from models.capacity import DO_NOT_DISRUPT
from models.capacity import FREEZE_BUDGET
from models.capacity import FROZEN_BY_ANNOTATION
from models.capacity import NODEPOOL_LABEL
from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.capacity import InstanceTypePrice
from models.capacity import LaunchingClaim
from models.eks import GroupScaling
from models.labels import GPU_RESOURCE
from models.labels import LABEL_INSTANCE_TYPE
from models.locations import OfferingSpec
from models.provisioning import NodeRequirement

GROUP = "karpenter.sh"
VERSION = "v1"
# Requirement keys that make a NodePool a GPU pool (NVIDIA GPU feature discovery, the kwok provider's labels, the
# AWS/EKS Auto Mode/Azure/GKE providers' GPU keys).
GPU_REQUIREMENT_KEYS: Final = frozenset({
    "nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.present",
    "karpenter.k8s.aws/instance-gpu-name", "karpenter.k8s.aws/instance-gpu-count",
    "karpenter.k8s.aws/instance-gpu-manufacturer", "eks.amazonaws.com/instance-gpu-name",
    "eks.amazonaws.com/instance-gpu-count", "karpenter.azure.com/sku-gpu-name",
    "karpenter.azure.com/sku-gpu-count", "cloud.google.com/gke-accelerator",
})
PRODUCT_KEY: Final = "nvidia.com/gpu.product"
# The price the kwok provider (and eks-node-viewer) puts on a node: the offering's $/h.
PRICE_LABEL: Final = "eks-node-viewer/instance-price"
# Ours, beside Karpenter's keys: which do-not-disrupt we set, which node a static pool's replicas went down for.
SCALED_DOWN_FOR_ANNOTATION: Final = "gpu.kubeon.io/replicas-decremented-for"
CATALOG_PRICES: Final = {s.instance_type: s.usd_per_hour
                         for s in (*AWS_GPU_INSTANCES, *GCP_GPU_INSTANCES.get("us-central1", ()))}


def _catalog() -> dict[str, OfferingSpec]:
    """Each catalogued GPU instance type at the highest list price of the catalogue's regions (conservative)."""
    out: dict[str, OfferingSpec] = {}
    for spec in (*AWS_GPU_INSTANCES, *(s for specs in GCP_GPU_INSTANCES.values() for s in specs)):
        if spec.instance_type not in out or spec.usd_per_hour > out[spec.instance_type].usd_per_hour:
            out[spec.instance_type] = spec
    return out


CATALOG: Final = _catalog()
CONFLICT_RETRIES: Final = 5
T = TypeVar("T")


def _status(exc: client.ApiException) -> int:
    return int(exc.status or 0)


def is_gpu_pool(pool: dict[str, Any]) -> bool:
    spec = pool.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    if any(r.get("key") in GPU_REQUIREMENT_KEYS for r in template.get("requirements") or []):
        return True
    if GPU_RESOURCE in (spec.get("limits") or {}):
        return True
    return any(t.get("key") == GPU_RESOURCE for t in template.get("taints") or [])


def _quantity_int(value: Any) -> int | None:
    if value is None:
        return None
    text = str(value)
    try:
        return int(text)
    except ValueError:
        if text.endswith("k"):
            return int(text[:-1]) * 1000
        raise CapacityError(f"GPU quantity {text!r} is not a whole number", retryable=False) from None


class KarpenterCapacity(HomeNodes):
    name = "karpenter"
    SHIELD_ANNOTATION = DO_NOT_DISRUPT

    def __init__(self, api: client.ApiClient, *, prices: Callable[[str], float | None] | None = None,
                 catalog: dict[str, OfferingSpec] | None = None) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self._price = prices or CATALOG_PRICES.get
        self._catalog = CATALOG if catalog is None else catalog

    # -- reading ---------------------------------------------------------------------------------------------------
    def _pool(self, group: str) -> dict[str, Any]:
        try:
            pool = cast(dict[str, Any], self.custom.get_cluster_custom_object(GROUP, VERSION, "nodepools", group))
        except client.ApiException as exc:
            if _status(exc) == 404:
                raise GroupNotFoundError(f"NodePool {group} does not exist") from exc
            raise CapacityError(f"reading NodePool {group}: {exc.status} {exc.reason}",
                                retryable=_status(exc) not in (401, 403)) from exc
        return pool

    def _claims(self, group: str) -> list[dict[str, Any]]:
        try:
            found = self.custom.list_cluster_custom_object(GROUP, VERSION, "nodeclaims",
                                                           label_selector=f"{NODEPOOL_LABEL}={group}")
        except client.ApiException as exc:
            raise CapacityError(f"listing NodeClaims of NodePool {group}: {exc.status} {_reason(exc)}",
                                retryable=_status(exc) not in (401, 403)) from exc
        return list(cast(dict[str, Any], found).get("items") or [])

    def list_groups(self) -> list[HomeNodeGroup]:
        try:
            pools = cast(dict[str, Any], self.custom.list_cluster_custom_object(GROUP, VERSION, "nodepools"))
        except client.ApiException as exc:
            if _status(exc) == 404:
                return []  # Karpenter's CRDs are not installed: no home groups
            raise CapacityError(f"listing NodePools: {exc.status} {_reason(exc)}",
                                retryable=_status(exc) not in (401, 403)) from exc
        gpu_pools = [p for p in pools.get("items") or [] if is_gpu_pool(p)]
        if not gpu_pools:
            return []
        try:
            claims = cast(dict[str, Any], self.custom.list_cluster_custom_object(GROUP, VERSION, "nodeclaims"))
        except client.ApiException as exc:
            raise CapacityError(f"listing NodeClaims: {exc.status} {_reason(exc)}",
                                retryable=_status(exc) not in (401, 403)) from exc
        nodes = self.core.list_node(label_selector=NODEPOOL_LABEL).items
        used = self._gpus_used({str(n.metadata.name) for n in nodes})
        return [self._group(p, list(claims.get("items") or []), nodes, used) for p in gpu_pools]

    def get_group(self, group: str) -> HomeNodeGroup:
        pool = self._pool(group)
        if not is_gpu_pool(pool):
            raise GroupNotFoundError(f"NodePool {group} has no GPU requirements, limits or taints")
        nodes = self.core.list_node(label_selector=f"{NODEPOOL_LABEL}={group}").items
        return self._group(pool, self._claims(group), nodes, self._gpus_used({str(n.metadata.name) for n in nodes}))

    def _group(self, pool: dict[str, Any], claims: list[dict[str, Any]], nodes: list[client.V1Node],
               used: dict[str, int]) -> HomeNodeGroup:
        name = pool["metadata"]["name"]
        spec = pool.get("spec") or {}
        template = (spec.get("template") or {}).get("spec") or {}
        products = sorted({v for r in template.get("requirements") or []
                           if r.get("key") == PRODUCT_KEY and r.get("operator") == "In" for v in r.get("values") or []})
        claim_of = {}
        launching: list[LaunchingClaim] = []
        for c in claims:
            if (c.get("metadata", {}).get("labels") or {}).get(NODEPOOL_LABEL) != name:
                continue
            node_name = (c.get("status") or {}).get("nodeName")
            if node_name:
                claim_of[node_name] = c["metadata"]["name"]
            conditions = {k.get("type"): k for k in (c.get("status") or {}).get("conditions") or []}
            if (conditions.get("Initialized") or {}).get("status") == "True" or c["metadata"].get("deletionTimestamp"):
                continue
            launched = conditions.get("Launched") or {}
            failed = (f"{launched.get('reason', '')}: {launched.get('message', '')}".strip(": ")
                      if launched.get("status") == "False" and launched.get("reason") not in (None, "", "Unknown")
                      else "")
            created = c["metadata"].get("creationTimestamp")
            launching.append(LaunchingClaim(
                name=c["metadata"]["name"], created_at=datetime.fromisoformat(created.replace("Z", "+00:00"))
                if created else None, registered=(conditions.get("Registered") or {}).get("status") == "True",
                failed=failed))
        members: list[GroupNode] = []
        for node, labels in labelled(nodes, NODEPOOL_LABEL, name):
            instance_type = labels.get("node.kubernetes.io/instance-type", "")
            price: float | None = None
            if PRICE_LABEL in labels:
                try:
                    price = round(float(labels[PRICE_LABEL]), 4)
                except ValueError:
                    price = None
            if price is None and instance_type:
                price = self._price(instance_type)
            members.append(group_node(
                node, used, nodeclaim=claim_of.get(node.metadata.name, ""), instance_type=instance_type,
                capacity_type=labels.get("karpenter.sh/capacity-type", ""), gpu_product=labels.get(PRODUCT_KEY, ""),
                usd_per_hour=price))
        resources = (pool.get("status") or {}).get("resources") or {}
        annotations = pool["metadata"].get("annotations") or {}
        requirements = [NodeRequirement(key=r["key"], operator=r["operator"], values=list(r.get("values") or []))
                        for r in template.get("requirements") or []]
        launchable, unpriced = self._launchable(requirements, members)
        return HomeNodeGroup(
            provider=self.name, name=name, gpu_products=products,
            gpu_limit=_quantity_int((spec.get("limits") or {}).get(GPU_RESOURCE)),
            gpus=_quantity_int(resources.get(GPU_RESOURCE)) or sum(m.gpus for m in members),
            replicas=spec.get("replicas"), budgets=list((spec.get("disruption") or {}).get("budgets") or []),
            frozen_by=annotations.get(FROZEN_BY_ANNOTATION), nodes=sorted(members, key=lambda m: m.name),
            requirements=requirements,
            taints=sorted({t["key"] for t in template.get("taints") or []
                           if t.get("effect") in ("NoSchedule", "NoExecute")}),
            launching=launching, launchable=launchable, unpriced=unpriced)

    def _launchable(self, requirements: list[NodeRequirement],
                    members: list[GroupNode]) -> tuple[list[InstanceTypePrice] | None, list[str]]:
        """The instance types the pool's requirements name (None: it names none), priced, and those the product
        has no price for. Its other requirements are not judged: whether a GPU product or count requirement
        filters instance types depends on the cloud provider's labels (on AWS ``nvidia.com/gpu.product`` is no
        well-known label, so Karpenter puts it on the node of whatever type it picks); a type kept in excess only
        lowers the cap, one left out wrongly would understate the worst case."""
        named: set[str] | None = None
        for r in requirements:
            if r.key == LABEL_INSTANCE_TYPE and r.operator == "In":
                named = set(r.values) if named is None else named & set(r.values)
        if named is None:
            return None, []
        for r in requirements:
            if r.key == LABEL_INSTANCE_TYPE and r.operator == "NotIn":
                named -= set(r.values)
        priced: list[InstanceTypePrice] = []
        unpriced: list[str] = []
        for name in sorted(named):
            spec = self._catalog.get(name)
            seen = [m for m in members if m.instance_type == name and m.usd_per_hour is not None and m.gpus > 0]
            if spec is not None:
                usd = max([spec.usd_per_hour, *(m.usd_per_hour or 0.0 for m in seen)])
                priced.append(InstanceTypePrice(instance_type=name, gpus=spec.gpus, usd_per_hour=usd))
            elif on_demand := [m for m in seen if m.capacity_type == "on-demand"]:
                # Not catalogued, but an on-demand node of the pool shows its price (a spot node's would understate
                # the worst case): the highest $/GPU-hour of those.
                top = max(on_demand, key=lambda m: (m.usd_per_hour or 0.0) / m.gpus)
                priced.append(InstanceTypePrice(instance_type=name, gpus=top.gpus,
                                                usd_per_hour=top.usd_per_hour or 0.0))
            else:
                unpriced.append(name)
        return priced, unpriced

    # -- changing --------------------------------------------------------------------------------------------------
    def _patch_pool(self, group: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any]:
        """Read the pool, let ``change`` compute a merge patch (None: nothing to do), apply it with the read
        resourceVersion; on 409 read again. Returns the pool as last read or patched."""
        for _ in range(CONFLICT_RETRIES):
            pool = self._pool(group)
            patch = change(pool)
            if patch is None:
                return pool
            patch.setdefault("metadata", {})["resourceVersion"] = pool["metadata"]["resourceVersion"]
            try:
                return cast(dict[str, Any], self.custom.patch_cluster_custom_object(
                    GROUP, VERSION, "nodepools", group, patch))
            except client.ApiException as exc:
                if _status(exc) == 409:
                    continue
                if _status(exc) == 404:
                    raise GroupNotFoundError(f"NodePool {group} does not exist") from exc
                raise CapacityError(f"patching NodePool {group}: {exc.status} {_reason(exc)}",
                                    retryable=_status(exc) >= 500 or _status(exc) == 429) from exc
        raise ConflictError(f"NodePool {group} kept changing while we patched it ({CONFLICT_RETRIES} tries)")


    def _claim_for(self, group: str, node: str, provider_id: str | None) -> dict[str, Any] | None:
        for c in self._claims(group):
            status = c.get("status") or {}
            if status.get("nodeName") == node or (provider_id and status.get("providerID") == provider_id):
                return c
        return None

    def remove_node(self, group: str, node: str) -> None:
        pool = self._pool(group)
        found = self._node_in_group(node, group, NODEPOOL_LABEL, "NodePool")
        if pool.get("spec", {}).get("replicas") is not None:
            if found is None:
                return

            def decrement(current: dict[str, Any]) -> dict[str, Any] | None:
                if (current["metadata"].get("annotations") or {}).get(SCALED_DOWN_FOR_ANNOTATION) == node:
                    return None  # done already for this node (a retried activity)
                replicas = int(current["spec"]["replicas"])
                if replicas < 1:
                    raise CapacityError(f"static NodePool {group} has replicas 0; cannot remove {node}",
                                        retryable=False)
                return {"metadata": {"annotations": {SCALED_DOWN_FOR_ANNOTATION: node}},
                        "spec": {"replicas": replicas - 1}}

            self._patch_pool(group, decrement)
            return
        claim = self._claim_for(group, node, found.spec.provider_id if found is not None and found.spec else None)
        if claim is None:
            return  # gone (or never had one: a node without a NodeClaim is not Karpenter's to remove)
        try:
            self.custom.delete_cluster_custom_object(GROUP, VERSION, "nodeclaims", claim["metadata"]["name"])
        except client.ApiException as exc:
            if _status(exc) != 404:
                raise CapacityError(f"deleting NodeClaim {claim['metadata']['name']} of node {node}: "
                                    f"{exc.status} {_reason(exc)}", retryable=_status(exc) not in (401, 403)) from exc

    def node_gone(self, group: str, node: str) -> bool:
        return self._node(node) is None and self._claim_for(group, node, None) is None


    def freeze(self, group: str, operation: str) -> None:
        def add(pool: dict[str, Any]) -> dict[str, Any] | None:
            holder = (pool["metadata"].get("annotations") or {}).get(FROZEN_BY_ANNOTATION)
            if holder == operation:
                return None
            if holder:
                raise FrozenByOtherError(f"NodePool {group}'s disruption is held frozen by operation {holder}")
            budgets = list((pool["spec"].get("disruption") or {}).get("budgets") or [])
            return {"metadata": {"annotations": {FROZEN_BY_ANNOTATION: operation}},
                    "spec": {"disruption": {"budgets": [*budgets, dict(FREEZE_BUDGET)]}}}

        self._patch_pool(group, add)

    def unfreeze(self, group: str, operation: str) -> None:
        def remove(pool: dict[str, Any]) -> dict[str, Any] | None:
            if (pool["metadata"].get("annotations") or {}).get(FROZEN_BY_ANNOTATION) != operation:
                return None
            budgets = list((pool["spec"].get("disruption") or {}).get("budgets") or [])
            # Ours is the last {nodes: "0"} with nothing else (we append it; a user's may sit before it).
            for i in range(len(budgets) - 1, -1, -1):
                if budgets[i] == FREEZE_BUDGET:
                    del budgets[i]
                    break
            return {"metadata": {"annotations": {FROZEN_BY_ANNOTATION: None}},
                    "spec": {"disruption": {"budgets": budgets}}}

        try:
            self._patch_pool(group, remove)
        except GroupNotFoundError:
            return  # the pool is gone, and its freeze with it

    def scale_up(self, group: str, desired: int) -> GroupScaling:
        raise CapacityError(f"NodePool {group}: Karpenter launches its nodes itself; it is never resized by the "
                            "optimizer", retryable=False)

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        if gpus is not None and gpus < 0:
            raise CapacityError(f"GPU limit {gpus} for NodePool {group} is negative", retryable=False)
        previous: list[int | None] = []

        def change(pool: dict[str, Any]) -> dict[str, Any] | None:
            if pool["spec"].get("replicas") is not None:
                raise CapacityError(f"NodePool {group} is static (spec.replicas): only limits.nodes applies to it",
                                    retryable=False)
            current = _quantity_int((pool["spec"].get("limits") or {}).get(GPU_RESOURCE))
            previous[:] = [current]
            if current == gpus:
                return None
            return {"spec": {"limits": {GPU_RESOURCE: None if gpus is None else str(gpus)}}}

        self._patch_pool(group, change)
        return previous[0] if previous else None


    def set_gpu_products(self, group: str, products: list[str]) -> list[str]:
        """The pool's ``nvidia.com/gpu.product In`` requirement set to ``products`` (added if it has none; the other
        requirements as they are, the list written whole with the read resourceVersion). Karpenter then drifts
        the pool's nodes of other products."""
        if not products:
            raise CapacityError(f"NodePool {group}: no GPU product to require", retryable=False)
        previous: list[str] = []

        def change(pool: dict[str, Any]) -> dict[str, Any] | None:
            template = ((pool.get("spec") or {}).get("template") or {}).get("spec") or {}
            requirements = list(template.get("requirements") or [])
            mine = [r for r in requirements if r.get("key") == PRODUCT_KEY]
            previous[:] = sorted({v for r in mine if r.get("operator") == "In" for v in r.get("values") or []})
            wanted = {"key": PRODUCT_KEY, "operator": "In", "values": sorted(products)}
            if mine == [wanted]:
                return None
            kept = [r for r in requirements if r.get("key") != PRODUCT_KEY]
            return {"spec": {"template": {"spec": {"requirements": [*kept, wanted]}}}}

        self._patch_pool(group, change)
        return previous


def _reason(exc: client.ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)
