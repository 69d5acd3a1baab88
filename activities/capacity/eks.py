"""``capacity.provider: eks-nodegroups``: home GPU capacity through EKS managed node groups (boto3, imported lazily:
a cluster on Karpenter never loads it). Shared notes capacity.md §3, §4, §6.

- Groups: ``list_nodegroups`` + ``describe_nodegroup`` (scaling config, instance types, labels, taints, the auto
  scaling group behind it); a group is a GPU group when an instance type is a GPU type of the catalogue, or its
  labels/taints name ``nvidia.com/gpu``. Its nodes are the Nodes labelled ``eks.amazonaws.com/nodegroup=<ng>``,
  each mapped to its instance by providerID ``aws:///<az>/<i-id>``.
- Scale up: ``update_nodegroup_config(scalingConfig={min, max, desired})`` to an absolute desired size (a retried
  call asks for the same size again: idempotent). min <= desired <= max is checked here, naming the group (moto
  accepts desired above max; real EKS refuses it with an InvalidParameterException). Desired is never lowered:
  that would let the ASG's termination policy choose the node. With cluster-autoscaler running (a Deployment
  named or labelled ``cluster-autoscaler``) desired is not set at all: the autoscaler owns it.
- Remove exactly one node (the caller cordoned and evicted it, PDB-safe, first):
  ``terminate_instance_in_auto_scaling_group(InstanceId=<its instance>, ShouldDecrementDesiredCapacity=True)``,
  sent once (no SDK-level resend: botocore would resend a terminate whose answer timed out); a retried removal
  reads the ASG first and is a no-op when the instance has left it or is terminating. Going below the ASG's
  MinSize is refused here (moto accepts it; real AWS refuses).
- Shield a node: the node annotation ``cluster-autoscaler.kubernetes.io/scale-down-disabled: "true"`` (a user's
  own is never removed). Freeze a group: the ASG tag ``kubeon.io/disruption-frozen-by=<operation>`` (one
  operation per group at a time; cluster-autoscaler itself is kept off the nodes by the shield).
- GPU capacity cap: the node group's ``maxSize`` (GPUs / GPUs per node); a managed node group has no "open" cap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from typing import Final

from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity.nodes import HomeNodes
from activities.capacity.nodes import group_node
from activities.capacity.nodes import labelled
from activities.providers.adaptors import LazyImport
from activities.providers.catalog import AWS_GPU_INSTANCES
from models.capacity import GroupNode
from models.capacity import HomeNodeGroup
from models.eks import NODEGROUP_LABEL
from models.eks import SCALE_DOWN_DISABLED
from models.eks import GroupScaling
from models.labels import GPU_RESOURCE
from models.provisioning import NodeRequirement

boto3 = LazyImport("boto3")
botocore_config = LazyImport("botocore.config")

GPU_TYPES: Final = {o.instance_type: o for o in AWS_GPU_INSTANCES}
PROVIDER_ID: Final = re.compile(r"^aws:///(?P<zone>[^/]+)/(?P<instance>i-[0-9a-f]+)$")
FROZEN_TAG: Final = "kubeon.io/disruption-frozen-by"
GONE_STATES: Final = ("Terminating", "Terminating:Wait", "Terminating:Proceed", "Terminated")
# AWS error codes retrying cannot help with.
FINAL_CODES: Final = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "InvalidParameterException",
                      "ValidationError", "ResourceNotFoundException", "InvalidClientTokenId"}


def instance_of(provider_id: str | None) -> str:
    """The EC2 instance id in a Node's providerID (``aws:///<az>/<i-id>``), or ""."""
    found = PROVIDER_ID.match(provider_id or "")
    return found.group("instance") if found else ""


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


