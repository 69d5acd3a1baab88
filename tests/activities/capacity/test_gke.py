"""The gke-nodepools capacity provider with the official google-cloud-container / google-cloud-compute REST clients
against the local GKE server (tests/harness/clouds/gke.py: node pools and their per-zone MIGs), the MIGs' VMs kwok
Nodes on the real control plane, read with the optimizer's own credentials (R5.1). Every request the provider sends
is recorded by the server (``gcp_server.requests()``)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import container_v1
from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import FrozenByOtherError
from activities.capacity import GroupNotFoundError
from activities.capacity import NodeNotInGroupError
from activities.capacity.gke import GkeNodePoolsCapacity
from activities.providers.catalog import GCP_GPU_INSTANCES
from models.gke import FROZEN_BY_ANNOTATION
from models.gke import NODEPOOL_LABEL
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import grant
from tests.harness.workloads import node_group_pods

pytestmark = [pytest.mark.cluster]

PROJECT, LOCATION = "acme-ml", "europe-west4"
ZONES = ["europe-west4-a", "europe-west4-b"]
PRICE = next(s.usd_per_hour for s in GCP_GPU_INSTANCES[LOCATION] if s.instance_type == "g2-standard-48")
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}


@pytest.fixture(scope="module")
def optimizer(cluster: Cluster) -> Kube:
    return grant(cluster, "kubeon-gke-capacity-test", OPTIMIZER_RULES)


@pytest.fixture
def pool(gcp_server: FakeServer, gke_nodes: NodeReconciler, optimizer: Kube) -> Iterator[dict[str, Any]]:
    """A 4-GPU L4 pool (g2-standard-48) over two zones, one node per zone, plus a CPU pool; its 2 Nodes Ready."""
    gcp_server.reset()
    gcp_server.fault(operation_seconds=0.3)
    cluster, name = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
    gcp_server.seed(gke={"project": PROJECT, "location": LOCATION, "cluster": cluster, "nodePools": [
        {"name": name, "machineType": "g2-standard-48", "zones": ZONES, "nodeCount": 1,
         "labels": {"kubeon.io/pool": "home"}, "taints": [TAINT]},
        {"name": "system", "machineType": "e2-standard-4", "zones": ZONES[:1], "nodeCount": 1}]})
    wait_for(lambda: len(ready(gke_nodes, name)) == 2, timeout=30, what="the pool's 2 nodes Ready")
    capacity = GkeNodePoolsCapacity(optimizer.api, project=PROJECT, location=LOCATION, cluster=cluster,
                                    endpoint_url=gcp_server.url, backoff=(0.2, 1.0), poll_seconds=0.1)
    yield {"cluster": cluster, "name": name, "capacity": capacity,
           "path": f"projects/{PROJECT}/locations/{LOCATION}/clusters/{cluster}/nodePools/{name}"}
    gcp_server.reset()
    wait_for(lambda: not pool_nodes(gke_nodes, name), timeout=30, what="the pool's nodes gone")


def pool_nodes(nodes: NodeReconciler, name: str) -> dict[str, client.V1Node]:
    return nodes.group(NODEPOOL_LABEL, name)


def ready(nodes: NodeReconciler, name: str) -> list[client.V1Node]:
    return nodes.ready(NODEPOOL_LABEL, name)


def mutations(server: FakeServer) -> list[tuple[str, Any]]:
    """The provider's changing requests: setSize, deleteInstances and the MIG resize that lets the cloud choose."""
    return [(r["path"].rsplit("/", 1)[-1], r["body"]) for r in server.requests() if r["method"] == "POST" and (
        r["path"].endswith((":setSize", "/deleteInstances", "/resize")))]


def deleted(server: FakeServer) -> list[dict[str, Any]]:
    return [d for d in server.state()["deleted"] if d["via"] != "seed"]


