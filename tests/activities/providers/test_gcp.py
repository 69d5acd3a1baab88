"""The GCP provider against the local Compute Engine server (google-cloud-compute underneath)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from activities.providers.errors import InsufficientCapacityError
from activities.providers.errors import ProviderError
from activities.providers.gcp import GcpProvider
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.provider_contract import ProviderContract

LOCATION = "gcp/europe-west4"
SA = "kubeon-burst@acme-ml.iam.gserviceaccount.com"


@pytest.fixture(scope="module")
def server(gcp_server: FakeServer) -> FakeServer:
    return gcp_server


def config(**gcp: object) -> BurstConfig:
    return BurstConfig.model_validate({"home": "aws/us-east-1", "locations": [
        {"name": LOCATION, "credentials": {"gcpServiceAccount": SA}, "gcp": {"project": "acme-ml", **gcp}},
        {"name": "gcp/us-central1", "credentials": {"gcpServiceAccount": SA}, "gcp": {"project": "acme-ml"}}]})


@pytest.fixture
def provider(server: FakeServer) -> GcpProvider:
    server.reset()
    server.fault(operation_seconds=0.1)
    return GcpProvider(config(), endpoint_url=server.url)


def inserts(server: FakeServer) -> list[str]:
    return [r["path"].split("/zones/")[1].split("/")[0] for r in server.requests()
            if r["method"] == "POST" and r["path"].endswith("/instances")]


class TestGcpProvider(ProviderContract):
    location = LOCATION
    other_location = "gcp/us-central1"
    instance_type = "g2-standard-4"
    instances = "instances"
    gone_instance_id = "europe-west4-a/burst-op-gone"
    creates = staticmethod(inserts)


# The module's own tests launch the contract's request too.
request = TestGcpProvider.request


def test_price_offerings_are_the_catalogue_where_the_api_offers_the_type(provider: GcpProvider,
                                                                         server: FakeServer) -> None:
    server.fault(missing_machine_types={z: ["a3-highgpu-8g"] for z in
                                        ("europe-west4-a", "europe-west4-b", "europe-west4-c")})
    offers = {o.instance_type: o for o in provider.price_offerings(LOCATION)}
    assert "a3-highgpu-8g" not in offers
    assert offers["g2-standard-4"].instance_usd_per_hour == pytest.approx(0.7419)
    assert offers["g2-standard-48"].gpus == 4 and offers["g2-standard-48"].gpu_product == "NVIDIA-L4"
    assert offers["g2-standard-4"].transfer_usd_per_gpu_hour == pytest.approx(0.09)  # another cloud than home


def test_launch_labels_metadata_and_maintenance(provider: GcpProvider, server: FakeServer) -> None:
    inst = provider.launch(request(provider), "#cloud-config\nuser data")
    assert inst.state == "running" and inst.instance_id == "europe-west4-a/burst-op-0123456789ab"
    assert inst.tags[TAG_BURST] == "team.a" and inst.tags[TAG_OPERATION] == "op-0123456789ab"
    body = next(r for r in server.requests() if r["method"] == "POST" and r["path"].endswith("/instances"))
    assert body["query"]["requestId"]
    assert body["body"]["labels"] == {"kubeon-burst": "team_a", "kubeon-operation": "op-0123456789ab",
                                      "kubeon-cluster": "prod"}
    assert body["body"]["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert body["body"]["metadata"]["items"] == [{"key": "user-data", "value": "#cloud-config\nuser data"}]


def test_stockout_moves_to_the_next_zone(provider: GcpProvider, server: FakeServer) -> None:
    server.fault(stockout_zones=["europe-west4-a"])
    inst = provider.launch(request(provider), "x")
    assert inst.instance_id.startswith("europe-west4-b/")
    assert inserts(server) == ["europe-west4-a", "europe-west4-b"]


def test_stockout_everywhere_is_insufficient_capacity(provider: GcpProvider, server: FakeServer) -> None:
    server.fault(stockout_zones=["europe-west4-a", "europe-west4-b", "europe-west4-c"])
    with pytest.raises(InsufficientCapacityError, match="ZONE_RESOURCE_POOL_EXHAUSTED"):
        provider.launch(request(provider), "x")
    assert inserts(server) == ["europe-west4-a", "europe-west4-b", "europe-west4-c"]
    assert not server.state()["instances"]


@pytest.mark.parametrize("in_operation", [False, True])
def test_quota_is_a_clear_error_not_retried(provider: GcpProvider, server: FakeServer, in_operation: bool) -> None:
    req = request(provider)
    server.fault(quota={"metric": "NVIDIA_L4_GPUS", "in_operation": in_operation})
    with pytest.raises(ProviderError, match="quota NVIDIA_L4_GPUS exceeded") as err:
        provider.launch(req, "x")
    assert not err.value.retryable and not isinstance(err.value, InsufficientCapacityError)
    assert inserts(server) == ["europe-west4-a"], "a quota blocks the region: no other zone is tried"


def test_done_with_only_error_set_is_a_failure(provider: GcpProvider, server: FakeServer) -> None:
    req = request(provider)
    server.fault(done_error_only=True)
    with pytest.raises(ProviderError, match="RESOURCE_OPERATION_RATE_EXCEEDED"):
        provider.launch(req, "x")


def test_configured_zones_are_the_ones_tried(server: FakeServer) -> None:
    server.reset()
    provider = GcpProvider(config(zones=["europe-west4-c"]), endpoint_url=server.url)
    assert provider.launch(request(provider), "x").instance_id.startswith("europe-west4-c/")
    assert inserts(server) == ["europe-west4-c"]


def test_a_server_error_is_retryable(provider: GcpProvider, server: FakeServer) -> None:
    req = request(provider)
    server.fault(fail_nth={"n": 2, "status": 500})  # the lookup passes, the insert fails
    with pytest.raises(ProviderError) as err:
        provider.launch(req, "x")
    assert err.value.retryable
    assert provider.launch(req, "x").state == "running"


def test_offering_of_another_price_list(server: FakeServer) -> None:
    server.reset()
    provider = GcpProvider(BurstConfig.model_validate({"locations": [{
        "name": LOCATION, "credentials": {"gcpServiceAccount": SA}, "gcp": {"project": "acme-ml"},
        "offerings": [{"instanceType": "g2-standard-8", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.5}]}]}),
        endpoint_url=server.url)
    assert [(o.instance_type, o.instance_usd_per_hour) for o in provider.price_offerings(LOCATION)] == [
        ("g2-standard-8", 0.5)]


def test_no_builtin_prices_for_a_region_is_named(server: FakeServer) -> None:
    provider = GcpProvider(BurstConfig.model_validate({"locations": [{
        "name": "gcp/asia-east1", "credentials": {"gcpServiceAccount": SA}, "gcp": {"project": "acme-ml"}}]}),
        endpoint_url=server.url)
    with pytest.raises(ProviderError, match="no built-in prices for asia-east1; configure offerings"):
        provider.price_offerings("gcp/asia-east1")




def test_an_operation_past_the_deadline_fails_the_launch(server: FakeServer) -> None:
    server.reset()
    provider = GcpProvider(config(), endpoint_url=server.url, operation_deadline=1.0)
    req = request(provider)
    server.fault(operation_seconds=30)
    with pytest.raises(ProviderError, match="not done after 1s") as err:
        provider.launch(req, "x")
    assert err.value.retryable  # the retry finds the instance by its label once it runs
    waits = [r for r in server.requests() if r["path"].endswith("/wait")]
    assert waits and all("/zones/europe-west4-a/" in r["path"] for r in waits), "polled here, at this endpoint"


def test_without_an_emulator_the_locations_service_account_is_impersonated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own identity (here an ADC file; workload identity in a cluster) is the source; the calls carry
    the location's service account. Nothing is sent until a call refreshes the token."""
    from google.auth import impersonated_credentials

    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "c", "client_secret": "s",
                               "refresh_token": "r"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    provider = GcpProvider(config())
    creds = provider._credentials(config().location(LOCATION))
    assert isinstance(creds, impersonated_credentials.Credentials)
    assert creds.service_account_email == SA
