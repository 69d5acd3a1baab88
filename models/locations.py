"""Burst locations as configured by the chart's ``burst.locations`` (R4.2), with what pricing needs."""

from __future__ import annotations

import re
from typing import Annotated
from typing import Final
from typing import Self

from pydantic import AfterValidator
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import model_validator
from pydantic.alias_generators import to_camel

from models.policy import _check_location


class _Camel(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


GUID: Final = r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}"
# Regions each cloud has (late 2026); a location naming another is refused at start (a typo would otherwise be a
# location that never launches anything).
GCP_REGIONS: Final = frozenset({
    "africa-south1", "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2", "asia-northeast3",
    "asia-south1", "asia-south2", "asia-southeast1", "asia-southeast2", "australia-southeast1",
    "australia-southeast2", "europe-central2", "europe-north1", "europe-north2", "europe-southwest1",
    "europe-west1", "europe-west2", "europe-west3", "europe-west4", "europe-west6", "europe-west8", "europe-west9",
    "europe-west10", "europe-west12", "me-central1", "me-central2", "me-west1", "northamerica-northeast1",
    "northamerica-northeast2", "northamerica-south1", "southamerica-east1", "southamerica-west1", "us-central1",
    "us-east1", "us-east4", "us-east5", "us-south1", "us-west1", "us-west2", "us-west3", "us-west4",
})
AZURE_REGIONS: Final = frozenset({
    "australiaeast", "australiasoutheast", "brazilsouth", "canadacentral", "canadaeast", "centralindia",
    "centralus", "eastasia", "eastus", "eastus2", "francecentral", "germanywestcentral", "israelcentral",
    "italynorth", "japaneast", "japanwest", "koreacentral", "mexicocentral", "northcentralus", "northeurope",
    "norwayeast", "polandcentral", "qatarcentral", "southafricanorth", "southcentralus", "southeastasia",
    "southindia", "spaincentral", "swedencentral", "switzerlandnorth", "uaenorth", "uksouth", "ukwest",
    "westcentralus", "westeurope", "westus", "westus2", "westus3",
})


def _pattern(regex: str, what: str, example: str) -> AfterValidator:
    def check(value: str | None) -> str | None:
        if value is not None and not re.fullmatch(regex, value):
            raise ValueError(f"{value!r} is not {what} (e.g. {example})")
        return value

    return AfterValidator(check)


class Credentials(_Camel):
    aws_role_arn: str | None = None
    gcp_service_account: Annotated[str | None, _pattern(
        r"[a-z0-9][-a-z0-9]{4,61}@[-a-z0-9.]+\.gserviceaccount\.com", "a service account e-mail",
        "kubeon-burst@my-project.iam.gserviceaccount.com")] = None
    azure_client_id: Annotated[str | None, _pattern(
        GUID, "a client ID (GUID)", "55555555-6666-7777-8888-999999999999")] = None
    existing_secret: str | None = None


class OfferingSpec(_Camel):
    instance_type: str
    gpus: Annotated[int, Field(ge=1)]
    gpu_product: str
    usd_per_hour: Annotated[float, Field(gt=0)]


class TransferEstimate(_Camel):
    """Data transfer back to the home region, per GPU-hour of a burst node (R4.9). The bill is the final word."""

    egress_gb_per_gpu_hour: Annotated[float, Field(ge=0)] = 1.0
    # None: the provider's usual rate (same cloud, other region: 0.02 USD/GB; other cloud: 0.09; onprem: 0).
    usd_per_gb: Annotated[float | None, Field(ge=0)] = None


class AwsSettings(_Camel):
    image_id: str | None = None  # None: the newest image in the region named "kubeon-burst-node*"
    subnet_id: str | None = None
    security_group_ids: list[str] = Field(default_factory=list)
    instance_profile: str = "kubeon-burst-node"


