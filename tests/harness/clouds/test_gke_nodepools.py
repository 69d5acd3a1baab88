"""GKE node pools on the local Compute Engine server, driven by google-cloud-container's REST transport (node pools,
setSize, operations) and google-cloud-compute (the pools' managed instance groups): the kwok Nodes follow."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from google.cloud import container_v1

from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import group_taints
from tests.harness.kube import wait_for

PROJECT, LOCATION, CLUSTER = "acme-ml", "europe-west4", "train"
ZONES = ["europe-west4-a", "europe-west4-b"]
POOL = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}/nodePools/gpu"


@pytest.fixture(scope="module")
def nodes(gke_nodes: NodeReconciler) -> NodeReconciler:
    return gke_nodes


@pytest.fixture
def gke(gcp_server: FakeServer, nodes: NodeReconciler) -> dict[str, Any]:
    gcp_server.reset()
    gcp_server.fault(operation_seconds=0.3)
    gcp_server.seed(gke={"project": PROJECT, "location": LOCATION, "cluster": CLUSTER, "nodePools": [
        {"name": "gpu", "machineType": "g2-standard-48", "zones": ZONES, "nodeCount": 1,
         "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}]},
        {"name": "system", "machineType": "e2-standard-4", "zones": ZONES[:1], "nodeCount": 1}]})
    creds, options = AnonymousCredentials(), {"api_endpoint": gcp_server.url}
    return {"container": container_v1.ClusterManagerClient(credentials=creds, transport="rest",
                                                           client_options=options),
            "migs": compute_v1.InstanceGroupManagersClient(credentials=creds, transport="rest",
                                                            client_options=options),
            "zone_ops": compute_v1.ZoneOperationsClient(credentials=creds, transport="rest", client_options=options)}


def _done(gke: dict[str, Any], op: container_v1.Operation) -> container_v1.Operation:
    name = f"projects/{PROJECT}/locations/{LOCATION}/operations/{op.name}"
    return wait_for(lambda: (got := gke["container"].get_operation(name=name)).status
                    == container_v1.Operation.Status.DONE and got, timeout=20, what=f"operation {op.name} DONE",
                    retry_on=())


def _zone_done(gke: dict[str, Any], zone: str, op: compute_v1.Operation) -> None:
    """A compute zone operation waited for as the product does (``ZoneOperations.wait``, on the same endpoint)."""
    wait_for(lambda: gke["zone_ops"].wait(project=PROJECT, zone=zone, operation=op.name).status
             == compute_v1.Operation.Status.DONE, timeout=20, what=f"zone operation {op.name}", retry_on=())


def _mig(url: str) -> tuple[str, str]:
    return url.split("/zones/")[1].split("/")[0], url.rsplit("/", 1)[-1]


def _members(gke: dict[str, Any], zone: str, mig: str) -> list[compute_v1.ManagedInstance]:
    return list(gke["migs"].list_managed_instances(project=PROJECT, zone=zone, instance_group_manager=mig))


def _pool_nodes(nodes: NodeReconciler, pool: str = "gpu") -> dict[str, Any]:
    return {k: n for k, n in nodes.nodes().items() if n.metadata.labels["cloud.google.com/gke-nodepool"] == pool}


def test_pool_lists_one_mig_per_zone_and_its_vms_are_gpu_nodes(gke: dict[str, Any], nodes: NodeReconciler) -> None:
    pools = gke["container"].list_node_pools(parent=POOL.rsplit("/nodePools/", 1)[0]).node_pools
    assert sorted(p.name for p in pools) == ["gpu", "system"]
    pool = gke["container"].get_node_pool(name=POOL)
    assert pool.config.machine_type == "g2-standard-48" and pool.status == container_v1.NodePool.Status.RUNNING
    assert sorted(_mig(u)[0] for u in pool.instance_group_urls) == ZONES
    vms = {m.name for u in pool.instance_group_urls for m in _members(gke, *_mig(u))}
    assert len(vms) == 2
    wait_for(lambda: set(_pool_nodes(nodes)) == vms, timeout=20, what="gpu nodes")
    found = _pool_nodes(nodes)
    node = found[sorted(vms)[0]]
    zone = node.metadata.labels["topology.kubernetes.io/zone"]
    assert node.spec.provider_id == f"gce://{PROJECT}/{zone}/{node.metadata.name}"
    assert node.status.capacity["nvidia.com/gpu"] == "4"
    assert node.metadata.labels["cloud.google.com/gke-accelerator"] == "nvidia-l4"
    assert group_taints(node) == [("nvidia.com/gpu", "present", "NoSchedule")]
    assert pool.config.taints[0].effect == container_v1.NodeTaint.Effect.NO_SCHEDULE


def test_set_size_is_per_zone_and_an_operation_polled_until_done(gke: dict[str, Any], nodes: NodeReconciler,
                                                                 gcp_server: FakeServer) -> None:
    op = gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(name=POOL, node_count=2))
    assert op.operation_type == container_v1.Operation.Type.SET_NODE_POOL_SIZE
    assert op.status == container_v1.Operation.Status.RUNNING
    assert gke["container"].get_node_pool(name=POOL).status == container_v1.NodePool.Status.RECONCILING
    done = _done(gke, op)
    assert not done.error.message
    urls = gke["container"].get_node_pool(name=POOL).instance_group_urls
    assert [len(_members(gke, *_mig(u))) for u in urls] == [2, 2]
    assert all(gke["migs"].get(project=PROJECT, zone=_mig(u)[0], instance_group_manager=_mig(u)[1]).target_size
               == 2 for u in urls)
    wait_for(lambda: len(_pool_nodes(nodes)) == 4, timeout=20, what="4 gpu nodes")
    setsize = [r for r in gcp_server.requests() if r["path"].endswith(":setSize")]
    assert [(r["path"], r["body"]) for r in setsize] == [(f"/v1/{POOL}:setSize", {"nodeCount": 2})]


def test_delete_instances_removes_exactly_the_named_vm_and_its_node(gke: dict[str, Any], nodes: NodeReconciler,
                                                                    gcp_server: FakeServer) -> None:
    url = gke["container"].get_node_pool(name=POOL).instance_group_urls[0]
    zone, mig = _mig(url)
    _done(gke, gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(
        name=POOL, node_count=3)))
    members = _members(gke, zone, mig)
    victim = members[1].name
    wait_for(lambda: victim in _pool_nodes(nodes), timeout=20, what=f"node {victim}")
    op = gke["migs"].delete_instances_unary(
        project=PROJECT, zone=zone, instance_group_manager=mig,
        instance_group_managers_delete_instances_request_resource=compute_v1.InstanceGroupManagersDeleteInstancesRequest(
            instances=[f"zones/{zone}/instances/{victim}"], skip_instances_on_validation_error=True))
    _zone_done(gke, zone, op)
    assert gcp_server.state()["deleted"] == [{"zone": zone, "instance": victim, "via": "deleteInstances"}]
    left = {m.name for m in _members(gke, zone, mig)}
    assert left == {m.name for m in members} - {victim}
    assert gke["migs"].get(project=PROJECT, zone=zone, instance_group_manager=mig).target_size == 2
    wait_for(lambda: victim not in _pool_nodes(nodes) and left <= set(_pool_nodes(nodes)), timeout=20,
             what=f"node {victim} gone, the others kept")
    with pytest.raises(exceptions.NotFound):
        compute_v1.InstancesClient(credentials=AnonymousCredentials(), transport="rest", client_options={
            "api_endpoint": gcp_server.url}).get(project=PROJECT, zone=zone, instance=victim)


def test_resize_down_lets_the_cloud_choose_and_says_so(gke: dict[str, Any], gcp_server: FakeServer) -> None:
    zone, mig = _mig(gke["container"].get_node_pool(name=POOL).instance_group_urls[0])
    _zone_done(gke, zone, gke["migs"].resize_unary(project=PROJECT, zone=zone, instance_group_manager=mig, size=0))
    assert [d["via"] for d in gcp_server.state()["deleted"]] == ["resize"]
    assert _members(gke, zone, mig) == []


def test_a_second_operation_on_the_cluster_is_refused_while_one_runs(gke: dict[str, Any],
                                                                     gcp_server: FakeServer) -> None:
    gcp_server.fault(operation_seconds=5)
    first = gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(name=POOL, node_count=2))
    other = POOL.replace("/gpu", "/system")
    with pytest.raises(exceptions.BadRequest, match="incompatible operation") as err:  # HTTP 400, as GKE
        gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(name=other, node_count=2),
                                            retry=None)
    assert err.value.reason == "CLUSTER_ALREADY_HAS_OPERATION" and first.name in err.value.message


def test_an_operation_that_fails_is_done_with_error_and_changes_nothing(gke: dict[str, Any],
                                                                        gcp_server: FakeServer) -> None:
    gcp_server.fault(gke_operation_error={"message": "Insufficient regional quota to satisfy request: resource "
                                          "\"NVIDIA_L4_GPUS\"."})
    done = _done(gke, gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(
        name=POOL, node_count=3)))
    assert "NVIDIA_L4_GPUS" in done.error.message and done.error.code == 13
    urls = gke["container"].get_node_pool(name=POOL).instance_group_urls
    assert [len(_members(gke, *_mig(u))) for u in urls] == [1, 1]


def test_a_429_then_the_retry_succeeds(gke: dict[str, Any], gcp_server: FakeServer) -> None:
    gcp_server.fault(gke_429=1)
    request = container_v1.SetNodePoolSizeRequest(name=POOL, node_count=1)
    with pytest.raises(exceptions.TooManyRequests, match="concurrent operations quota"):
        gke["container"].set_node_pool_size(request=request, retry=None)
    assert not _done(gke, gke["container"].set_node_pool_size(request=request)).error.message


def test_a_caller_gone_before_the_answer_still_removed_exactly_one(gke: dict[str, Any],
                                                                   gcp_server: FakeServer) -> None:
    """slow_remove_seconds: the removal has started when the caller stops waiting (a SIGKILLed worker's window)."""
    zone, mig = _mig(gke["container"].get_node_pool(name=POOL).instance_group_urls[0])
    _done(gke, gke["container"].set_node_pool_size(request=container_v1.SetNodePoolSizeRequest(
        name=POOL, node_count=2)))
    victim = _members(gke, zone, mig)[0].name
    gcp_server.fault(slow_remove_seconds=3)
    with pytest.raises(requests.exceptions.ReadTimeout):  # the caller stopped waiting
        gke["migs"].delete_instances_unary(
            project=PROJECT, zone=zone, instance_group_manager=mig, timeout=0.5, retry=None,
            instance_group_managers_delete_instances_request_resource=compute_v1.
            InstanceGroupManagersDeleteInstancesRequest(instances=[f"zones/{zone}/instances/{victim}"]))
    wait_for(lambda: gcp_server.state()["deleted"] == [{"zone": zone, "instance": victim, "via": "deleteInstances"}],
             timeout=20, what=f"{victim} removed, and only it")
    assert len(_members(gke, zone, mig)) == 1
