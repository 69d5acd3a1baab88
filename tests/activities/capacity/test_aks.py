"""The aks-nodepools capacity provider with the official clients (azure-mgmt-containerservice, azure-identity's
ManagedIdentityCredential) against the local Azure Resource Manager over HTTPS with its per-run certificate
(tests/harness/clouds/aks.py), the agent pools' machines kwok Nodes on the real control plane, read with the
optimizer's own Kubernetes credentials (R5.1). The server records every ARM request and each machine removed
(``machineDeleted``, with how: ``deleteMachines`` or ``scale``, the cloud's own choice)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity import NodeNotInGroupError
from activities.capacity.aks import FROZEN_TAG
from activities.capacity.aks import LIMIT_TAG
from activities.capacity.aks import AksNodePoolsCapacity
from models.aks import AGENTPOOL_LABEL
from models.eks import SCALE_DOWN_DISABLED
from tests.harness.clouds.azure_server import IDENTITY_HEADER
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_CLIENT_ID
from tests.harness.clouds.local import AZURE_SUBSCRIPTION
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import live_pods
from tests.harness.workloads import node_group_pods
from tests.harness.workloads import unschedulable_once_settled

pytestmark = [pytest.mark.cluster]

RG = "ml-prod"
GPU_SIZE = "Standard_NC64as_T4_v3"  # 4 T4s
TAINT = "nvidia.com/gpu=true:NoSchedule"


def seed(azure_server: FakeServer, cluster: str, gpu_count: int) -> None:
    """An AKS cluster of its own: a 4-GPU User pool ``gpu``, a 1-node GPU System pool ``gpusys`` and a CPU System
    pool ``system``."""
    azure_server.seed(aks={"subscription": AZURE_SUBSCRIPTION, "resourceGroup": RG, "cluster": cluster,
                           "location": "westeurope", "agentPools": [
                               {"name": "gpu", "vmSize": GPU_SIZE, "count": gpu_count, "mode": "User",
                                "nodeTaints": [TAINT], "nodeLabels": {"kubeon.io/pool": "home"}},
                               {"name": "gpusys", "vmSize": "Standard_NC4as_T4_v3", "count": 1, "mode": "System",
                                "nodeTaints": [TAINT]},
                               {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})


def identity(azure_server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ManagedIdentityCredential gets its tokens (in the cluster: AKS workload identity)."""
    monkeypatch.setenv("IDENTITY_ENDPOINT", azure_server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)


def provider(api: client.ApiClient, azure_server: FakeServer, cluster: str, **kwargs: Any) -> AksNodePoolsCapacity:
    return AksNodePoolsCapacity(api, subscription=AZURE_SUBSCRIPTION, resource_group=RG, cluster=cluster,
                                endpoint_url=azure_server.url, ca_file=str(azure_server.ca_file),
                                client_id=AZURE_CLIENT_ID, polling_interval=0.1, **kwargs)


def pool_nodes(nodes: NodeReconciler, cluster: str, pool: str) -> dict[str, client.V1Node]:
    """The Nodes of one pool of this test's AKS cluster (a machine's name carries its pool's key)."""
    return {k: n for k, n in nodes.nodes().items() if n.metadata.labels[AGENTPOOL_LABEL] == pool
            and f"/managedclusters/{cluster}/" in _machine_cluster(n)}


def _machine_cluster(node: client.V1Node) -> str:
    # The providerID names the node resource group MC_<rg>_<cluster>_<location>: the cluster of the machine.
    return "/managedclusters/" + node.spec.provider_id.lower().split(f"/mc_{RG}_", 1)[1].rsplit("_", 1)[0] + "/"


def ready(nodes: NodeReconciler, cluster: str, pool: str) -> list[client.V1Node]:
    """The pool's Nodes kwok marked Ready with the not-ready taint lifted (the scheduler may use them)."""
    return [n for n in pool_nodes(nodes, cluster, pool).values()
            if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
            and not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or [])]


def pool_state(azure_server: FakeServer, cluster: str, pool: str) -> dict[str, Any]:
    return next(p for p in azure_server.state()["agentPools"] if p["cluster"] == cluster and p["name"] == pool)


def removals(azure_server: FakeServer) -> list[dict[str, Any]]:
    """Machines removed since the seed, with how."""
    return [d for d in azure_server.state()["machineDeleted"] if d["via"] != "seed"]


def mutations(azure_server: FakeServer) -> list[dict[str, Any]]:
    return [r for r in azure_server.requests() if r["method"] in ("PUT", "POST")
            and "/agentPools/" in r["path"]]


