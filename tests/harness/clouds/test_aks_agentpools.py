"""AKS agent pools and machines on the local Azure Resource Manager, driven by azure-mgmt-containerservice over
HTTPS (the per-run certificate) with azure-identity's ManagedIdentityCredential: the real bearer-token path, ETag
/ If-Match, and the real LRO poller; the kwok Nodes follow the machines."""

from __future__ import annotations

from typing import Any

import pytest
from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError
from azure.core.exceptions import ResourceExistsError
from azure.core.exceptions import ResourceModifiedError
from azure.core.exceptions import ServiceResponseTimeoutError
from azure.identity import ManagedIdentityCredential
from azure.mgmt.containerservice import ContainerServiceClient
from azure.mgmt.containerservice.models import AgentPoolDeleteMachinesParameter

from tests.harness.clouds.azure_server import IDENTITY_HEADER
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_CLIENT_ID as CLIENT_ID
from tests.harness.clouds.local import AZURE_SUBSCRIPTION as SUB
from tests.harness.clouds.nodes import NodeReconciler
from tests.harness.clouds.nodes import group_taints
from tests.harness.kube import wait_for

RG, CLUSTER = "ml-prod", "train"


@pytest.fixture(scope="module")
def nodes(aks_nodes: NodeReconciler) -> NodeReconciler:
    return aks_nodes