class GcpSettings(_Camel):
    # None: the project of the location's service account (<name>@<project>.iam.gserviceaccount.com).
    project: Annotated[str | None, _pattern(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", "a project ID", "acme-ml")] = None
    # Zones tried in turn; empty: every zone of the region that offers the machine type (machineTypes API).
    zones: list[str] = Field(default_factory=list)
    # The subnetwork the nodes' interface joins (regions/<region>/subnetworks/<name>); None: the default network.
    subnetwork: Annotated[str | None, _pattern(
        r"(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/)?regions/[a-z0-9-]+/subnetworks/[a-z]([-a-z0-9]*[a-z0-9])?",
        "a subnetwork", "regions/europe-west4/subnetworks/kubeon-burst")] = None
    # Boot image; None: the newest of the project's image family kubeon-burst-node.
    image: Annotated[str | None, _pattern(
        r"(projects/[-a-z0-9]+/)?global/images/(family/)?[a-z]([-a-z0-9]*[a-z0-9])?", "an image",
        "projects/acme-ml/global/images/family/kubeon-burst-node")] = None
    # The nodes' own service account (None: none attached, the node needs no Google API).
    node_service_account: str | None = None
    disk_size_gb: Annotated[int, Field(ge=10, le=65536)] = 100


class AzureSettings(_Camel):
    subscription: Annotated[str | None, _pattern(GUID, "a subscription ID (GUID)",
                                                 "11111111-2222-3333-4444-555555555555")] = None
    # The one resource group the location's identity may create VMs and NICs in (R4.5).
    resource_group: Annotated[str | None, _pattern(r"[-\w._()]{0,89}[-\w_()]", "a resource group name",
                                                   "kubeon-burst-westeurope")] = None
    # The existing subnet the inline NIC joins.
    subnet_id: Annotated[str | None, _pattern(
        rf"/subscriptions/{GUID}/resourceGroups/[-\w._()]+/providers/Microsoft\.Network/virtualNetworks/"
        r"[-\w.]+/subnets/[-\w.]+", "a subnet resource ID",
        "/subscriptions/<id>/resourceGroups/net/providers/Microsoft.Network/virtualNetworks/vnet/subnets/burst")] = None
    # publisher:offer:sku:version, or an image / gallery image resource ID.
    image: Annotated[str, _pattern(r"([^:\s]+:){3}[^:\s]+|/subscriptions/\S+", "an image URN or resource ID",
                                   "Canonical:ubuntu-24_04-lts:server:latest")] = \
        "Canonical:ubuntu-24_04-lts:server:latest"
    # Availability zones tried in turn; empty: those the resource SKUs API lists for the VM size.
    zones: list[str] = Field(default_factory=list)
    admin_username: str = "kubeon"
    # None: a freshly generated key nobody keeps (nodes join through the gateway; nobody logs in).
    ssh_public_key: str | None = None
    disk_size_gb: Annotated[int, Field(ge=30, le=4095)] = 128


class SimSettings(_Camel):
    boot_seconds: Annotated[float, Field(ge=0)] = 2.0
    # Simulated capacity: at most this many running instances at once; more is "insufficient capacity".
    capacity: Annotated[int, Field(ge=0)] = 100
    # Fault injection for crash tests: the worker process is killed (SIGKILL) right after the simulated cloud
    # has started an instance, before the launch call can report it. Once per instance.
    kill_worker_after_launch: bool = False
    # Fault injection for burn-in tests (issue 27): the first this many instances launched in the location register
    # one GPU fewer allocatable than their offering has (as a node whose device plugin misses a GPU).
    short_gpus_first: Annotated[int, Field(ge=0)] = 0
    # ... and the first this many post a failed GPU health check (as a node whose DCGM diagnostic fails).
    failing_gpu_health_first: Annotated[int, Field(ge=0)] = 0


class LocationConfig(_Camel):
    name: Annotated[str, AfterValidator(_check_location)]
    credentials: Credentials = Field(default_factory=Credentials)
    # Replaces the provider's built-in catalogue (required for sim, optional price overrides elsewhere).
    offerings: list[OfferingSpec] = Field(default_factory=list)
    transfer: TransferEstimate = Field(default_factory=TransferEstimate)
    aws: AwsSettings = Field(default_factory=AwsSettings)
    gcp: GcpSettings = Field(default_factory=GcpSettings)
    azure: AzureSettings = Field(default_factory=AzureSettings)
    sim: SimSettings = Field(default_factory=SimSettings)

    @model_validator(mode="after")
    def _cloud_settings(self) -> Self:
        """What each cloud needs to launch at all, named by field (the chart's schema checks the same)."""
        if self.provider == "gcp":
            self._require(self.region in GCP_REGIONS, "name", f"{self.region!r} is not a Google Cloud region")
            self._require(bool(self.credentials.gcp_service_account), "credentials.gcpServiceAccount",
                          "is required for gcp locations")
            sa_project = re.fullmatch(r"[^@]+@([a-z][-a-z0-9]{4,28}[a-z0-9])\.iam\.gserviceaccount\.com",
                                      self.credentials.gcp_service_account or "")
            if not self.gcp.project and sa_project:
                self.gcp.project = sa_project.group(1)  # a user-managed service account's own project
            self._require(bool(self.gcp.project), "gcp.project",
                          "is required for gcp locations (the service account names no project)")
            for zone in self.gcp.zones:
                self._require(zone.startswith(self.region + "-"), "gcp.zones",
                              f"zone {zone!r} is not in region {self.region}")
            if self.gcp.subnetwork:
                self._require(f"regions/{self.region}/" in self.gcp.subnetwork, "gcp.subnetwork",
                              f"{self.gcp.subnetwork!r} is not in region {self.region}")
        elif self.provider == "azure":
            self._require(self.region in AZURE_REGIONS, "name", f"{self.region!r} is not an Azure region")
            self._require(bool(self.credentials.azure_client_id), "credentials.azureClientId",
                          "is required for azure locations")
            for field in ("subscription", "resource_group", "subnet_id"):
                self._require(bool(getattr(self.azure, field)), f"azure.{to_camel(field)}",
                              "is required for azure locations")
        return self

    def _require(self, ok: bool, field: str, problem: str) -> None:
        if not ok:
            raise ValueError(f"{self.name}: {field} {problem}")

    @property
    def provider(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def region(self) -> str:
        return self.name.split("/", 1)[1]


def _check_ca_bundle(value: str) -> str:
    if value and "-----BEGIN CERTIFICATE-----" not in value:
        raise ValueError("gatewayCaBundle must hold PEM certificates (-----BEGIN CERTIFICATE-----)")
    return value


class BurstConfig(_Camel):
    home: Annotated[str, AfterValidator(_check_location)] = "aws/us-east-1"
    # The gateway as burst nodes reach it (their user data carries both): its public URL (the chart's
    # burst.gateway.publicUrl) and the CA certificate(s), PEM, that signed its certificate (empty: a public CA).
    gateway_url: str = "https://kubeon-gpu-optimizer-gateway.kubeon-gpu.svc:8443"
    gateway_ca_bundle: Annotated[str, AfterValidator(_check_ca_bundle)] = ""
    locations: list[LocationConfig] = Field(default_factory=list)

    def location(self, name: str) -> LocationConfig:
        for loc in self.locations:
            if loc.name == name:
                return loc
        configured = ", ".join(loc.name for loc in self.locations) or "none"
        raise KeyError(f"location {name} is not configured in burst.locations (configured: {configured})")


def transfer_usd_per_gb(home: str, location: LocationConfig) -> float:
    """What the location's cloud charges per GB of data leaving it towards home (the estimate's rate, and the one
    the measured egress is priced at): the location's ``transfer.usdPerGb``, or the provider's usual rate."""
    rate = location.transfer.usd_per_gb
    if rate is None:
        home_provider = home.split("/", 1)[0]
        if location.provider == "onprem" or location.name == home:
            rate = 0.0
        elif location.provider == home_provider:
            rate = 0.02
        elif location.provider == "sim":
            rate = 0.01
        else:
            rate = 0.09
    return rate


def transfer_usd_per_gpu_hour(home: str, location: LocationConfig) -> float:
    return round(location.transfer.egress_gb_per_gpu_hour * transfer_usd_per_gb(home, location), 4)