class EksNodeGroupsCapacity(HomeNodes):
    name = "eks-nodegroups"
    SHIELD_ANNOTATION = SCALE_DOWN_DISABLED

    def __init__(self, api: client.ApiClient, *, cluster: str, region: str, endpoint_url: str | None = None,
                 client_config: dict[str, Any] | None = None,
                 prices: Callable[[str], float | None] | None = None) -> None:
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.cluster = cluster
        self.region = region
        self.endpoint_url = endpoint_url
        self._config = dict(client_config or {})
        self._price = prices or (lambda t: GPU_TYPES[t].usd_per_hour if t in GPU_TYPES else None)
        self._clients: dict[str, Any] = {}
        # node group -> its auto scaling group's name, as last described: fixed for the node group's life, so a
        # removal or a freeze reads the ASG directly (one call, not two); dropped when the ASG is gone (re-created).
        self._asg_names: dict[str, str] = {}

    # -- clients ---------------------------------------------------------------------------------------------------
    def _client(self, service: str, *, once: bool = False) -> Any:
        """The boto3 client (credentials from the default chain: IRSA / EKS Pod Identity in the cluster);
        ``once``: no SDK-level resend (for the terminate, whose retry goes through our own check first)."""
        key = f"{service}:{once}"
        if key not in self._clients:
            settings = dict(self._config)
            if once:
                settings["retries"] = {"total_max_attempts": 1}
            else:
                settings.setdefault("retries", {"mode": "standard", "max_attempts": 3})
            self._clients[key] = boto3.client(service, region_name=self.region, endpoint_url=self.endpoint_url,
                                              config=botocore_config.Config(**settings))
        return self._clients[key]

    def _aws(self, what: str, call: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return call(**kwargs)
        except Exception as exc:
            code = _code(exc)
            if code == "ResourceNotFoundException":
                raise GroupNotFoundError(f"{what}: {exc}") from exc
            final = code in FINAL_CODES or type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")
            raise CapacityError(f"{what}: {exc}", retryable=not final) from exc

    # -- reading ---------------------------------------------------------------------------------------------------
    def _describe(self, group: str) -> dict[str, Any]:
        return dict(self._aws(f"describing node group {group} of EKS cluster {self.cluster}",
                              self._client("eks").describe_nodegroup, clusterName=self.cluster,
                              nodegroupName=group)["nodegroup"])

    def _asg(self, group: str, name: str) -> dict[str, Any]:
        found = self._aws(f"describing auto scaling group {name} of node group {group}",
                          self._client("autoscaling").describe_auto_scaling_groups,
                          AutoScalingGroupNames=[name])["AutoScalingGroups"]
        if not found:
            raise GroupNotFoundError(f"node group {group}: its auto scaling group {name} does not exist")
        return dict(found[0])

    def _group_asg(self, group: str) -> tuple[str, dict[str, Any]]:
        """The node group's auto scaling group (name, description), its name remembered from the last describe."""
        name = self._asg_names.get(group)
        if name is not None:
            try:
                return name, self._asg(group, name)
            except GroupNotFoundError:
                self._asg_names.pop(group, None)  # the node group was deleted or re-created: describe it again
        name = self._asg_name(group, self._describe(group))
        self._asg_names[group] = name
        return name, self._asg(group, name)

    @staticmethod
    def _asg_name(group: str, described: dict[str, Any]) -> str:
        groups = (described.get("resources") or {}).get("autoScalingGroups") or []
        if not groups:
            raise CapacityError(f"node group {group} has no auto scaling group yet (status "
                                f"{described.get('status')})")
        return str(groups[0]["name"])

    @staticmethod
    def is_gpu_group(described: dict[str, Any]) -> bool:
        if any(GPU_TYPES.get(t) and GPU_TYPES[t].gpus > 0 for t in described.get("instanceTypes") or []):
            return True
        if any(k.startswith("nvidia.com/") for k in described.get("labels") or {}):
            return True
        return any(t.get("key") == GPU_RESOURCE for t in described.get("taints") or [])

    def list_groups(self) -> list[HomeNodeGroup]:
        eks = self._client("eks")
        names: list[str] = []
        token: str | None = None
        for _ in range(100):  # bounded: 100 pages of 100 node groups
            page = self._aws(f"listing node groups of EKS cluster {self.cluster}", eks.list_nodegroups,
                             clusterName=self.cluster, maxResults=100, **({"nextToken": token} if token else {}))
            names.extend(page.get("nodegroups") or [])
            token = page.get("nextToken")
            if not token:
                break
        described = [d for d in (self._describe(n) for n in names) if self.is_gpu_group(d)]
        return self._owned(self._groups_with_nodes(NODEGROUP_LABEL, described, self._group))

    def get_group(self, group: str) -> HomeNodeGroup:
        described = self._describe(group)
        if not self.is_gpu_group(described):
            raise GroupNotFoundError(f"node group {group} of EKS cluster {self.cluster} has no GPU instance types, "
                                     "labels or taints")
        return self._owned(self._groups_with_nodes(NODEGROUP_LABEL, [described], self._group, group))[0]

    def _owned(self, groups: list[HomeNodeGroup]) -> list[HomeNodeGroup]:
        """The groups with what owns their size: cluster-autoscaler, when it runs, owns every node group's."""
        autoscaler = self.cluster_autoscaler() if groups else None
        if not autoscaler:
            return groups
        return [g.model_copy(update={"scaling": g.scaling.model_copy(update={
            "autoscaler": f"cluster-autoscaler {autoscaler}"})}) if g.scaling else g for g in groups]

    def _group(self, d: dict[str, Any], nodes: list[client.V1Node], used: dict[str, int]) -> HomeNodeGroup:
        name = str(d["nodegroupName"])
        types = list(d.get("instanceTypes") or [])
        members: list[GroupNode] = []
        for node, labels in labelled(nodes, NODEGROUP_LABEL, name):
            instance_type = labels.get("node.kubernetes.io/instance-type", "")
            spec = GPU_TYPES.get(instance_type)
            members.append(group_node(
                node, used, instance=instance_of(node.spec.provider_id if node.spec else None),
                instance_type=instance_type, capacity_type=labels.get("eks.amazonaws.com/capacityType", ""),
                gpu_product=labels.get("nvidia.com/gpu.product", spec.gpu_product if spec else ""),
                usd_per_hour=self._price(instance_type) if instance_type else None))
        sc = d.get("scalingConfig") or {}
        per_node = max((GPU_TYPES[t].gpus for t in types if t in GPU_TYPES), default=0)
        products = sorted({GPU_TYPES[t].gpu_product for t in types if t in GPU_TYPES})
        requirements = [NodeRequirement(key=k, operator="In", values=[v]) for k, v in sorted(
            (d.get("labels") or {}).items())]
        if types:
            requirements.append(NodeRequirement(key="node.kubernetes.io/instance-type", operator="In", values=types))
        groups = (d.get("resources") or {}).get("autoScalingGroups") or []
        return HomeNodeGroup(
            provider=self.name, name=name, gpu_products=products,
            gpu_limit=int(sc.get("maxSize", 0)) * per_node if per_node else None,
            gpus=sum(m.gpus for m in members), nodes=sorted(members, key=lambda m: m.name), gpus_per_node=per_node,
            requirements=requirements,
            taints=sorted({t["key"] for t in d.get("taints") or []
                           if t.get("effect") in ("NO_SCHEDULE", "NO_EXECUTE")}),
            scaling=GroupScaling(min_size=int(sc.get("minSize", 0)), max_size=int(sc.get("maxSize", 0)),
                                 desired_size=int(sc.get("desiredSize", 0)),
                                 auto_scaling_group=str(groups[0]["name"]) if groups else "",
                                 status=str(d.get("status", ""))))

    def cluster_autoscaler(self) -> str | None:
        """The cluster-autoscaler Deployment (namespace/name) if one runs, else None."""
        for selector in ("app.kubernetes.io/name=cluster-autoscaler", "app=cluster-autoscaler"):
            found = self.apps.list_deployment_for_all_namespaces(label_selector=selector).items
            if found:
                return f"{found[0].metadata.namespace}/{found[0].metadata.name}"
        found = self.apps.list_deployment_for_all_namespaces(field_selector="metadata.name=cluster-autoscaler").items
        return f"{found[0].metadata.namespace}/{found[0].metadata.name}" if found else None

    # -- changing --------------------------------------------------------------------------------------------------
    def scale_up(self, group: str, desired: int) -> GroupScaling:
        """Set the node group's desired size to ``desired`` (absolute: a retry asks for the same size); never
        lowers it, never past min/max. Returns the scaling config afterwards."""
        d = self._describe(group)
        sc = d.get("scalingConfig") or {}
        low, high, now = int(sc.get("minSize", 0)), int(sc.get("maxSize", 0)), int(sc.get("desiredSize", 0))
        if desired < now:
            raise CapacityError(f"node group {group}: desired {desired} is below its current {now}; nodes are "
                                "removed one by one (remove_node), never by lowering desired", retryable=False)
        if not low <= desired <= high:
            raise CapacityError(f"node group {group}: desired {desired} is outside minSize {low} .. maxSize {high}",
                                retryable=False)
        scaling = GroupScaling(min_size=low, max_size=high, desired_size=desired,
                               auto_scaling_group=self._asg_name(group, d), status=str(d.get("status", "")))
        if desired == now:
            return scaling
        autoscaler = self.cluster_autoscaler()
        if autoscaler:
            raise CapacityError(f"node group {group}: cluster-autoscaler runs ({autoscaler}) and owns its desired "
                                "size; not set directly", retryable=False)
        self._aws(f"scaling node group {group} of EKS cluster {self.cluster} to {desired}",
                  self._client("eks").update_nodegroup_config, clusterName=self.cluster, nodegroupName=group,
                  scalingConfig={"minSize": low, "maxSize": high, "desiredSize": desired})
        return scaling


    def remove_node(self, group: str, node: str) -> None:
        found = self._node_in_group(node, group, NODEGROUP_LABEL, "node group")
        if found is None:
            return  # gone, with its instance (the cloud controller deletes the Node after the instance)
        instance = instance_of(found.spec.provider_id if found.spec else None)
        if not instance:
            raise CapacityError(f"node {node} has no EC2 providerID (aws:///<az>/<i-id>): "
                                f"{found.spec.provider_id if found.spec else None!r}", retryable=False)
        name, asg = self._group_asg(group)
        member = next((i for i in asg.get("Instances") or [] if i["InstanceId"] == instance), None)
        if member is None or member.get("LifecycleState") in GONE_STATES:
            return  # removed already (a retried removal whose first answer came late)
        if int(asg["DesiredCapacity"]) - 1 < int(asg["MinSize"]):
            raise CapacityError(f"node group {group}: removing {node} would take its auto scaling group {name} "
                                f"below MinSize {asg['MinSize']} (desired {asg['DesiredCapacity']})", retryable=False)
        try:
            self._client("autoscaling", once=True).terminate_instance_in_auto_scaling_group(
                InstanceId=instance, ShouldDecrementDesiredCapacity=True)
        except Exception as exc:
            # The answer may be lost after AWS acted on it: re-read before saying it failed.
            after = self._asg(group, name)
            still = next((i for i in after.get("Instances") or [] if i["InstanceId"] == instance), None)
            if still is None or still.get("LifecycleState") in GONE_STATES:
                return
            code = _code(exc)
            raise CapacityError(f"terminating {instance} (node {node}) in node group {group}: {exc}",
                                retryable=code not in FINAL_CODES) from exc

    def node_gone(self, group: str, node: str) -> bool:
        return self._node(node) is None


    def _frozen_by(self, group: str) -> tuple[str, str | None]:
        name, asg = self._group_asg(group)
        tags = {t["Key"]: t.get("Value") for t in asg.get("Tags") or []}
        return name, tags.get(FROZEN_TAG)

    def freeze(self, group: str, operation: str) -> None:
        name, holder = self._frozen_by(group)
        if holder == operation:
            return
        if holder:
            raise FrozenByOtherError(f"node group {group} is held frozen by operation {holder}")
        self._aws(f"tagging auto scaling group {name} of node group {group}",
                  self._client("autoscaling").create_or_update_tags, Tags=[{
                      "ResourceId": name, "ResourceType": "auto-scaling-group", "Key": FROZEN_TAG,
                      "Value": operation, "PropagateAtLaunch": False}])

    def unfreeze(self, group: str, operation: str) -> None:
        try:
            name, holder = self._frozen_by(group)
        except GroupNotFoundError:
            return
        if holder != operation:
            return
        self._aws(f"untagging auto scaling group {name} of node group {group}",
                  self._client("autoscaling").delete_tags, Tags=[{
                      "ResourceId": name, "ResourceType": "auto-scaling-group", "Key": FROZEN_TAG}])

    def set_gpu_limit(self, group: str, gpus: int | None) -> int | None:
        if gpus is None or gpus < 0:
            raise CapacityError(f"node group {group}: a managed node group's GPUs are capped by its maxSize; "
                                f"{gpus} cannot be set", retryable=False)
        d = self._describe(group)
        per_node = max((GPU_TYPES[t].gpus for t in d.get("instanceTypes") or [] if t in GPU_TYPES), default=0)
        if not per_node:
            raise CapacityError(f"node group {group}: GPUs per node unknown for {d.get('instanceTypes')}",
                                retryable=False)
        sc = d.get("scalingConfig") or {}
        low, high, now = int(sc.get("minSize", 0)), int(sc.get("maxSize", 0)), int(sc.get("desiredSize", 0))
        new_max = gpus // per_node
        if new_max < max(low, now):
            raise CapacityError(f"node group {group}: {gpus} GPUs ({new_max} nodes) is below its minSize {low} or "
                                f"desired {now}", retryable=False)
        if new_max != high:
            self._aws(f"capping node group {group} at {new_max} nodes", self._client("eks").update_nodegroup_config,
                      clusterName=self.cluster, nodegroupName=group,
                      scalingConfig={"minSize": low, "maxSize": new_max, "desiredSize": now})
        return high * per_node