@pytest.fixture
def aks(azure_server: FakeServer, nodes: NodeReconciler, monkeypatch: pytest.MonkeyPatch) -> Any:
    azure_server.reset()
    azure_server.fault(operation_seconds=0.3, retry_after=0)
    azure_server.seed(aks={"subscription": SUB, "resourceGroup": RG, "cluster": CLUSTER, "location": "westeurope",
                           "agentPools": [
                               {"name": "gpu", "vmSize": "Standard_NC64as_T4_v3", "count": 2, "mode": "User",
                                "nodeTaints": ["sku=gpu:NoSchedule"]},
                               {"name": "system", "vmSize": "Standard_D4s_v5", "count": 1, "mode": "System"}]})
    monkeypatch.setenv("IDENTITY_ENDPOINT", azure_server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    return ContainerServiceClient(ManagedIdentityCredential(client_id=CLIENT_ID), SUB, base_url=azure_server.url,
                                  connection_verify=str(azure_server.ca_file), polling_interval=0.1, retry_total=0)


def _gpu_nodes(nodes: NodeReconciler) -> dict[str, Any]:
    return {k: n for k, n in nodes.nodes().items() if n.metadata.labels["kubernetes.azure.com/agentpool"] == "gpu"}


def _scale(aks: Any, pool: str, count: int) -> Any:
    current = aks.agent_pools.get(RG, CLUSTER, pool)
    current.properties.count = count
    return aks.agent_pools.begin_create_or_update(RG, CLUSTER, pool, current, etag=current.properties.e_tag,
                                                  match_condition=MatchConditions.IfNotModified)


def test_pools_and_machines_are_listed_and_the_machines_are_gpu_nodes(aks: Any, nodes: NodeReconciler,
                                                                      azure_server: FakeServer) -> None:
    pools = {p.name: p for p in aks.agent_pools.list(RG, CLUSTER)}
    assert sorted(pools) == ["gpu", "system"]
    assert pools["gpu"].properties.count == 2 and pools["system"].properties.mode == "System"
    machines = [m.name for m in aks.machines.list(RG, CLUSTER, "gpu")]
    assert len(machines) == 2 and all(m.startswith("aks-gpu-") for m in machines)
    wait_for(lambda: set(_gpu_nodes(nodes)) == set(machines), timeout=20, what="the gpu pool's nodes")
    node = _gpu_nodes(nodes)[machines[0]]
    resource_id = aks.machines.get(RG, CLUSTER, "gpu", machines[0]).properties.resource_id
    assert node.spec.provider_id.startswith("azure:///subscriptions/") and node.spec.provider_id.endswith(
        resource_id.split("/providers/", 1)[1])
    assert f"/resourcegroups/mc_{RG}_{CLUSTER}_westeurope/" in node.spec.provider_id.lower()
    assert node.status.capacity["nvidia.com/gpu"] == "4"
    assert node.metadata.labels["kubernetes.azure.com/accelerator"] == "nvidia"
    assert group_taints(node) == [("sku", "gpu", "NoSchedule")]
    assert pools["gpu"].properties.node_taints == ["sku=gpu:NoSchedule"]
    arm = [r for r in azure_server.requests() if r["path"].startswith("/subscriptions/")]
    assert arm and all(r["authorization"].startswith("Bearer token-") for r in arm)


def test_scale_up_with_the_etag_is_polled_until_the_new_machines_exist(aks: Any, nodes: NodeReconciler,
                                                                       azure_server: FakeServer) -> None:
    result = _scale(aks, "gpu", 3).result()
    assert result.properties.count == 3 and result.properties.provisioning_state == "Succeeded"
    assert len(list(aks.machines.list(RG, CLUSTER, "gpu"))) == 3
    wait_for(lambda: len(_gpu_nodes(nodes)) == 3, timeout=20, what="3 gpu nodes")
    reqs = azure_server.requests()
    put = next(r for r in reqs if r["method"] == "PUT")
    assert put["body"]["properties"]["count"] == 3 and put["body"]["properties"]["vmSize"] == "Standard_NC64as_T4_v3"
    assert any("/Microsoft.ContainerService/locations/westeurope/operations/" in r["path"] for r in reqs)


def test_a_stale_etag_is_a_412(aks: Any) -> None:
    stale = aks.agent_pools.get(RG, CLUSTER, "gpu")
    _scale(aks, "gpu", 3).result()
    stale.properties.count = 4
    with pytest.raises(ResourceModifiedError) as err:
        aks.agent_pools.begin_create_or_update(RG, CLUSTER, "gpu", stale, etag=stale.properties.e_tag,
                                               match_condition=MatchConditions.IfNotModified)
    assert err.value.status_code == 412 and err.value.error is not None
    assert err.value.error.code == "PreconditionFailed"
    assert aks.agent_pools.get(RG, CLUSTER, "gpu").properties.count == 3


def test_delete_machines_removes_exactly_the_named_machine_and_its_node(aks: Any, nodes: NodeReconciler,
                                                                        azure_server: FakeServer) -> None:
    _scale(aks, "gpu", 3).result()
    machines = sorted(m.name for m in aks.machines.list(RG, CLUSTER, "gpu"))
    victim = machines[1]  # neither the newest nor the oldest: the cloud's own choice would differ
    wait_for(lambda: victim in _gpu_nodes(nodes), timeout=20, what=f"node {victim}")
    aks.agent_pools.begin_delete_machines(RG, CLUSTER, "gpu", AgentPoolDeleteMachinesParameter(
        machine_names=[victim])).result()
    assert [d for d in azure_server.state()["machineDeleted"] if d["via"] != "seed"] == [
        {"pool": "gpu", "machine": victim, "via": "deleteMachines"}]
    assert sorted(m.name for m in aks.machines.list(RG, CLUSTER, "gpu")) == [m for m in machines if m != victim]
    assert aks.agent_pools.get(RG, CLUSTER, "gpu").properties.count == 2
    wait_for(lambda: set(_gpu_nodes(nodes)) == set(machines) - {victim}, timeout=20,
             what=f"node {victim} gone, the others kept")
    post = [r for r in azure_server.requests() if r["path"].endswith("/deleteMachines")]
    assert [r["body"] for r in post] == [{"machineNames": [victim]}]


def test_a_system_pool_never_goes_below_one(aks: Any) -> None:
    only = next(iter(aks.machines.list(RG, CLUSTER, "system"))).name
    with pytest.raises(HttpResponseError, match="at least 1 node") as err:
        aks.agent_pools.begin_delete_machines(RG, CLUSTER, "system", AgentPoolDeleteMachinesParameter(
            machine_names=[only]))
    assert err.value.status_code == 400
    with pytest.raises(HttpResponseError, match="between 1 and 1000"):
        _scale(aks, "system", 0)
    assert _scale(aks, "gpu", 0).result().properties.count == 0  # a User pool may be empty


def test_an_operation_that_fails_arrives_through_the_poller(aks: Any, azure_server: FakeServer) -> None:
    azure_server.fault(aks_operation_error={"code": "ReconcileVMSSAgentPoolFailed", "message": "Code=\"Allocation"
                                            "Failed\" Message=\"Allocation failed.\""})
    with pytest.raises(HttpResponseError) as err:
        _scale(aks, "gpu", 4).result()
    assert err.value.error is not None and err.value.error.code == "ReconcileVMSSAgentPoolFailed"
    pool = aks.agent_pools.get(RG, CLUSTER, "gpu")
    assert pool.properties.provisioning_state == "Failed" and pool.properties.count == 2
    assert len(list(aks.machines.list(RG, CLUSTER, "gpu"))) == 2


def test_a_429_then_the_same_call_succeeds(aks: Any, azure_server: FakeServer) -> None:
    azure_server.fault(aks_429=1)
    with pytest.raises(HttpResponseError) as err:
        aks.agent_pools.get(RG, CLUSTER, "gpu")
    assert err.value.status_code == 429 and err.value.response.headers["Retry-After"] == "0"
    assert aks.agent_pools.get(RG, CLUSTER, "gpu").properties.count == 2


def test_a_concurrent_operation_is_a_409(aks: Any, azure_server: FakeServer) -> None:
    victim = next(iter(aks.machines.list(RG, CLUSTER, "gpu"))).name
    azure_server.fault(aks_concurrent=True)  # injected: another party's operation runs on the cluster
    with pytest.raises(ResourceExistsError, match="in progress") as err:
        aks.agent_pools.begin_delete_machines(RG, CLUSTER, "gpu", AgentPoolDeleteMachinesParameter(
            machine_names=[victim]))
    assert err.value.error is not None and err.value.error.code == "OperationNotAllowed"
    azure_server.fault(operation_seconds=5)
    running = _scale(aks, "gpu", 3)  # the injection was used once: this one starts, and runs
    with pytest.raises(ResourceExistsError, match="in progress"):
        aks.agent_pools.begin_delete_machines(RG, CLUSTER, "gpu", AgentPoolDeleteMachinesParameter(
            machine_names=[victim]))
    assert not running.done()
    assert [d["via"] for d in azure_server.state()["machineDeleted"]] == []


def test_a_caller_gone_before_the_answer_still_removed_exactly_one(aks: Any, azure_server: FakeServer) -> None:
    """slow_remove_seconds: deleteMachines has started when the caller stops waiting (a SIGKILLed worker's window)."""
    victim = sorted(m.name for m in aks.machines.list(RG, CLUSTER, "gpu"))[0]
    azure_server.fault(slow_remove_seconds=3)
    with pytest.raises(ServiceResponseTimeoutError):  # the caller stopped waiting
        aks.agent_pools.begin_delete_machines(RG, CLUSTER, "gpu", AgentPoolDeleteMachinesParameter(
            machine_names=[victim]), read_timeout=0.5)
    azure_server.fault(slow_remove_seconds=0)
    wait_for(lambda: azure_server.state()["machineDeleted"] == [
        {"pool": "gpu", "machine": victim, "via": "deleteMachines"}], timeout=20, what=f"{victim} removed, only it")
    left = [m.name for m in aks.machines.list(RG, CLUSTER, "gpu")]
    assert len(left) == 1 and victim not in left
