from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from worker.config import ConfigError
from worker.config import load_settings


def test_defaults_to_recommend_mode() -> None:
    settings = load_settings({"KUBEON_CLUSTER": "prod-use1-a"})
    assert settings.default_mode == "Recommend"
    assert settings.cluster == "prod-use1-a"


def test_default_mode_from_environment() -> None:
    assert load_settings({"KUBEON_CLUSTER": "c", "KUBEON_DEFAULT_MODE": "Approve"}).default_mode == "Approve"


def test_bad_mode_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KUBEON_DEFAULT_MODE"):
        load_settings({"KUBEON_CLUSTER": "c", "KUBEON_DEFAULT_MODE": "Sometimes"})


def test_missing_cluster_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KUBEON_CLUSTER"):
        load_settings({})


@pytest.mark.parametrize(("value", "seconds"), [("60s", 60.0), ("5m", 300.0), ("1m30s", 90.0), ("45", 45.0)])
def test_hub_poll_interval_takes_the_charts_durations(value: str, seconds: float) -> None:
    settings = load_settings({"KUBEON_CLUSTER": "c", "KUBEON_HUB_POLL_INTERVAL": value})
    assert settings.hub_poll_interval == seconds


@pytest.mark.parametrize(("variable", "value", "why"), [
    ("KUBEON_HUB_POLL_INTERVAL", "soon", "not a duration"),
    ("KUBEON_HUB_POLL_INTERVAL", "500ms", "at least 1s"),
    ("KUBEON_HUB_URL", "ftp://hub.example.com", "not an http"),
])
def test_bad_hub_setting_names_the_variable_and_why(variable: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable}: .*{why}"):
        load_settings({"KUBEON_CLUSTER": "c", variable: value})


GCP = {"name": "gcp/europe-west4", "credentials": {"gcpServiceAccount": "kubeon-burst@acme-ml.iam.gserviceaccount.com"},
       "gcp": {"project": "acme-ml"}}
AZURE_SUB = "11111111-2222-3333-4444-555555555555"
AZURE = {"name": "azure/westeurope", "credentials": {"azureClientId": "55555555-6666-7777-8888-999999999999"},
         "azure": {"subscription": AZURE_SUB, "resourceGroup": "kubeon-burst",
                   "subnetId": f"/subscriptions/{AZURE_SUB}/resourceGroups/net/providers/Microsoft.Network/"
                               "virtualNetworks/vnet/subnets/burst"}}


def _burst(tmp_path: Path, location: Mapping[str, object]) -> Any:
    path = tmp_path / "locations.json"
    path.write_text(json.dumps([location]))
    return load_settings({"KUBEON_CLUSTER": "c1", "KUBEON_BURST_LOCATIONS_FILE": str(path)}).burst_config()


def test_gcp_and_azure_locations_are_accepted(tmp_path: Path) -> None:
    for location in (GCP, AZURE):
        config = _burst(tmp_path, location)
        assert config.locations[0].name == location["name"]


def test_gcp_project_defaults_to_the_service_accounts(tmp_path: Path) -> None:
    config = _burst(tmp_path, {**GCP, "gcp": {}})
    assert config.locations[0].gcp.project == "acme-ml"


@pytest.mark.parametrize(("location", "field"), [
    ({**GCP, "gcp": {}, "credentials": {"gcpServiceAccount": "123456789-compute@developer.gserviceaccount.com"}},
     "gcp.project is required"),
    ({**GCP, "gcp": {"project": "Not_A_Project"}}, "burst.locations.0.gcp.project: .*not a project ID"),
    ({**GCP, "name": "gcp/europe-west44"}, "name 'europe-west44' is not a Google Cloud region"),
    ({**GCP, "credentials": {"gcpServiceAccount": "kubeon"}}, "credentials.gcpServiceAccount: .*service account"),
    ({**GCP, "credentials": {}}, "credentials.gcpServiceAccount is required"),
    ({**GCP, "gcp": {"project": "acme-ml", "zones": ["us-central1-a"]}}, "gcp.zones zone 'us-central1-a' is not in"),
    ({**GCP, "gcp": {"project": "acme-ml", "subnetwork": "regions/us-central1/subnetworks/s"}}, "gcp.subnetwork"),
    ({**AZURE, "credentials": {"azureClientId": "not-a-guid"}}, "credentials.azureClientId: .*not a client ID"),
    ({**AZURE, "name": "azure/westeurop"}, "name 'westeurop' is not an Azure region"),
    ({**AZURE, "azure": {**AZURE["azure"], "subscription": None}}, "azure.subscription is required"),  # type: ignore[dict-item]
    ({**AZURE, "azure": {**AZURE["azure"], "subnetId": "subnet-1"}}, "azure.subnetId: .*not a subnet"),  # type: ignore[dict-item]
    ({**AZURE, "azure": {**AZURE["azure"], "image": "ubuntu"}}, "azure.image: .*not an image"),  # type: ignore[dict-item]
])
def test_bad_cloud_location_is_refused_naming_the_field(tmp_path: Path, location: Mapping[str, object],
                                                         field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _burst(tmp_path, location)


@pytest.mark.parametrize(("variable", "value"), [("KUBEON_GCP_ENDPOINT_URL", "127.0.0.1:8470"),
                                                 ("KUBEON_AZURE_ENDPOINT_URL", "http://127.0.0.1:8471")])
def test_cloud_endpoints_need_their_scheme(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        load_settings({"KUBEON_CLUSTER": "c1", variable: value})


# -- capacity.provider eks-nodegroups: cluster name and region checked at start, naming the variable --
EKS = {"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "eks-nodegroups"}


def test_eks_nodegroups_takes_its_cluster_and_region() -> None:
    settings = load_settings({**EKS, "KUBEON_CAPACITY_CLUSTER_NAME": "train_1", "KUBEON_CAPACITY_REGION": "eu-west-1"})
    assert (settings.capacity_provider, settings.capacity_cluster_name, settings.capacity_region) == (
        "eks-nodegroups", "train_1", "eu-west-1")


@pytest.mark.parametrize(("environ", "problem"), [
    ({"KUBEON_CAPACITY_REGION": "eu-west-1"}, "KUBEON_CAPACITY_CLUSTER_NAME: .*required with capacity.provider "
                                              "eks-nodegroups"),
    ({"KUBEON_CAPACITY_CLUSTER_NAME": "train", "KUBEON_CAPACITY_REGION": "eu-westeros-1"},
     "KUBEON_CAPACITY_REGION: .*'eu-westeros-1' is not an AWS region"),
    ({"KUBEON_CAPACITY_CLUSTER_NAME": "train"}, "KUBEON_CAPACITY_REGION: .*'' is not an AWS region"),
    ({"KUBEON_CAPACITY_CLUSTER_NAME": "bad name", "KUBEON_CAPACITY_REGION": "eu-west-1"},
     "KUBEON_CAPACITY_CLUSTER_NAME: .*not 'bad name'"),
])
def test_eks_nodegroups_bad_config_is_refused_naming_the_field(environ: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_settings({**EKS, **environ})


def test_an_unknown_capacity_provider_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"KUBEON_CAPACITY_PROVIDER: .*'eks' is not one of karpenter"):
        load_settings({"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_PROVIDER": "eks"})
    # Other providers need no EKS settings.
    assert load_settings({"KUBEON_CLUSTER": "c", "KUBEON_CAPACITY_REGION": "nowhere"}).capacity_region == "nowhere"
