"""The cloud controller manager of the local managed node groups: each running instance of a group is a kwok
Node with the provider's labels, GPU capacity and providerID (shared notes capacity.md §3), and its Node goes
when the instance does.

One ``NodeReconciler`` per server (started by a fixture): a daemon thread that every ``interval`` seconds reads
the instances (``listing``) and creates or deletes Nodes to match. It owns only the Nodes it made (label
``kubeon.io/test-cloud=<owner>``), so reconcilers of other tests never touch each other's. Tests wait on the
Nodes with ``wait_for`` (a bound, no fixed sleep); ``errors`` keeps the last failed passes' reasons.

    eks   eks.amazonaws.com/nodegroup=<ng>       aws:///<az>/<i-id>                     node name: the private DNS name
    gke   cloud.google.com/gke-nodepool=<pool>    gce://<project>/<zone>/<instance>      node name: the instance name
    aks   kubernetes.azure.com/agentpool=<pool>   azure:///subscriptions/.../virtualMachineScaleSets/<vmss>/
                                                  virtualMachines/<n>                    node name: the machine name
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from kubernetes import client

from tests.harness.background import Background
from tests.harness.controlplane import KWOK_NODE_ANNOTATION
from tests.harness.kube import Kube
from tests.harness.kube import wait_for

OWNER = "kubeon.io/test-cloud"


@dataclass(frozen=True)
class CloudNode:
    name: str
    provider_id: str
    labels: dict[str, str]
    gpus: int
    cpu: str = "32"
    memory: str = "256Gi"
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, Kubernetes effect): the group's taints


@dataclass
class NodeReconciler(Background):
    kube: Kube
    owner: str  # a value of this reconciler alone
    listing: Callable[[], list[CloudNode]]
    interval: float = 0.2
    passes: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        Background.__init__(self)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._delete_all()

    def nodes(self) -> dict[str, Any]:
        found = self.kube.core.list_node(label_selector=f"{OWNER}={self.owner}").items
        return {str(n.metadata.name): n for n in found}

    def group(self, label: str, name: str) -> dict[str, Any]:
        """This reconciler's Nodes of one group (``label`` = the provider's group label, e.g.
        ``cloud.google.com/gke-nodepool``), by name."""
        return {k: n for k, n in self.nodes().items() if (n.metadata.labels or {}).get(label) == name}

    def ready(self, label: str, name: str) -> list[Any]:
        """The group's Nodes kwok marked Ready with the not-ready taint lifted (the scheduler may use them)."""
        return [n for n in self.group(label, name).values()
                if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                and not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or [])]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except Exception as exc:  # the cloud restarting, the API server busy: next pass
                self.errors.append(repr(exc))
                del self.errors[:-20]
            self.passes += 1
            self._stop.wait(self.interval)

    def _pass(self) -> None:
        wanted = {n.name: n for n in self.listing()}
        have = self.nodes()
        for name, cn in wanted.items():
            if name not in have:
                self.kube.core.create_node(self._node(cn))
        for name in have.keys() - wanted.keys():
            try:
                self.kube.core.delete_node(name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise

    def _node(self, cn: CloudNode) -> client.V1Node:
        res = {"cpu": cn.cpu, "memory": cn.memory, "pods": "110", "nvidia.com/gpu": str(cn.gpus)}
        return client.V1Node(
            metadata=client.V1ObjectMeta(
                name=cn.name, annotations={KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                labels={"kubernetes.io/hostname": cn.name, "kubernetes.io/os": "linux", "type": "kwok",
                        OWNER: self.owner, **cn.labels}),
            spec=client.V1NodeSpec(provider_id=cn.provider_id, taints=[
                client.V1Taint(key=k, value=v or None, effect=e) for k, v, e in cn.taints] or None),
            status=client.V1NodeStatus(allocatable=res, capacity=res))

    def _delete_all(self) -> None:
        for name in self.nodes():
            try:
                self.kube.core.delete_node(name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        wait_for(lambda: not self.nodes(), timeout=30, what=f"nodes of {self.owner} deleted")


def group_taints(node: client.V1Node) -> list[tuple[str, str | None, str]]:
    """A Node's taints less the ones Kubernetes' controllers add (``node.kubernetes.io/not-ready`` until kwok
    marks it Ready)."""
    return [(t.key, t.value, t.effect) for t in node.spec.taints or [] if not t.key.startswith("node.kubernetes.io/")]


# EKS and GKE spell taint effects NO_SCHEDULE | NO_EXECUTE | PREFER_NO_SCHEDULE; Nodes carry Kubernetes' spelling.
EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


def _aks_taint(text: str) -> tuple[str, str, str]:
    """AKS ``nodeTaints``: ``key=value:Effect``."""
    kv, _, effect = text.rpartition(":")
    key, _, value = kv.partition("=")
    return key, value, effect


# -- what each cloud's controller manager makes of its instances --------------------------------------------
def gke_listing(server: Any) -> Callable[[], list[CloudNode]]:
    """The running (or deleting) VMs of the GKE node pools' MIGs on the local Compute Engine server."""
    from tests.harness.clouds.gcp_server import MACHINE_TYPES

    def listing() -> list[CloudNode]:
        out = []
        state = server.state()
        pools = {(p["cluster"], p["name"]): p for p in state["nodePools"]}
        for inst in state["instances"]:
            pool = inst.get("labels", {}).get("goog-k8s-node-pool-name")
            if not pool or inst["status"] not in ("RUNNING", "STOPPING"):
                continue
            config = pools.get((inst["labels"].get("goog-k8s-cluster-name"), pool), {}).get("config", {})
            taints = tuple((t["key"], t.get("value", ""), EFFECTS[t["effect"]]) for t in config.get("taints", []))
            cpus, mem, accelerator, gpus = MACHINE_TYPES[inst["machineType"].rsplit("/", 1)[-1]]
            project, _, zone, _, name = inst["selfLink"].split("/projects/", 1)[1].split("/")
            labels = {"cloud.google.com/gke-nodepool": pool, "topology.kubernetes.io/zone": zone,
                      "node.kubernetes.io/instance-type": inst["machineType"].rsplit("/", 1)[-1]}
            if accelerator:
                labels["cloud.google.com/gke-accelerator"] = accelerator
            labels.update(config.get("labels", {}))
            out.append(CloudNode(name, f"gce://{project}/{zone}/{name}", labels, gpus, str(cpus), f"{mem}Mi",
                                 taints))
        return out

    return listing


def aks_listing(server: Any) -> Callable[[], list[CloudNode]]:
    """The machines of the AKS agent pools on the local Azure Resource Manager."""
    from tests.harness.clouds.azure_server import SIZES

    def listing() -> list[CloudNode]:
        out = []
        for pool in server.state()["agentPools"]:
            size = pool["properties"]["vmSize"]
            _, cpus, mem, gpus = SIZES[size]
            labels = {"kubernetes.azure.com/agentpool": pool["name"], "node.kubernetes.io/instance-type": size,
                      "kubernetes.azure.com/mode": pool["properties"]["mode"].lower(),
                      **pool["properties"].get("nodeLabels", {})}
            if gpus:
                labels["kubernetes.azure.com/accelerator"] = "nvidia"
            taints = tuple(_aks_taint(t) for t in pool["properties"].get("nodeTaints", []))
            for machine in pool["machines"]:
                # The kubelet's providerID: the VMSS VM's id, its resource group lowercased (as AKS nodes show it).
                rid = re.sub(r"(?<=/resourceGroups/)[^/]+", lambda m: m.group(0).lower(),
                             machine["properties"]["resourceId"])
                out.append(CloudNode(machine["name"], f"azure://{rid}", labels, gpus, str(cpus), f"{mem}Gi",
                                     taints))
        return out

    return listing