def test_lists_the_gpu_pools_with_their_nodes_per_zone(pool: dict[str, Any], gke_nodes: NodeReconciler,
                                                       gcp_server: FakeServer) -> None:
    capacity: GkeNodePoolsCapacity = pool["capacity"]
    groups = capacity.list_groups()
    assert [g.name for g in groups] == [pool["name"]]  # the CPU pool is no GPU pool
    [found] = groups
    assert found.provider == "gke-nodepools" and found.gpu_products == ["NVIDIA-L4"]
    assert found.gpus == 8 and found.taints == ["nvidia.com/gpu"] and found.gpu_limit is None
    assert found.scaling is not None and found.scaling.desired_size == 2
    assert found.scaling.auto_scaling_group == f"{ZONES[0]}=1,{ZONES[1]}=1"  # per zone
    registered = pool_nodes(gke_nodes, pool["name"])
    assert sorted(n.name for n in found.nodes) == sorted(registered)
    for n in found.nodes:
        assert registered[n.name].spec.provider_id.endswith("/" + n.instance) and n.instance == n.name
        assert (n.instance_type, n.gpus, n.gpu_product, n.ready) == ("g2-standard-48", 4, "NVIDIA-L4", True)
        assert n.usd_per_hour == PRICE and PRICE > 4.0016  # the catalogue's europe-west4 price, above us-central1
    assert capacity.get_group(pool["name"]).nodes == found.nodes
    with pytest.raises(GroupNotFoundError, match="system"):
        capacity.get_group("system")
    with pytest.raises(GroupNotFoundError):
        capacity.get_group("missing")
    assert mutations(gcp_server) == []


def test_scale_up_for_the_pending_gpu_pods(pool: dict[str, Any], cluster: Cluster, namespace: str,
                                           gcp_server: FakeServer, gke_nodes: NodeReconciler) -> None:
    capacity: GkeNodePoolsCapacity = pool["capacity"]
    # 11 one-GPU pods on 2 four-GPU nodes: 8 run, 3 wait; one more node per zone serves them.
    cluster.admin.apps.create_namespaced_deployment(namespace, node_group_pods("infer", NODEPOOL_LABEL,
                                                                               pool["name"], 11))

    def pods() -> list[client.V1Pod]:
        return [p for p in cluster.admin.core.list_namespaced_pod(namespace, label_selector="app=infer").items
                if p.metadata.deletion_timestamp is None]

    wait_for(lambda: len([p for p in pods() if p.status.phase == "Running"]) == 8 and len(pods()) == 11,
             timeout=30, what="8 pods running, 3 waiting")
    assert sum(n.gpus_used for n in capacity.get_group(pool["name"]).nodes) == 8
    seen = len(gcp_server.requests())
    after = capacity.scale_up(pool["name"], 3)  # 3 nodes over 2 zones: 2 per zone, one setSize
    # The pool, each zone's MIG, setSize, then get_operation until DONE (0.3 s here, polled each 0.1 s).
    calls = [(r["method"], r["path"].rsplit("/", 1)[-1]) for r in gcp_server.requests()[seen:]]
    assert calls[:4] == [("GET", pool["name"]), ("GET", calls[1][1]), ("GET", calls[2][1]),
                         ("POST", f"{pool['name']}:setSize")] and calls[1][1].endswith("-grp")
    assert len(calls) > 4 and all(c[0] == "GET" and c[1].startswith("operation-") for c in calls[4:])
    print(f"\nAPI calls for one scale up: {len(calls)} ({len(calls) - 4} operation polls)")
    capacity.scale_up(pool["name"], 3)  # a retried activity: the same size, nothing sent
    assert after.desired_size == 4
    assert mutations(gcp_server) == [(f"{pool['name']}:setSize", {"nodeCount": 2})]
    wait_for(lambda: len(pool_nodes(gke_nodes, pool["name"])) == 4, timeout=30, what="4 nodes")
    wait_for(lambda: all(p.status.phase == "Running" for p in pods()), timeout=30, what="all 11 pods running")
    found = capacity.get_group(pool["name"])
    assert found.scaling is not None and found.scaling.auto_scaling_group == f"{ZONES[0]}=2,{ZONES[1]}=2"
    assert capacity.scale_up(pool["name"], 1).desired_size == 4  # never shrinks: nothing sent
    assert len(mutations(gcp_server)) == 1
    assert deleted(gcp_server) == []