def shrinks(azure_server: FakeServer, before: int) -> list[dict[str, Any]]:
    """PUTs lowering a pool's count (the cloud would choose the node): never sent."""
    return [r for r in mutations(azure_server) if r["method"] == "PUT"
            and int(r["body"]["properties"]["count"]) < before]


@pytest.fixture(scope="module")
def optimizer(cluster: Cluster) -> Kube:
    return grant(cluster, "kubeon-aks-capacity-test", OPTIMIZER_RULES)


@pytest.fixture
def aks(azure_server: FakeServer, aks_nodes: NodeReconciler, optimizer: Kube,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    azure_server.reset()
    azure_server.fault(operation_seconds=0.2, retry_after=0)
    name = f"train-{uuid.uuid4().hex[:6]}"
    seed(azure_server, name, 2)
    identity(azure_server, monkeypatch)
    wait_for(lambda: len(ready(aks_nodes, name, "gpu")) == 2, timeout=30, what="the gpu pool's 2 nodes Ready")
    yield {"cluster": name, "capacity": provider(optimizer.api, azure_server, name)}
    azure_server.reset()
    wait_for(lambda: not pool_nodes(aks_nodes, name, "gpu"), timeout=30, what="the test's nodes gone")


def test_lists_the_gpu_pools_with_their_nodes(aks: dict[str, Any], azure_server: FakeServer,
                                              aks_nodes: NodeReconciler, cluster: Cluster) -> None:
    from worker.doctor import check_capacity

    capacity: AksNodePoolsCapacity = aks["capacity"]
    groups = {g.name: g for g in capacity.list_groups()}
    assert sorted(groups) == ["gpu", "gpusys"]  # the CPU pool is no GPU group
    found = groups["gpu"]
    assert found.provider == "aks-nodepools" and found.gpu_products == ["Tesla-T4"]
    assert found.scaling is not None
    assert (found.scaling.min_size, found.scaling.desired_size, found.scaling.max_size) == (0, 2, 1000)
    assert (found.scaling.auto_scaling_group, found.scaling.status) == ("User", "Succeeded")
    assert groups["gpusys"].scaling is not None and groups["gpusys"].scaling.min_size == 1  # a System pool
    assert found.gpu_limit is None and found.gpus == 8 and found.taints == ["nvidia.com/gpu"]
    assert ("kubeon.io/pool", ["home"]) in [(r.key, r.values) for r in found.requirements]
    registered = pool_nodes(aks_nodes, aks["cluster"], "gpu")
    assert sorted(n.name for n in found.nodes) == sorted(registered)
    machines = {m["properties"]["resourceId"].lower() for m in pool_state(azure_server, aks["cluster"], "gpu")[
        "machines"]}
    assert {n.instance for n in found.nodes} == machines  # each node mapped to its machine's VMSS VM
    for n in found.nodes:
        assert (n.instance_type, n.gpus, n.gpu_product) == (GPU_SIZE, 4, "Tesla-T4")
        assert n.usd_per_hour == 4.352 and n.ready and not n.cordoned
    assert capacity.get_group("gpu").nodes == found.nodes
    with pytest.raises(GroupNotFoundError, match="system"):
        capacity.get_group("system")
    with pytest.raises(GroupNotFoundError, match="missing"):
        capacity.get_group("missing")
    assert mutations(azure_server) == []
    doctor = check_capacity(cluster.admin.api, "aks-nodepools", capacity)
    assert (doctor.name, doctor.status) == ("AKS agent pools", "found")
    assert doctor.detail == (f"AKS cluster {aks['cluster']} in resource group {RG}: GPU agent pools: 2 (gpu (User, "
                             "count 2, 2 nodes), gpusys (System, count 1, 1 nodes))")
    wrong = check_capacity(cluster.admin.api, "aks-nodepools", provider(cluster.admin.api, azure_server, "nope"))
    assert wrong.status == "missing" and "ResourceNotFound" in wrong.detail


def gpu_pods(name: str, replicas: int) -> client.V1Deployment:
    """1-GPU pods only the ``gpu`` pool serves (its taint tolerated)."""
    return node_group_pods(name, AGENTPOOL_LABEL, "gpu", replicas)


def test_scale_up_for_the_pending_gpu_pods(aks: dict[str, Any], azure_server: FakeServer, cluster: Cluster,
                                           namespace: str, aks_nodes: NodeReconciler) -> None:
    capacity: AksNodePoolsCapacity = aks["capacity"]
    cluster.admin.apps.create_namespaced_deployment(namespace, gpu_pods("infer", 11))  # 8 run on 2x4, 3 wait

    waiting = wait_for(lambda: unschedulable_once_settled(cluster.admin.core, namespace, "infer", 11, 8), timeout=30,
                       what="8 pods running, 3 unschedulable")
    found = capacity.get_group("gpu")
    assert found.scaling is not None and sum(n.gpus_used for n in found.nodes) == 8
    count = found.scaling.desired_size + math.ceil(len(waiting) / max(n.gpus for n in found.nodes))
    assert count == 3
    after = capacity.scale_up("gpu", count)
    capacity.scale_up("gpu", count)  # a retried activity: the same size, nothing sent
    assert after.desired_size == 3
    [put] = mutations(azure_server)
    assert put["method"] == "PUT" and put["path"].endswith(f"/managedClusters/{aks['cluster']}/agentPools/gpu")
    sent = put["body"]["properties"]
    # The whole properties, as read: only the count changed.
    assert (sent["count"], sent["vmSize"], sent["mode"], sent["nodeTaints"], sent["nodeLabels"]) == (
        3, GPU_SIZE, "User", [TAINT], {"kubeon.io/pool": "home"})
    assert any("/Microsoft.ContainerService/locations/westeurope/operations/" in r["path"]
               for r in azure_server.requests())  # the operation polled
    assert pool_state(azure_server, aks["cluster"], "gpu")["properties"]["count"] == 3
    wait_for(lambda: len(pool_nodes(aks_nodes, aks["cluster"], "gpu")) == 3, timeout=30, what="the third node")
    wait_for(lambda: all(p.status.phase == "Running" for p in live_pods(cluster.admin.core, namespace, "infer")),
             timeout=30, what="all 11 pods running")
    # Never lowered, never past the pool's bounds or our cap.
    with pytest.raises(CapacityError, match="count 2 is below its current 3") as refused:
        capacity.scale_up("gpu", 2)
    assert refused.value.retryable is False
    with pytest.raises(CapacityError, match=r"count 1001 is outside 0 \.\. 1000"):
        capacity.scale_up("gpu", 1001)
    assert len(mutations(azure_server)) == 1


def test_an_etag_conflict_is_re_read_and_retried(aks: dict[str, Any], azure_server: FakeServer,
                                                 optimizer: Kube) -> None:
    """Another writer changes the pool between our GET and our PUT: our PUT (If-Match: the ETag we read) is a 412,
    the pool is read again and the PUT retried carrying the other writer's change (whole properties re-read)."""
    from azure.core import MatchConditions
    from azure.identity import ManagedIdentityCredential
    from azure.mgmt.containerservice import ContainerServiceClient

    other = ContainerServiceClient(ManagedIdentityCredential(client_id="other-writer"), AZURE_SUBSCRIPTION,
                                   base_url=azure_server.url, connection_verify=str(azure_server.ca_file),
                                   polling_interval=0.1, retry_total=0)
    interleaved: list[str] = []

    def concurrent_writer(request: Any) -> None:
        if request.http_request.method == "PUT" and not interleaved:
            interleaved.append(request.http_request.headers.get("If-Match", ""))
            pool = other.agent_pools.get(RG, aks["cluster"], "gpu")
            pool.properties.tags = {"team": "ml"}
            other.agent_pools.begin_create_or_update(RG, aks["cluster"], "gpu", pool, etag=pool.properties.e_tag,
                                                     match_condition=MatchConditions.IfNotModified).result()

    capacity = provider(optimizer.api, azure_server, aks["cluster"], client_kwargs={
        "raw_request_hook": concurrent_writer})
    assert capacity.scale_up("gpu", 3).desired_size == 3
    assert capacity.conflicts == 1 and interleaved and interleaved[0].strip('"')
    puts = [r for r in mutations(azure_server) if r["method"] == "PUT"]
    assert [(p["body"]["properties"]["count"], p["body"]["properties"].get("tags")) for p in puts] == [
        (2, {"team": "ml"}), (3, None), (3, {"team": "ml"})]  # the other writer's, ours (412), ours re-read
    state = pool_state(azure_server, aks["cluster"], "gpu")["properties"]
    assert state["count"] == 3 and state["tags"] == {"team": "ml"}


def three_nodes(aks: dict[str, Any], aks_nodes: NodeReconciler) -> list[str]:
    aks["capacity"].scale_up("gpu", 3)
    wait_for(lambda: len(ready(aks_nodes, aks["cluster"], "gpu")) == 3, timeout=30, what="3 nodes Ready")
    return [n.name for n in aks["capacity"].get_group("gpu").nodes]


def test_removes_exactly_the_named_node(aks: dict[str, Any], azure_server: FakeServer,
                                        aks_nodes: NodeReconciler) -> None:
    capacity: AksNodePoolsCapacity = aks["capacity"]
    names = three_nodes(aks, aks_nodes)
    victim = names[1]  # neither the newest nor the oldest: AKS's own scale-in would take the highest
    capacity.remove_node("gpu", victim)
    assert removals(azure_server) == [{"pool": "gpu", "machine": victim, "via": "deleteMachines"}]
    posts = [r for r in mutations(azure_server) if r["method"] == "POST"]
    assert [(r["path"].rsplit("/", 2)[-2:], r["body"]) for r in posts] == [
        (["gpu", "deleteMachines"], {"machineNames": [victim]})]
    assert shrinks(azure_server, 3) == [] and pool_state(azure_server, aks["cluster"], "gpu")["properties"][
        "count"] == 2
    wait_for(lambda: capacity.node_gone("gpu", victim), timeout=20, what=f"node {victim} gone")
    assert set(pool_nodes(aks_nodes, aks["cluster"], "gpu")) == set(names) - {victim}
    capacity.remove_node("gpu", victim)  # retried after it is gone: nothing sent
    assert len([r for r in mutations(azure_server) if r["method"] == "POST"]) == 1
    with pytest.raises(NodeNotInGroupError, match=names[0]):
        capacity.remove_node("gpusys", names[0])
    # A System pool never below 1: refused by us, nothing sent.
    [only] = pool_nodes(aks_nodes, aks["cluster"], "gpusys")
    with pytest.raises(CapacityError, match="below 1 node") as refused:
        capacity.remove_node("gpusys", only)
    assert refused.value.retryable is False and len(removals(azure_server)) == 1


REMOVER = """
import sys
from pathlib import Path
from activities.capacity.aks import AksNodePoolsCapacity
from common.kube import kube_api
kubeconfig, sub, rg, cluster, url, ca, client_id, node = sys.argv[1:]
AksNodePoolsCapacity(kube_api(Path(kubeconfig)), subscription=sub, resource_group=rg, cluster=cluster,
                     endpoint_url=url, ca_file=ca, client_id=client_id, polling_interval=0.1).remove_node("gpu", node)
print("returned", flush=True)
"""


def test_a_worker_killed_after_delete_machines_is_sent_then_retried_removes_exactly_one(
        aks: dict[str, Any], azure_server: FakeServer, aks_nodes: NodeReconciler, cluster: Cluster) -> None:
    """SIGKILL of the process removing a node after its deleteMachines reached AKS and before the answer: the
    activity's retry waits while the pool's operation runs (retryable), then finds the machine gone: one removed."""
    from tests.harness.processes import killed_once

    names = three_nodes(aks, aks_nodes)
    victim = names[2]
    azure_server.fault(slow_remove_seconds=3, operation_seconds=1)
    killed_once(REMOVER, [str(cluster.plane.admin_kubeconfig), AZURE_SUBSCRIPTION, RG, aks["cluster"],
                          azure_server.url, str(azure_server.ca_file), AZURE_CLIENT_ID, victim],
                lambda: any(r["path"].endswith("/deleteMachines") for r in azure_server.requests()),
                what="the deleteMachines sent")
    azure_server.fault(slow_remove_seconds=0)

    def retried() -> bool:
        try:
            aks["capacity"].remove_node("gpu", victim)
        except CapacityError as exc:
            assert exc.retryable, exc  # the operation still runs: the activity would retry
            return False
        return True

    wait_for(retried, timeout=30, what="the retried removal done")
    assert len([r for r in mutations(azure_server) if r["method"] == "POST"]) == 1
    assert removals(azure_server) == [{"pool": "gpu", "machine": victim, "via": "deleteMachines"}]
    assert shrinks(azure_server, 3) == []
    wait_for(lambda: aks["capacity"].node_gone("gpu", victim), timeout=20, what="its node gone")


def test_freeze_shield_and_gpu_limit(aks: dict[str, Any], azure_server: FakeServer, cluster: Cluster) -> None:
    capacity: AksNodePoolsCapacity = aks["capacity"]

    def tags() -> dict[str, str]:
        return dict(pool_state(azure_server, aks["cluster"], "gpu")["properties"].get("tags") or {})

    capacity.freeze("gpu", "op-1")
    capacity.freeze("gpu", "op-1")  # retried: the same holder, nothing sent
    assert tags() == {FROZEN_TAG: "op-1"} and capacity.get_group("gpu").frozen_by == "op-1"
    with pytest.raises(FrozenByOtherError, match="op-1"):
        capacity.freeze("gpu", "op-2")
    capacity.unfreeze("gpu", "op-2")  # not its freeze
    assert tags() == {FROZEN_TAG: "op-1"}
    capacity.unfreeze("gpu", "op-1")
    assert tags() == {} and len(mutations(azure_server)) == 2

    node = capacity.get_group("gpu").nodes[0].name
    capacity.shield_node(node, True)
    assert cluster.admin.core.read_node(node).metadata.annotations[SCALE_DOWN_DISABLED] == "true"
    capacity.shield_node(node, False)
    assert SCALE_DOWN_DISABLED not in (cluster.admin.core.read_node(node).metadata.annotations or {})

    # Without the pool's autoscaler the cap is our tag; scale up never passes it; never below what runs.
    assert capacity.set_gpu_limit("gpu", 12) is None
    assert tags() == {LIMIT_TAG: "12"} and capacity.get_group("gpu").gpu_limit == 12
    with pytest.raises(CapacityError, match=r"count 4 is outside 0 \.\. 3"):
        capacity.scale_up("gpu", 4)
    with pytest.raises(CapacityError, match="4 GPUs \\(1 nodes\\) is below its count 2"):
        capacity.set_gpu_limit("gpu", 4)
    assert capacity.set_gpu_limit("gpu", None) == 12
    assert tags() == {} and capacity.get_group("gpu").gpu_limit is None
    assert shrinks(azure_server, 2) == []


def test_the_worker_builds_the_provider_and_refuses_bad_config_naming_the_field(
        worker_capacity: Callable[[dict[str, str]], object]) -> None:
    from models.env import ConfigError
    from worker.config import load_settings

    good = {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "aks-nodepools", "KUBEON_CAPACITY_CLUSTER_NAME": "train",
            "KUBEON_CAPACITY_SUBSCRIPTION": AZURE_SUBSCRIPTION, "KUBEON_CAPACITY_RESOURCE_GROUP": RG,
            "KUBEON_AZURE_ENDPOINT_URL": "https://127.0.0.1:5998"}
    capacity = worker_capacity(good)
    assert isinstance(capacity, AksNodePoolsCapacity)
    assert (capacity.subscription, capacity.resource_group, capacity.cluster, capacity.endpoint_url) == (
        AZURE_SUBSCRIPTION, RG, "train", "https://127.0.0.1:5998")
    for var, value, said in [("KUBEON_CAPACITY_CLUSTER_NAME", "", "the AKS cluster's name"),
                             ("KUBEON_CAPACITY_RESOURCE_GROUP", "ml/prod", "the cluster's resource group"),
                             ("KUBEON_CAPACITY_RESOURCE_GROUP", "ml-prod.", "not ending in '.'"),
                             ("KUBEON_CAPACITY_SUBSCRIPTION", "my-sub", "subscription's id \\(a GUID\\)")]:
        with pytest.raises(ConfigError, match=f"^{var}: .*{said}"):
            load_settings({**good, var: value})
    # Other providers do not need the AKS fields.
    assert load_settings({"KUBEON_CLUSTER": "c"}).capacity_resource_group == ""


def test_kubeon_gpu_doctor_reports_the_agent_pools(aks: dict[str, Any], azure_server: FakeServer, cluster: Cluster,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`kubeon-gpu doctor --json` with capacity.provider aks-nodepools lists the GPU agent pools it finds."""
    import json

    from worker.cli import main

    for var, value in {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "aks-nodepools",
                       "KUBEON_CAPACITY_CLUSTER_NAME": aks["cluster"],
                       "KUBEON_CAPACITY_SUBSCRIPTION": AZURE_SUBSCRIPTION, "KUBEON_CAPACITY_RESOURCE_GROUP": RG,
                       "KUBEON_AZURE_ENDPOINT_URL": azure_server.url,
                       "KUBEON_AZURE_CA_FILE": str(azure_server.ca_file), "AZURE_CLIENT_ID": AZURE_CLIENT_ID}.items():
        monkeypatch.setenv(var, value)
    assert main(["doctor", "--kubeconfig", str(cluster.plane.admin_kubeconfig), "--json"]) == 0
    [found] = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "AKS agent pools"]
    assert found["status"] == "found" and found["detail"].startswith(
        f"AKS cluster {aks['cluster']} in resource group {RG}: GPU agent pools: 2 (gpu (User, count 2, 2 nodes)")
