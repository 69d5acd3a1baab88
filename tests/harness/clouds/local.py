"""Locations, servers and official clients for the local Google Cloud and Azure servers (tests and make dev)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness.clouds.azure_server import IDENTITY_HEADER
from tests.harness.clouds.fake import FakeServer

GCP_PROJECT = "kubeon-burst-dev"
GCP_SA = "kubeon-burst@kubeon-burst-dev.iam.gserviceaccount.com"
AZURE_SUBSCRIPTION = "11111111-2222-3333-4444-555555555555"
AZURE_CLIENT_ID = "55555555-6666-7777-8888-999999999999"
# The subnet the Azure tests launch into (make dev's locations have one per region: ``azure_location``).
AZURE_SUBNET = (f"/subscriptions/{AZURE_SUBSCRIPTION}/resourceGroups/net/providers/Microsoft.Network/"
                "virtualNetworks/vnet/subnets/burst")


# The GKE cluster the workflow tests seed (their own cluster name each): its project, location and zone.
GKE_PROJECT, GKE_LOCATION, GKE_ZONE = "acme-ml", "europe-west4", "europe-west4-a"


def seed_gke_gpu_pool(server: FakeServer, *, machine_type: str, nodes: int, labels: dict[str, str] | None = None,
                      operation_seconds: float = 0.2) -> tuple[str, str]:
    """A GKE cluster of its own on the local server with one GPU pool of ``nodes`` VMs in GKE_ZONE, tainted
    ``nvidia.com/gpu`` and carrying ``labels``, its operations taking ``operation_seconds``; (cluster, pool)."""
    import uuid

    server.reset()
    server.fault(operation_seconds=operation_seconds)
    cluster, pool = f"train-{uuid.uuid4().hex[:6]}", f"gpu-{uuid.uuid4().hex[:6]}"
    server.seed(gke={"project": GKE_PROJECT, "location": GKE_LOCATION, "cluster": cluster, "nodePools": [
        {"name": pool, "machineType": machine_type, "zones": [GKE_ZONE], "nodeCount": nodes, "labels": labels or {},
         "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}]}]})
    return cluster, pool


def azure_resource_group(region: str) -> str:
    return f"kubeon-burst-{region}"


def gcp_location(region: str = "europe-west4", *, project: str = GCP_PROJECT, **extra: Any) -> dict[str, Any]:
    return {"name": f"gcp/{region}", "credentials": {"gcpServiceAccount": GCP_SA},
            "gcp": {"project": project}, **extra}


def azure_location(region: str = "westeurope", **extra: Any) -> dict[str, Any]:
    subnet = (f"/subscriptions/{AZURE_SUBSCRIPTION}/resourceGroups/kubeon-net/providers/Microsoft.Network/"
              f"virtualNetworks/kubeon-{region}/subnets/burst")
    return {"name": f"azure/{region}", "credentials": {"azureClientId": AZURE_CLIENT_ID},
            "azure": {"subscription": AZURE_SUBSCRIPTION, "resourceGroup": azure_resource_group(region),
                      "subnetId": subnet}, **extra}


def start_gcp(logdir: Path, *, port: int = 0, popen: Callable[..., Any] = subprocess.Popen) -> FakeServer:
    return FakeServer("tests.harness.clouds.gcp_server", logdir, popen=popen).start(port=port)


def start_azure(logdir: Path, *, port: int = 0, popen: Callable[..., Any] = subprocess.Popen) -> FakeServer:
    return FakeServer("tests.harness.clouds.azure_server", logdir, tls_dir=logdir / "azure-tls",
                      with_identity=True, popen=popen).start(port=port)


def azure_identity_env(server: FakeServer) -> dict[str, str]:
    """What azure-identity's ManagedIdentityCredential reads to reach the server's identity endpoint."""
    return {"IDENTITY_ENDPOINT": server.identity_url, "IDENTITY_HEADER": IDENTITY_HEADER}


def gcp_instances(server: FakeServer) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    return compute_v1.InstancesClient(credentials=AnonymousCredentials(), transport="rest",
                                      client_options={"api_endpoint": server.url})


def gcp_live(server: FakeServer, label_filter: str, project: str = GCP_PROJECT) -> list[Any]:
    """Instances matching the filter in any zone, through the official client."""
    from google.cloud import compute_v1

    pager = gcp_instances(server).aggregated_list(request=compute_v1.AggregatedListInstancesRequest(
        project=project, filter=label_filter))
    return [i for _, scoped in pager for i in scoped.instances]


def azure_compute(server: FakeServer) -> Any:
    import os

    from azure.identity import ManagedIdentityCredential
    from azure.mgmt.compute import ComputeManagementClient

    os.environ.update(azure_identity_env(server))
    return ComputeManagementClient(ManagedIdentityCredential(client_id=AZURE_CLIENT_ID), AZURE_SUBSCRIPTION,
                                   base_url=server.url, connection_verify=str(server.ca_file), retry_total=0)