def test_a_concurrent_operation_is_retried_after_back_off_one_at_a_time(pool: dict[str, Any],
                                                                        gcp_server: FakeServer) -> None:
    """Another client's operation runs on the cluster: GKE refuses ours (CLUSTER_ALREADY_HAS_OPERATION); the
    provider backs off and sends it again once that operation is done; a 429 is backed off alike."""
    capacity: GkeNodePoolsCapacity = pool["capacity"]
    other = container_v1.ClusterManagerClient(credentials=AnonymousCredentials(), transport="rest",
                                              client_options={"api_endpoint": gcp_server.url})
    gcp_server.fault(operation_seconds=1.5)
    system = pool["path"].rsplit("/", 1)[0] + "/system"
    first = other.set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(name=system, node_count=1))
    capacity.scale_up(pool["name"], 4)
    sizes = [r for r in gcp_server.requests() if r["path"].endswith(":setSize")]
    ours = [r for r in sizes if r["path"] == f"/v1/{pool['path']}:setSize"]
    assert len(ours) >= 2 and all(r["body"] == {"nodeCount": 2} for r in ours)
    # The accepted one came after the other operation ended; every earlier one was refused while it ran.
    started = sizes[0]["time"]
    assert ours[-1]["time"] >= started + 1.5 - 0.1, (started, [r["time"] for r in ours])
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(ours)]
    assert all(g >= 0.2 for g in gaps), gaps  # backed off, never hammered
    assert sizes[0]["path"] == f"/v1/{system}:setSize" and first.name  # the other client's came first
    # A 429 (concurrent operations quota): backed off, then sent again.
    gcp_server.fault(gke_429=2, operation_seconds=0.2)
    capacity.scale_up(pool["name"], 6)
    ours = [r for r in gcp_server.requests() if r["path"] == f"/v1/{pool['path']}:setSize"]
    assert [r["body"] for r in ours[-3:]] == [{"nodeCount": 3}] * 3
    assert capacity.get_group(pool["name"]).scaling.desired_size == 6


def test_a_failed_operation_is_an_error_and_changes_nothing(pool: dict[str, Any], gcp_server: FakeServer) -> None:
    gcp_server.fault(gke_operation_error={"message": "Insufficient regional quota: resource \"NVIDIA_L4_GPUS\"."})
    with pytest.raises(CapacityError, match="NVIDIA_L4_GPUS"):
        pool["capacity"].scale_up(pool["name"], 4)
    assert pool["capacity"].get_group(pool["name"]).scaling.desired_size == 2


def test_removes_exactly_the_named_node_and_never_lets_the_cloud_choose(
        pool: dict[str, Any], gcp_server: FakeServer, gke_nodes: NodeReconciler) -> None:
    capacity: GkeNodePoolsCapacity = pool["capacity"]
    capacity.scale_up(pool["name"], 4)
    wait_for(lambda: len(ready(gke_nodes, pool["name"])) == 4, timeout=30, what="4 nodes Ready")
    found = capacity.get_group(pool["name"])
    victim = found.nodes[1]
    zone = pool_nodes(gke_nodes, pool["name"])[victim.name].metadata.labels["topology.kubernetes.io/zone"]
    seen = len(gcp_server.requests())
    capacity.remove_node(pool["name"], victim.name)
    # 4 calls a removal: the pool (its MIGs), the MIG's VMs, deleteInstances, the VMs again (DELETING confirmed).
    assert [(r["method"], r["path"].rsplit("/", 1)[-1]) for r in gcp_server.requests()[seen:]] == [
        ("GET", pool["name"]), ("POST", "listManagedInstances"), ("POST", "deleteInstances"),
        ("POST", "listManagedInstances")]
    capacity.remove_node(pool["name"], victim.name)  # retried while it is deleting: nothing sent
    removals = [m for m in mutations(gcp_server) if m[0] != f"{pool['name']}:setSize"]
    assert removals == [("deleteInstances", {"instances": [f"zones/{zone}/instances/{victim.name}"],
                                             "skipInstancesOnValidationError": True})]
    wait_for(lambda: capacity.node_gone(pool["name"], victim.name), timeout=20, what=f"node {victim.name} gone")
    assert deleted(gcp_server) == [{"zone": zone, "instance": victim.name, "via": "deleteInstances"}]
    assert set(pool_nodes(gke_nodes, pool["name"])) == {n.name for n in found.nodes} - {victim.name}
    left = capacity.get_group(pool["name"]).scaling
    assert left is not None and left.desired_size == 3
    # Scaling up again never sends a setSize below the zone that kept 2: nothing shrinks behind our back.
    capacity.scale_up(pool["name"], 3)
    assert len([m for m in mutations(gcp_server) if m[0].endswith(":setSize")]) == 1
    capacity.scale_up(pool["name"], 4)
    assert [m for m in mutations(gcp_server) if m[0].endswith(":setSize")][-1][1] == {"nodeCount": 2}
    assert deleted(gcp_server) == [{"zone": zone, "instance": victim.name, "via": "deleteInstances"}]
    assert not [m for m in mutations(gcp_server) if m[0] == "resize"]
    with pytest.raises(NodeNotInGroupError, match=found.nodes[0].name):
        capacity.remove_node("system", found.nodes[0].name)


