"""Burst locations as configured by the chart's ``burst.locations`` (R4.2), with what pricing needs."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from models.policy import _check_location


class _Camel(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class Credentials(_Camel):
    aws_role_arn: str | None = None
    gcp_service_account: str | None = None
    azure_client_id: str | None = None
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


class SimSettings(_Camel):
    boot_seconds: Annotated[float, Field(ge=0)] = 2.0
    # Simulated capacity: at most this many running instances at once; more is "insufficient capacity".
    capacity: Annotated[int, Field(ge=0)] = 100
    # Fault injection for crash tests: the worker process is killed (SIGKILL) right after the simulated cloud
    # has started an instance, before the launch call can report it. Once per instance.
    kill_worker_after_launch: bool = False


class LocationConfig(_Camel):
    name: Annotated[str, AfterValidator(_check_location)]
    credentials: Credentials = Field(default_factory=Credentials)
    # Replaces the provider's built-in catalogue (required for sim, optional price overrides elsewhere).
    offerings: list[OfferingSpec] = Field(default_factory=list)
    transfer: TransferEstimate = Field(default_factory=TransferEstimate)
    aws: AwsSettings = Field(default_factory=AwsSettings)
    sim: SimSettings = Field(default_factory=SimSettings)

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


def transfer_usd_per_gpu_hour(home: str, location: LocationConfig) -> float:
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
    return round(location.transfer.egress_gb_per_gpu_hour * rate, 4)
