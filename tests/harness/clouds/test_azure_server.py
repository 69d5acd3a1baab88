"""The local Azure Resource Manager, driven by azure-mgmt-compute over HTTPS (trustme certificate) with
azure-identity's ManagedIdentityCredential: the real bearer-token path and the real LRO poller."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.core.exceptions import HttpResponseError
from azure.core.exceptions import ResourceExistsError
from azure.core.exceptions import ResourceNotFoundError
from azure.identity import ManagedIdentityCredential
from azure.mgmt.compute import ComputeManagementClient

from tests.harness.clouds.azure_server import IDENTITY_HEADER
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_CLIENT_ID as CLIENT_ID
from tests.harness.clouds.local import AZURE_SUBNET as SUBNET
from tests.harness.clouds.local import AZURE_SUBSCRIPTION as SUB

RG = "kubeon-burst-westeurope"


@pytest.fixture(scope="module")
def server(azure_server: FakeServer) -> FakeServer:
    return azure_server


@pytest.fixture
def compute(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> Any:  # bodies are JSON, as the provider sends
    server.reset()
    server.fault(operation_seconds=0.2, retry_after=0)
    monkeypatch.setenv("IDENTITY_ENDPOINT", server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    return ComputeManagementClient(ManagedIdentityCredential(client_id=CLIENT_ID), SUB, base_url=server.url,
                                   connection_verify=str(server.ca_file), polling_interval=0.1, retry_total=0)


def vm(size: str = "Standard_NC4as_T4_v3", zone: str = "1", tags: dict[str, str] | None = None) -> dict[str, Any]:
    return {"location": "westeurope", "zones": [zone], "tags": tags or {"kubeon.io/burst": "p"}, "properties": {
        "hardwareProfile": {"vmSize": size},
        "osProfile": {"computerName": "n1", "adminUsername": "kubeon",
                      "customData": base64.b64encode(b"#cloud-config\n").decode()},
        "networkProfile": {"networkApiVersion": "2020-11-01", "networkInterfaceConfigurations": [{
            "name": "nic", "properties": {"primary": True, "deleteOption": "Delete", "ipConfigurations": [
                {"name": "ip", "properties": {"subnet": {"id": SUBNET}}}]}}]}}}


def test_create_polls_the_async_operation_with_a_bearer_token(compute: Any,
                                                              server: FakeServer) -> None:
    created = compute.virtual_machines.begin_create_or_update(RG, "vm-1", vm()).result()
    assert created.properties.provisioning_state == "Succeeded"
    view = compute.virtual_machines.get(RG, "vm-1", expand="instanceView").properties.instance_view
    assert "PowerState/running" in [s.code for s in view.statuses]
    reqs = server.requests()
    token = next(r for r in reqs if r["path"] == "/msi/token")
    assert token["query"]["client_id"] == CLIENT_ID
    arm = [r for r in reqs if r["path"].startswith("/subscriptions/")]
    assert all(r["authorization"].startswith("Bearer token-") for r in arm)
    assert any("/operations/" in r["path"] for r in arm), "the poller followed Azure-AsyncOperation"
    assert server.state()["vms"][0]["customDataDecoded"] == "#cloud-config\n"


def test_without_a_token_arm_answers_401(server: FakeServer, compute: Any) -> None:
    class NoToken:
        def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            from azure.core.credentials import AccessToken

            return AccessToken("not-issued", 2**31)

    other = ComputeManagementClient(NoToken(), SUB, base_url=server.url,
                                    connection_verify=str(server.ca_file), retry_total=0)
    with pytest.raises(ClientAuthenticationError):
        other.virtual_machines.get(RG, "vm-1")


def test_sku_not_available_is_a_synchronous_409(compute: Any, server: FakeServer) -> None:
    server.fault(sku_not_available=["Standard_NC4as_T4_v3"])
    with pytest.raises(ResourceExistsError) as err:
        compute.virtual_machines.begin_create_or_update(RG, "vm-2", vm())
    assert err.value.error is not None and err.value.error.code == "SkuNotAvailable"


def test_zonal_allocation_failure_arrives_through_the_poller(compute: Any,
                                                             server: FakeServer) -> None:
    server.fault(allocation_failed_zones=["1"])
    poller = compute.virtual_machines.begin_create_or_update(RG, "vm-3", vm(zone="1"))
    with pytest.raises(HttpResponseError) as err:
        poller.result()
    assert err.value.error is not None and err.value.error.code == "ZonalAllocationFailed"
    assert compute.virtual_machines.get(RG, "vm-3").properties.provisioning_state == "Failed"


def test_quota_is_operation_not_allowed(compute: Any, server: FakeServer) -> None:
    server.fault(quota={"family": "standardNCASv3_T4Family"})
    with pytest.raises(HttpResponseError) as err:
        compute.virtual_machines.begin_create_or_update(RG, "vm-4", vm())
    assert err.value.error is not None and err.value.error.code == "OperationNotAllowed"
    assert "standardNCASv3_T4Family Cores quota" in str(err.value)


def test_list_follows_next_link(compute: Any, server: FakeServer) -> None:
    server.fault(page_size=2)
    for n in range(5):
        compute.virtual_machines.begin_create_or_update(RG, f"vm-{n}", vm(), polling=False)
    assert sorted(v.name for v in compute.virtual_machines.list(RG)) == [f"vm-{n}" for n in range(5)]
    assert sum(1 for r in server.requests() if "$skiptoken" in r["query"]) == 2


def test_delete_then_not_found(compute: Any) -> None:
    compute.virtual_machines.begin_create_or_update(RG, "vm-d", vm()).result()
    compute.virtual_machines.begin_delete(RG, "vm-d").result()
    with pytest.raises(ResourceNotFoundError):
        compute.virtual_machines.get(RG, "vm-d")


def test_resource_skus_name_zones_and_gpus(compute: Any, server: FakeServer) -> None:
    server.fault(sku_restricted=["Standard_ND96isr_H100_v5"])
    skus = {s.name: s for s in compute.resource_skus.list(filter="location eq 'westeurope'")}
    t4 = skus["Standard_NC4as_T4_v3"]
    assert t4.location_info[0].zones == ["1", "2", "3"]
    assert {c.name: c.value for c in t4.capabilities}["GPUs"] == "1"
    assert skus["Standard_ND96isr_H100_v5"].restrictions[0].reason_code == "NotAvailableForSubscription"


def test_nth_call_fails_once_with_a_server_error(compute: Any, server: FakeServer) -> None:
    compute.virtual_machines.begin_create_or_update(RG, "vm-n", vm()).result()
    server.fault(fail_nth={"n": 1, "status": 500})
    with pytest.raises(HttpResponseError) as err:
        compute.virtual_machines.get(RG, "vm-n")
    assert err.value.status_code == 500 and err.value.error is not None
    assert err.value.error.code == "InternalServerError"
    assert compute.virtual_machines.get(RG, "vm-n").name == "vm-n"


def test_put_on_an_existing_vm_is_an_update_not_a_second_vm(compute: Any, server: FakeServer) -> None:
    compute.virtual_machines.begin_create_or_update(RG, "vm-u", vm()).result()
    compute.virtual_machines.begin_create_or_update(RG, "vm-u", vm(tags={"kubeon.io/burst": "q"})).result()
    assert [v["tags"] for v in server.state()["vms"]] == [{"kubeon.io/burst": "q"}]
    with pytest.raises(ResourceExistsError):  # a zone cannot change: another zone is another VM name
        compute.virtual_machines.begin_create_or_update(RG, "vm-u", vm(zone="2"))


def test_a_vm_reads_its_attested_data_from_imds(compute: Any, server: FakeServer) -> None:
    """Issue 27: the VM's attested data (a PKCS7 of its vmId, subscription and the nonce of its ticket), from the
    plain-HTTP IMDS as `node join` asks for it, verified by the gateway's own code against the server's CA; the same
    document presented with another ticket is refused."""
    from gateway.attestation import AttestationVerifier
    from gateway.attestation import load_roots
    from models.errors import JoinRefused
    from node.identity import fetch_attestation

    compute.virtual_machines.begin_create_or_update(RG, "attested-1", vm()).result()
    vm_id = compute.virtual_machines.get(RG, "attested-1").vm_id
    imds = server.identity_url.removesuffix("/msi/token")
    attestation = fetch_attestation({"attestation": {"method": "azure"}, "ticket": "t.azure",
                                     "metadataUrl": f"{imds}/_fake/metadata/{vm_id}"})
    verifier = AttestationVerifier(roots={"azure": load_roots(server.identity_ca()["root"])}, accounts={"azure": SUB})
    got = verifier.verify(attestation, "azure/westeurope", ticket="t.azure")
    assert (got.verified, got.instance_id, got.account) == (True, vm_id, SUB)
    with pytest.raises(JoinRefused) as err:
        verifier.verify(attestation, "azure/westeurope", ticket="t.another")
    assert err.value.code == "attestation_replayed"