def test_freeze_shield_and_doctor(pool: dict[str, Any], cluster: Cluster) -> None:
    from models.eks import SCALE_DOWN_DISABLED
    from worker.doctor import check_capacity

    capacity: GkeNodePoolsCapacity = pool["capacity"]
    capacity.freeze(pool["name"], "op-1")
    capacity.freeze(pool["name"], "op-1")  # retried: the same holder
    assert capacity.get_group(pool["name"]).frozen_by == "op-1"
    with pytest.raises(FrozenByOtherError, match="op-1"):
        capacity.freeze(pool["name"], "op-2")
    capacity.unfreeze(pool["name"], "op-2")  # not its freeze
    assert capacity.get_group(pool["name"]).frozen_by == "op-1"
    capacity.unfreeze(pool["name"], "op-1")
    found = capacity.get_group(pool["name"])
    assert found.frozen_by is None
    assert all(FROZEN_BY_ANNOTATION not in (cluster.admin.core.read_node(n.name).metadata.annotations or {})
               for n in found.nodes)
    node = found.nodes[0].name
    capacity.shield_node(node, True)
    assert cluster.admin.core.read_node(node).metadata.annotations[SCALE_DOWN_DISABLED] == "true"
    capacity.shield_node(node, False)
    assert SCALE_DOWN_DISABLED not in (cluster.admin.core.read_node(node).metadata.annotations or {})

    seen = check_capacity(cluster.admin.api, "gke-nodepools", capacity)
    assert (seen.name, seen.status) == ("GKE node pools", "found")
    assert seen.detail == (f"GKE cluster {pool['cluster']} in {PROJECT}/{LOCATION}: GPU node pools: 1 "
                           f"({pool['name']} ({ZONES[0]}=1,{ZONES[1]}=1, 2 nodes))")
    wrong = GkeNodePoolsCapacity(cluster.admin.api, project=PROJECT, location=LOCATION, cluster="no-such-cluster",
                                 endpoint_url=capacity.endpoint_url)
    missing = check_capacity(cluster.admin.api, "gke-nodepools", wrong)
    assert missing.status == "missing" and "no-such-cluster" in missing.detail


