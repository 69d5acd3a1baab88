"""`make dev --capacity X`: the home GPU capacity behind one of the capacity providers (capacity.provider X).

    karpenter       the real Karpenter (kwok provider, tests/harness/karpenter.py) with a static GPU NodePool
    eks-nodegroups  an EKS managed node group on moto, an auto scaling group behind it (tests/harness/clouds/eks.py)
    gke-nodepools   a GKE node pool and its managed instance group on the local GCP server
    aks-nodepools   an AKS agent pool and its machines on the local Azure Resource Manager

Each is one group ``gpu-home`` (the one the example policy examples/dev/packing-home.yaml targets) of ``INSTANCES``
4-GPU nodes, tainted ``nvidia.com/gpu=true:NoSchedule`` (so the burst example's pod, which does not tolerate it,
still bursts) and labelled ``GROUP_NODE_LABEL``.
A managed group's instances appear as kwok Nodes with the provider's labels and providerID, and go when their
instance does, as the cloud's controller manager does (clouds/nodes.py). ``settings()`` is the worker's
capacity config, ``endpoint()`` the ``capacity`` entry of endpoints.json: where the group is and what
``kubeon-gpu doctor`` (or the official SDK) needs to reach it (``env``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from models.aks import AGENTPOOL_LABEL
from models.capacity import NODEPOOL_LABEL as KARPENTER_POOL_LABEL
from models.eks import NODEGROUP_LABEL
from models.gke import NODEPOOL_LABEL as GKE_POOL_LABEL
from tests.harness.clouds import local
from tests.harness.clouds.dev import DevClouds
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import aks_listing
from tests.harness.clouds.nodes import gke_listing
from tests.harness.karpenter import NODE_CLASS
from tests.harness.karpenter import Karpenter
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

PROVIDERS = ("none", "karpenter", "eks-nodegroups", "gke-nodepools", "aks-nodepools")
GROUP = "gpu-home"
# On every node of the group, whatever the provider: what examples/packing-workload.yaml selects.
GROUP_NODE_LABEL = {"example.com/gpu-group": GROUP}
INSTANCES = 2
HOME_CLUSTER = "home"  # the managed cluster's name on each cloud
GKE_LOCATION, GKE_ZONE = "europe-west4", "europe-west4-a"
AKS_RESOURCE_GROUP = "kubeon-home-westeurope"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true"}
# 4-GPU nodes of each provider (L4 where the cloud has it; Azure has no L4 VM: 4 T4s).
MACHINE = {"karpenter": "g6.12xlarge", "eks-nodegroups": "g6.12xlarge", "gke-nodepools": "g2-standard-48",
           "aks-nodepools": "Standard_NC64as_T4_v3"}
GROUP_LABEL = {"karpenter": KARPENTER_POOL_LABEL, "eks-nodegroups": NODEGROUP_LABEL,
               "gke-nodepools": GKE_POOL_LABEL, "aks-nodepools": AGENTPOOL_LABEL}


def static_nodepool() -> dict[str, Any]:
    """A static GPU NodePool (``replicas``, Karpenter's StaticCapacity): its nodes exist before any pod, so the
    packing example's pods spread over them; a removal decrements ``replicas``."""
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": GROUP}, "spec": {
        "replicas": INSTANCES,
        "limits": {"nodes": str(INSTANCES + 1)},
        "template": {"metadata": {"labels": GROUP_NODE_LABEL}, "spec": {
            "nodeClassRef": NODE_CLASS,
            "requirements": [
                {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [MACHINE["karpenter"]]},
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]},
                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}],
            "taints": [{**GPU_TAINT, "effect": "NoSchedule"}],
            "expireAfter": "Never"}},
        "disruption": {"consolidateAfter": "Never", "budgets": [{"nodes": "10%"}]}}}


