"""The Azure provider against the local ARM server over HTTPS (azure-mgmt-compute and azure-identity underneath)."""

from __future__ import annotations

import base64

import pytest

from activities.providers.azure import AzureProvider
from activities.providers.errors import InsufficientCapacityError
from activities.providers.errors import ProviderError
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from tests.harness.clouds.azure_server import IDENTITY_HEADER
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.local import AZURE_CLIENT_ID as CLIENT_ID
from tests.harness.clouds.local import AZURE_SUBNET as SUBNET
from tests.harness.clouds.local import AZURE_SUBSCRIPTION as SUB
from tests.harness.clouds.provider_contract import ProviderContract

LOCATION = "azure/westeurope"


@pytest.fixture(scope="module")
def server(azure_server: FakeServer) -> FakeServer:
    return azure_server


def config(**azure: object) -> BurstConfig:
    return BurstConfig.model_validate({"home": "aws/us-east-1", "locations": [
        {"name": LOCATION, "credentials": {"azureClientId": CLIENT_ID},
         "azure": {"subscription": SUB, "resourceGroup": "kubeon-burst-we", "subnetId": SUBNET, **azure}},
        {"name": "azure/eastus", "credentials": {"azureClientId": CLIENT_ID},
         "azure": {"subscription": SUB, "resourceGroup": "kubeon-burst-eus", "subnetId": SUBNET}}]})


@pytest.fixture
def provider(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> AzureProvider:
    server.reset()
    server.fault(operation_seconds=0.1, retry_after=0)
    monkeypatch.setenv("IDENTITY_ENDPOINT", server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    return AzureProvider(config(), endpoint_url=server.url, ca_file=str(server.ca_file), polling_interval=0.1)


def puts(server: FakeServer) -> list[str]:
    return [r["path"].rsplit("/", 1)[1] for r in server.requests() if r["method"] == "PUT"]


class TestAzureProvider(ProviderContract):
    location = LOCATION
    other_location = "azure/eastus"
    instance_type = "Standard_NC4as_T4_v3"
    instances = "vms"
    gone_instance_id = "burst-op-gone-z1"
    creates = staticmethod(puts)

    def list_in_pages(self, server: FakeServer) -> None:
        server.fault(page_size=1)


# The module's own tests launch the contract's request too.
request = TestAzureProvider.request


def test_price_offerings_leave_out_restricted_sizes(provider: AzureProvider, server: FakeServer) -> None:
    server.fault(sku_restricted=["Standard_ND96isr_H100_v5"])
    offers = {o.instance_type: o for o in provider.price_offerings(LOCATION)}
    assert "Standard_ND96isr_H100_v5" not in offers
    assert offers["Standard_NC4as_T4_v3"].instance_usd_per_hour == pytest.approx(0.658)
    assert offers["Standard_NC24ads_A100_v4"].gpu_product == "NVIDIA-A100-80GB-PCIe"


def test_launch_tags_custom_data_and_inline_nic(provider: AzureProvider, server: FakeServer) -> None:
    inst = provider.launch(request(provider), "#cloud-config\nuser data")
    assert inst.state == "running" and inst.instance_id.startswith("burst-op-0123456789ab-")
    assert inst.instance_id.endswith("-z1")
    assert inst.tags[TAG_BURST] == "team.a" and inst.tags[TAG_OPERATION] == "op-0123456789ab"
    body = next(r["body"] for r in server.requests() if r["method"] == "PUT")
    assert body["zones"] == ["1"]
    props = body["properties"]
    assert base64.b64decode(props["osProfile"]["customData"]).decode() == "#cloud-config\nuser data"
    nic = props["networkProfile"]["networkInterfaceConfigurations"][0]["properties"]
    assert nic["deleteOption"] == "Delete" and nic["ipConfigurations"][0]["properties"]["subnet"]["id"] == SUBNET
    assert props["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"] is True
    token = next(r for r in server.requests() if r["path"] == "/msi/token")
    assert token["query"]["client_id"] == CLIENT_ID


def test_zonal_allocation_failure_moves_to_the_next_zone(provider: AzureProvider, server: FakeServer) -> None:
    server.fault(allocation_failed_zones=["1"])
    inst = provider.launch(request(provider), "x")
    assert inst.instance_id.endswith("-z2")
    first, second = puts(server)
    assert first.endswith("-z1") and second.endswith("-z2") and first[:-3] == second[:-3]
    deleted = [r["path"].rsplit("/", 1)[1] for r in server.requests() if r["method"] == "DELETE"]
    assert deleted == [first], "the Failed VM left by the allocation is deleted"


def test_every_zone_failing_is_insufficient_capacity(provider: AzureProvider, server: FakeServer) -> None:
    server.fault(allocation_failed_zones=["1", "2", "3"])
    with pytest.raises(InsufficientCapacityError, match="ZonalAllocationFailed"):
        provider.launch(request(provider), "x")
    assert len(puts(server)) == 3


def test_sku_not_available_is_insufficient_capacity_for_the_region(provider: AzureProvider,
                                                                    server: FakeServer) -> None:
    req = request(provider)
    server.fault(sku_not_available=["Standard_NC4as_T4_v3"])
    with pytest.raises(InsufficientCapacityError, match="SkuNotAvailable"):
        provider.launch(req, "x")
    assert len(puts(server)) == 1


def test_quota_is_a_clear_error_not_retried(provider: AzureProvider, server: FakeServer) -> None:
    req = request(provider)
    server.fault(quota={"family": "standardNCASv3_T4Family"})
    with pytest.raises(ProviderError, match="standardNCASv3_T4Family Cores quota") as err:
        provider.launch(req, "x")
    assert not err.value.retryable and not isinstance(err.value, InsufficientCapacityError)
    assert len(puts(server)) == 1


def test_tls_is_verified(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CA that signed the server's certificate, nothing is sent (no switch turns checks off)."""
    monkeypatch.setenv("IDENTITY_ENDPOINT", server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    provider = AzureProvider(config(), endpoint_url=server.url)
    with pytest.raises(ProviderError, match=r"SSL|certificate"):
        provider.price_offerings(LOCATION)


def test_an_operation_past_the_deadline_fails_the_launch(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server.reset()
    monkeypatch.setenv("IDENTITY_ENDPOINT", server.identity_url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    provider = AzureProvider(config(), endpoint_url=server.url, ca_file=str(server.ca_file), polling_interval=0.1,
                             operation_deadline=1.0)
    req = request(provider)
    server.fault(operation_seconds=30, retry_after=0)
    with pytest.raises(ProviderError, match="not done after 1s") as err:
        provider.launch(req, "x")
    assert err.value.retryable
    assert [i.state for i in provider.list(LOCATION, operation=req.operation)] == ["pending"]