def test_the_worker_builds_the_provider_and_refuses_bad_config_naming_the_field(
        worker_capacity: Callable[[dict[str, str]], object]) -> None:
    from models.env import ConfigError
    from worker.config import load_settings

    env = {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "gke-nodepools", "KUBEON_CAPACITY_PROJECT": PROJECT,
           "KUBEON_CAPACITY_LOCATION": LOCATION, "KUBEON_CAPACITY_CLUSTER_NAME": "train",
           "KUBEON_GCP_ENDPOINT_URL": "http://127.0.0.1:5998"}
    capacity = worker_capacity(env)
    assert isinstance(capacity, GkeNodePoolsCapacity)
    assert (capacity.project, capacity.location, capacity.cluster, capacity.endpoint_url) == (
        PROJECT, LOCATION, "train", "http://127.0.0.1:5998")
    with pytest.raises(ConfigError, match=r"KUBEON_CAPACITY_CLUSTER_NAME.*capacity\.gke\.clusterName"):
        load_settings({k: v for k, v in env.items() if k != "KUBEON_CAPACITY_CLUSTER_NAME"})
    with pytest.raises(ConfigError, match=r"KUBEON_CAPACITY_LOCATION.*capacity\.gke\.location.*'Europe West 4'"):
        load_settings({**env, "KUBEON_CAPACITY_LOCATION": "Europe West 4"})
    with pytest.raises(ConfigError, match=r"KUBEON_CAPACITY_PROJECT.*capacity\.gke\.project"):
        load_settings({**env, "KUBEON_CAPACITY_PROJECT": "projects/acme-ml"})


REMOVER = """
import sys
from pathlib import Path
from activities.capacity.gke import GkeNodePoolsCapacity
from common.kube import kube_api
kubeconfig, project, location, cluster, endpoint, pool, node = sys.argv[1:]
GkeNodePoolsCapacity(kube_api(Path(kubeconfig)), project=project, location=location, cluster=cluster,
                     endpoint_url=endpoint, poll_seconds=0.1).remove_node(pool, node)
print("returned", flush=True)
"""


def test_a_worker_killed_after_delete_instances_is_sent_then_retried_removes_exactly_one(
        pool: dict[str, Any], gcp_server: FakeServer, gke_nodes: NodeReconciler, cluster: Cluster) -> None:
    """SIGKILL of the process removing a node after its deleteInstances reached the server and before the answer:
    the activity's retry reads the MIG, finds the VM deleting or gone, and sends nothing: one VM removed."""
    from tests.harness.processes import killed_once

    capacity: GkeNodePoolsCapacity = pool["capacity"]
    victim = capacity.get_group(pool["name"]).nodes[0].name
    gcp_server.fault(slow_remove_seconds=3)
    killed_once(REMOVER, [str(cluster.plane.admin_kubeconfig), PROJECT, LOCATION, pool["cluster"], gcp_server.url,
                          pool["name"], victim],
                lambda: any(r["path"].endswith("/deleteInstances") for r in gcp_server.requests()),
                what="the deleteInstances sent")
    gcp_server.fault(slow_remove_seconds=0)
    capacity.remove_node(pool["name"], victim)  # the retry
    assert [m[0] for m in mutations(gcp_server)] == ["deleteInstances"]
    wait_for(lambda: capacity.node_gone(pool["name"], victim), timeout=20, what="its node gone")
    assert [d["instance"] for d in deleted(gcp_server)] == [victim]
    left = capacity.get_group(pool["name"]).scaling
    assert left is not None and left.desired_size == 1


def test_kubeon_gpu_doctor_reports_the_node_pools(pool: dict[str, Any], gcp_server: FakeServer, cluster: Cluster,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`kubeon-gpu doctor --json` with capacity.provider gke-nodepools lists the GPU node pools it finds."""
    import json

    from worker.cli import main

    for var, value in {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "gke-nodepools",
                       "KUBEON_CAPACITY_PROJECT": PROJECT, "KUBEON_CAPACITY_LOCATION": LOCATION,
                       "KUBEON_CAPACITY_CLUSTER_NAME": pool["cluster"],
                       "KUBEON_GCP_ENDPOINT_URL": gcp_server.url}.items():
        monkeypatch.setenv(var, value)
    assert main(["doctor", "--kubeconfig", str(cluster.plane.admin_kubeconfig), "--json"]) == 0
    [gke] = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "GKE node pools"]
    assert gke["status"] == "found"
    assert gke["detail"] == (f"GKE cluster {pool['cluster']} in {PROJECT}/{LOCATION}: GPU node pools: 1 "
                             f"({pool['name']} ({ZONES[0]}=1,{ZONES[1]}=1, 2 nodes))")