@dataclass
class DevCapacity:
    provider: str
    cluster: Cluster
    workdir: Path
    clouds: DevClouds
    _karpenter: Any = None
    _reconciler: NodeReconciler | None = None
    _eks: Any = None
    _stops: list[Any] = field(default_factory=list)

    def start(self, timeout: float = 120.0) -> DevCapacity:
        if self.provider == "karpenter":
            self._karpenter = Karpenter(self.cluster.plane, self.workdir / "karpenter", self.cluster.admin).start()
            self._karpenter.create_nodepool(static_nodepool())
        elif self.provider == "eks-nodegroups":
            from tests.harness.clouds.eks import EksNodeGroups

            assert self.clouds.moto is not None
            self._eks = EksNodeGroups(self.clouds.moto.endpoint, region="eu-central-1")
            self._eks.create(HOME_CLUSTER, GROUP, instance_type=MACHINE[self.provider], min_size=1,
                             max_size=INSTANCES + 2, desired=INSTANCES,
                             labels=GROUP_NODE_LABEL, taints=[{**GPU_TAINT, "effect": "NO_SCHEDULE"}])
            self._mirror(self._eks.listing)
        elif self.provider == "gke-nodepools":
            assert self.clouds.gcp is not None
            self.clouds.gcp.seed(gke={"project": local.GCP_PROJECT, "location": GKE_LOCATION,
                                      "cluster": HOME_CLUSTER, "nodePools": [
                                          {"name": GROUP, "machineType": MACHINE[self.provider], "zones": [GKE_ZONE],
                                           "nodeCount": INSTANCES, "labels": GROUP_NODE_LABEL, "taints": [{**GPU_TAINT,
                                                                               "effect": "NO_SCHEDULE"}]}]})
            self._mirror(gke_listing(self.clouds.gcp))
        elif self.provider == "aks-nodepools":
            assert self.clouds.azure is not None
            self.clouds.azure.seed(aks={
                "subscription": local.AZURE_SUBSCRIPTION, "resourceGroup": AKS_RESOURCE_GROUP,
                "cluster": HOME_CLUSTER, "location": "westeurope", "agentPools": [
                    {"name": GROUP, "vmSize": MACHINE[self.provider], "count": INSTANCES, "mode": "User",
                     "nodeTaints": ["nvidia.com/gpu=true:NoSchedule"], "nodeLabels": GROUP_NODE_LABEL},
                    {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})
            self._mirror(aks_listing(self.clouds.azure))
        else:
            return self
        label = GROUP_LABEL[self.provider]
        wait_for(lambda: len(self.nodes()) >= INSTANCES, timeout=timeout,
                 what=f"the {INSTANCES} nodes of {label}={GROUP} registered")
        return self

    def _mirror(self, listing: Any) -> None:
        self._reconciler = NodeReconciler(self.cluster.admin, f"dev-{self.provider}", listing, interval=1.0)
        self._reconciler.__enter__()

    def nodes(self) -> list[str]:
        found = self.cluster.admin.core.list_node(label_selector=f"{GROUP_LABEL[self.provider]}={GROUP}").items
        return sorted(str(n.metadata.name) for n in found)

    def stop(self) -> None:
        if self._reconciler is not None:
            with contextlib.suppress(Exception):  # the control plane may be going already
                self._reconciler.__exit__(None, None, None)
            self._reconciler = None
        if self._karpenter is not None:
            self._karpenter.stop()
            self._karpenter = None

    # -- what the worker and a newcomer need ----------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The worker's capacity config (the chart's capacity values)."""
        if self.provider == "none":
            return {"capacity_provider": "none"}
        out: dict[str, Any] = {"capacity_provider": self.provider, "scale_resync_seconds": 10}
        if self.provider == "eks-nodegroups":
            out.update(capacity_cluster_name=HOME_CLUSTER, capacity_region="eu-central-1")
        elif self.provider == "gke-nodepools":
            out.update(capacity_cluster_name=HOME_CLUSTER, capacity_project=local.GCP_PROJECT,
                       capacity_location=GKE_LOCATION)
        elif self.provider == "aks-nodepools":
            out.update(capacity_cluster_name=HOME_CLUSTER, capacity_subscription=local.AZURE_SUBSCRIPTION,
                       capacity_resource_group=AKS_RESOURCE_GROUP)
        return out

    def env(self) -> dict[str, str]:
        """``KUBEON_*`` for ``kubeon-gpu doctor`` (and the SDK's own variables), as the chart sets them."""
        values = {k: v for k, v in self.settings().items() if k.startswith("capacity_")}
        env = {f"KUBEON_{k.upper()}": str(v) for k, v in values.items()}
        clouds = self.clouds.endpoints
        if self.provider == "eks-nodegroups":
            env.update(clouds["aws"]["env"], KUBEON_AWS_ENDPOINT_URL=clouds["aws"]["url"])
        elif self.provider == "gke-nodepools":
            env["KUBEON_GCP_ENDPOINT_URL"] = clouds["gcp"]["url"]
        elif self.provider == "aks-nodepools":
            env.update(clouds["azure"]["env"], KUBEON_AZURE_ENDPOINT_URL=clouds["azure"]["url"],
                       KUBEON_AZURE_CA_FILE=clouds["azure"]["ca"])
        return env

    def endpoint(self) -> dict[str, Any]:
        """endpoints.json's ``capacity``: the group, where its API is and how the official SDK authenticates."""
        clouds = self.clouds.endpoints
        entry: dict[str, Any] = {"provider": self.provider, "group": GROUP, "nodes": self.nodes(),
                                 "groupLabel": GROUP_LABEL[self.provider], "machineType": MACHINE[self.provider]}
        if self.provider == "karpenter":
            entry.update(nodePool=GROUP, kubeconfig=str(self.cluster.plane.admin_kubeconfig),
                         auth="the kubeconfig (Karpenter's objects are in the cluster: kubectl get nodepools)")
        elif self.provider == "eks-nodegroups":
            entry.update(url=clouds["aws"]["url"], region="eu-central-1", eksCluster=HOME_CLUSTER,
                         auth="SigV4 with any key pair (moto); boto3 reads env")
        elif self.provider == "gke-nodepools":
            entry.update(url=clouds["gcp"]["url"], project=local.GCP_PROJECT, location=GKE_LOCATION,
                         gkeCluster=HOME_CLUSTER, auth="no token checked: google.auth AnonymousCredentials, "
                         "client_options api_endpoint=url")
        elif self.provider == "aks-nodepools":
            entry.update(url=clouds["azure"]["url"], subscription=local.AZURE_SUBSCRIPTION,
                         resourceGroup=AKS_RESOURCE_GROUP, aksCluster=HOME_CLUSTER, ca=clouds["azure"]["ca"],
                         identityEndpoint=clouds["azure"]["identityEndpoint"],
                         auth="bearer tokens from identityEndpoint: ManagedIdentityCredential / "
                         "DefaultAzureCredential with env; trust ca (REQUESTS_CA_BUNDLE)")
        entry["env"] = self.env()
        return entry
