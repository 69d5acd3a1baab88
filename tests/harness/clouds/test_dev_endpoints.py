"""``.kubeon/dev/endpoints.json`` is enough for the official SDKs: each entry, read back from JSON as a user would,
authenticates a real call (Azure: a token from the identity endpoint the file names; before, every token got 401)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.identity import DefaultAzureCredential
from azure.identity import ManagedIdentityCredential

from tests.harness.clouds.dev import endpoints
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.moto_server import MotoServer


@pytest.fixture
def entries(moto_server: MotoServer, gcp_server: FakeServer, azure_server: FakeServer) -> dict[str, Any]:
    return dict(json.loads(json.dumps(endpoints(moto_server, gcp_server, azure_server))))


def _env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET", "AZURE_CLIENT_ID",
                 "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("credential", [
    lambda entry: ManagedIdentityCredential(client_id=entry["clientId"]),
    lambda entry: DefaultAzureCredential(),  # its managed identity: AZURE_CLIENT_ID from the env
], ids=["ManagedIdentityCredential", "DefaultAzureCredential"])
def test_the_azure_entry_authenticates_azure_mgmt_compute(entries: dict[str, Any], azure_server: FakeServer,
                                                          monkeypatch: pytest.MonkeyPatch, credential: Any) -> None:
    from azure.mgmt.compute import ComputeManagementClient

    azure = entries["azure"]
    _env(monkeypatch, azure["env"])
    compute = ComputeManagementClient(credential(azure), azure["subscription"], base_url=azure["url"],
                                      connection_verify=azure["ca"], retry_total=0)
    assert list(compute.virtual_machines.list(azure["resourceGroup"])) == []
    skus = compute.resource_skus.list(filter="location eq 'westeurope'")
    assert any(s.name == "Standard_NC4as_T4_v3" for s in skus)
    token = [r for r in azure_server.requests() if r["path"] == "/msi/token"][-1]
    assert token["query"]["client_id"] == azure["clientId"]


def test_without_the_identity_endpoint_the_same_client_gets_401(entries: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from azure.core.credentials import AccessToken
    from azure.mgmt.compute import ComputeManagementClient

    class Elsewhere:  # a token from any other issuer, as a user had before the file named the endpoint
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            return AccessToken("eyJ-from-login.microsoftonline.com", 2**31)

    azure = entries["azure"]
    compute = ComputeManagementClient(Elsewhere(), azure["subscription"], base_url=azure["url"],
                                      connection_verify=azure["ca"], retry_total=0)
    with pytest.raises(ClientAuthenticationError, match="AuthenticationFailed"):
        list(compute.virtual_machines.list(azure["resourceGroup"]))


def test_the_aws_entry_authenticates_boto3_from_the_environment(entries: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    for name, value in entries["aws"]["env"].items():
        monkeypatch.setenv(name, value)
    session = boto3.session.Session()  # no endpoint, region or keys passed: all from the file's env
    assert session.client("sts").get_caller_identity()["Account"]
    assert "Reservations" in session.client("ec2").describe_instances()


def test_the_gcp_entry_with_anonymous_credentials(entries: dict[str, Any]) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    gcp = entries["gcp"]
    assert gcp["credentials"] == "anonymous"
    regions = compute_v1.RegionsClient(credentials=AnonymousCredentials(), transport="rest",
                                       client_options={"api_endpoint": gcp["url"]})
    assert regions.get(project=gcp["project"], region="europe-west4").status == "UP"
