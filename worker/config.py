"""The optimizer's configuration: the chart's values reach the worker as environment variables (R1.2)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError
from pydantic import ValidationInfo
from pydantic import field_validator

from models.aks import aks_setting_error
from models.eks import AWS_REGIONS
from models.env import ConfigError
from models.env import env_names
from models.env import from_env
from models.env import url_setting
from models.gke import gke_setting_error
from models.locations import BurstConfig
from models.policy import Mode
from models.provisioning import OperationSettings
from models.scale import ScaleSettings
from models.sharing import SharingSettings

if TYPE_CHECKING:
    from activities.capacity.aks import AksNodePoolsCapacity
    from activities.capacity.eks import EksNodeGroupsCapacity
    from activities.capacity.gke import GkeNodePoolsCapacity

# The managed providers whose settings are checked by one function: (check(field, value) -> error, the Settings
# field -> the chart's field under capacity.aks / capacity.gke).
MANAGED_SETTINGS: dict[str, tuple[Callable[[str, str], str | None], dict[str, str]]] = {
    "aks-nodepools": (aks_setting_error, {"capacity_cluster_name": "clusterName",
                                          "capacity_subscription": "subscription",
                                          "capacity_resource_group": "resourceGroup"}),
    "gke-nodepools": (gke_setting_error, {"capacity_cluster_name": "clusterName", "capacity_project": "project",
                                          "capacity_location": "location"}),
}
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
# "none": no home autoscaler to defer to (home capacity is what the nodes have free).
CAPACITY_PROVIDERS = ("karpenter", "eks-nodegroups", "gke-nodepools", "aks-nodepools", "none")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration as the chart writes it: ``30s``, ``5m``, ``1m30s``, ``500ms`` (or plain seconds)."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        return float(text)
    if not text or _DURATION_PART.sub("", text):
        raise ValueError(f"{text!r} is not a duration such as 30s, 5m or 1m30s")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    # Every policy without a mode of its own runs in this one; Recommend: installing changes nothing (R1.4).
    default_mode: Mode = "Recommend"
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    temporal_tls: bool = False
    temporal_api_key_file: Path | None = None
    task_queue: str = "kubeon-gpu"
    # Empty: in-cluster service account credentials.
    kubeconfig: Path | None = None
    burst_enabled: bool = False
    burst_locations_file: Path | None = None
    home_location: str = "aws/us-east-1"
    gateway_url: str = "https://kubeon-gpu-optimizer-gateway.kubeon-gpu.svc:8443"
    # Where burst nodes in other clouds reach the gateway (the chart's burst.gateway.publicUrl). The gateway
    # process names it in every ticket answer; the worker falls back to it (else gateway_url) only for a gateway
    # that names no endpoint (dev and tests). The gateway's own settings: gateway/settings.py.
    gateway_public_url: str = ""
    # The worker's HTTP client of the gateway: its ServiceAccount token and the CA of the gateway's certificate.
    gateway_token_file: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    gateway_ca_file: Path | None = None
    # The hub (R2.x): empty URL means no hub, policies are applied to the cluster directly.
    hub_url: str = ""
    hub_token_file: Path = Path("/var/run/kubeon/hub/token")
    hub_poll_interval: float = 60.0
    hub_ca_file: Path | None = None
    state_dir: Path = Path("/tmp/kubeon")
    aws_endpoint_url: str | None = None
    # Emulators or private endpoints of the other clouds (tests, make dev). GCP: calls carry anonymous
    # credentials then (no Google token goes to another endpoint). Azure: TLS is verified with azure_ca_file.
    gcp_endpoint_url: str | None = None
    azure_endpoint_url: str | None = None
    azure_ca_file: Path | None = None
    health_port: int = 8080
    max_concurrent_activities: int = 100
    approval_timeout_seconds: int = 3600
    join_timeout_seconds: int = 900
    # Pods whose burst node failed (e.g. its burn-in) are planned again after this back-off, doubling.
    node_retry_seconds: float = 30.0
    # A location whose burst node failed is left out of the policy's plans this long (another location remaining).
    location_avoid_seconds: float = 600.0
    serve_check_seconds: int = 30
    # issue 27: how often a serving burst node's transfer is read from the gateway.
    transfer_check_seconds: int = 300
    # The chart's prometheus.url: DCGM metrics for ScaleToZero (without it, those policies only recommend, R1.3).
    prometheus_url: str = ""
    # The chart's capacity.provider and gpuOperator.namespace (prerequisite checks, R1.6).
    capacity_provider: str = "karpenter"
    # Burst defers to home capacity: a pod a home NodePool (or a managed group an autoscaler sizes) could serve is
    # not burst for this long after it became Unschedulable; a home NodeClaim, or a node a managed group was grown
    # by, unregistered this long no longer holds it back.
    capacity_launch_grace_seconds: float = 60.0
    capacity_register_seconds: float = 300.0
    # -- capacity.provider eks-nodegroups: the EKS cluster and its region (the chart's capacity.eks); the
    # endpoint is aws_endpoint_url (moto in tests and make dev). Checked at start, naming the variable.
    capacity_cluster_name: str = Field(default="", validate_default=True)
    capacity_region: str = Field(default="", validate_default=True)
    # -- capacity.provider aks-nodepools: the AKS cluster (capacity_cluster_name), its subscription and resource
    # group (the chart's capacity.aks); the endpoint is azure_endpoint_url, TLS verified with azure_ca_file.
    capacity_subscription: str = Field(default="", validate_default=True)
    capacity_resource_group: str = Field(default="", validate_default=True)
    # -- capacity.provider gke-nodepools: the GKE cluster (capacity_cluster_name), its project and location (the
    # chart's capacity.gke); the endpoint is gcp_endpoint_url (the local GKE server in tests and make dev).
    capacity_project: str = Field(default="", validate_default=True)
    capacity_location: str = Field(default="", validate_default=True)
    gpu_operator_namespace: str = "gpu-operator"
    # Sharing (time-slicing through the GPU Operator): the chart's gpuOperator.timeSlicingConfigMap, the wait for a
    # new key to reach the device plugin's mounted copy, and how long a node gets to show the change.
    time_slicing_configmap: str = "time-slicing-config"
    sharing_propagation_seconds: int = 90
    sharing_verify_timeout_seconds: int = 300
    scale_resync_seconds: float = 60.0
    scale_observe_seconds: int = 60
    scale_rescale_check_seconds: int = 30
    # Batching of a policy's waiting pods (see OperationSettings): idle window and longest wait before a plan.
    batch_idle_seconds: float = 0.0
    batch_load_idle_seconds: float = 1.0
    batch_load_max_seconds: float = 4.0
    batch_max_seconds: float = 10.0

    @field_validator("hub_poll_interval", mode="before")
    @classmethod
    def _duration(cls, value: object) -> object:
        seconds = parse_duration(value) if isinstance(value, str) else value
        if isinstance(seconds, (int, float)) and seconds < 1:
            raise ValueError("must be at least 1s")
        return seconds

    @field_validator("gateway_public_url", "hub_url", "prometheus_url", "gcp_endpoint_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return url_setting(value)

    @field_validator("azure_endpoint_url")
    @classmethod
    def _https_url(cls, value: str | None) -> str | None:
        return url_setting(value, https_only=True)

    @field_validator("capacity_provider")
    @classmethod
    def _known_capacity_provider(cls, value: str) -> str:
        if value not in CAPACITY_PROVIDERS:
            raise ValueError(f"{value!r} is not one of {', '.join(CAPACITY_PROVIDERS)}")
        return value

    @field_validator("capacity_cluster_name", "capacity_region")
    @classmethod
    def _eks_capacity(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("capacity_provider") != "eks-nodegroups":
            return value
        if info.field_name == "capacity_cluster_name":
            if not re.fullmatch(r"[0-9A-Za-z][A-Za-z0-9\-_]{0,99}", value):
                raise ValueError("is required with capacity.provider eks-nodegroups: the EKS cluster's name "
                                 f"(1-100 letters, digits, - or _), not {value!r}")
        elif value not in AWS_REGIONS:
            raise ValueError(f"{value!r} is not an AWS region (e.g. us-east-1); required with capacity.provider "
                             "eks-nodegroups")
        return value

    @field_validator("capacity_cluster_name", "capacity_subscription", "capacity_resource_group",
                     "capacity_project", "capacity_location")
    @classmethod
    def _managed_capacity(cls, value: str, info: ValidationInfo) -> str:
        """capacity.aks / capacity.gke: each field its provider needs, checked naming the chart's field."""
        check, fields = MANAGED_SETTINGS.get(str(info.data.get("capacity_provider")), (None, {}))
        field = fields.get(str(info.field_name))
        if check is not None and field is not None and (error := check(field, value)) is not None:
            raise ValueError(error)
        return value

    def gateway_node_url(self) -> str:
        """The gateway's URL as burst nodes use it."""
        return self.gateway_public_url or self.gateway_url

    def gateway_ca_bundle(self) -> str:
        """The CA (PEM) that signed the gateway's certificate, from KUBEON_GATEWAY_CA_FILE; empty without one."""
        if self.gateway_ca_file is None:
            return ""
        try:
            pem = self.gateway_ca_file.read_text()
        except OSError as exc:
            raise ConfigError(f"KUBEON_GATEWAY_CA_FILE {self.gateway_ca_file}: {exc.strerror or exc}") from None
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ConfigError(f"KUBEON_GATEWAY_CA_FILE {self.gateway_ca_file}: no PEM certificate in it")
        return pem

    def burst_config(self) -> BurstConfig:
        """Locations from the chart's ``burst.locations`` (a JSON or YAML list, or an object with ``locations``)."""
        raw: object = []
        if self.burst_locations_file is not None:
            text = self.burst_locations_file.read_text()
            try:
                raw = json.loads(text)
            except json.JSONDecodeError:
                import yaml

                raw = yaml.safe_load(text)
        doc = raw if isinstance(raw, dict) else {"locations": raw or []}
        doc.setdefault("home", self.home_location)
        # What burst nodes are told: the gateway's public URL and the CA to verify it with.
        doc.setdefault("gatewayUrl", self.gateway_node_url())
        doc.setdefault("gatewayCaBundle", self.gateway_ca_bundle())
        try:
            return BurstConfig.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{self.burst_locations_file}: burst.{where}: {first['msg']}") from None

    def scale_settings(self) -> ScaleSettings:
        return ScaleSettings(approval_timeout_seconds=self.approval_timeout_seconds,
                             observe_seconds=self.scale_observe_seconds,
                             rescale_check_seconds=self.scale_rescale_check_seconds)

    def sharing_settings(self) -> SharingSettings:
        return SharingSettings(approval_timeout_seconds=self.approval_timeout_seconds,
                               propagation_seconds=self.sharing_propagation_seconds,
                               verify_timeout_seconds=self.sharing_verify_timeout_seconds)

    def operation_settings(self) -> OperationSettings:
        return OperationSettings(approval_timeout_seconds=self.approval_timeout_seconds,
                                 join_timeout_seconds=self.join_timeout_seconds,
                                 serve_check_seconds=self.serve_check_seconds,
                                 transfer_check_seconds=self.transfer_check_seconds,
                                 batch_idle_seconds=self.batch_idle_seconds,
                                 batch_load_idle_seconds=self.batch_load_idle_seconds,
                                 batch_load_max_seconds=self.batch_load_max_seconds,
                                 batch_max_seconds=self.batch_max_seconds,
                                 retry_seconds=self.node_retry_seconds,
                                 location_avoid_seconds=self.location_avoid_seconds)


ENV = env_names(Settings)


def aks_capacity(api: Any, settings: Settings) -> AksNodePoolsCapacity:
    """capacity.provider aks-nodepools: the provider the worker and ``doctor`` use (Azure SDK loaded lazily)."""
    from activities.capacity.aks import AksNodePoolsCapacity

    return AksNodePoolsCapacity(api, subscription=settings.capacity_subscription,
                                resource_group=settings.capacity_resource_group,
                                cluster=settings.capacity_cluster_name, endpoint_url=settings.azure_endpoint_url,
                                ca_file=str(settings.azure_ca_file) if settings.azure_ca_file else None)

def gke_capacity(api: Any, settings: Settings) -> GkeNodePoolsCapacity:
    """capacity.provider gke-nodepools: the provider the worker and ``doctor`` use (Google SDKs loaded lazily)."""
    from activities.capacity.gke import GkeNodePoolsCapacity

    return GkeNodePoolsCapacity(api, project=settings.capacity_project, location=settings.capacity_location,
                                cluster=settings.capacity_cluster_name, endpoint_url=settings.gcp_endpoint_url)


def eks_capacity(api: Any, settings: Settings) -> EksNodeGroupsCapacity:
    """capacity.provider eks-nodegroups: the provider the worker and ``doctor`` use (boto3 loaded lazily)."""
    from activities.capacity.eks import EksNodeGroupsCapacity

    return EksNodeGroupsCapacity(api, cluster=settings.capacity_cluster_name, region=settings.capacity_region,
                                 endpoint_url=settings.aws_endpoint_url)


def managed_capacity(api: Any, settings: Settings
                     ) -> EksNodeGroupsCapacity | AksNodePoolsCapacity | GkeNodePoolsCapacity | None:
    """The managed node groups' provider of capacity.provider (None for karpenter and none)."""
    if settings.capacity_provider == "eks-nodegroups":
        return eks_capacity(api, settings)
    if settings.capacity_provider == "aks-nodepools":
        return aks_capacity(api, settings)
    if settings.capacity_provider == "gke-nodepools":
        return gke_capacity(api, settings)
    return None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment; an invalid value fails naming the variable that holds it."""
    return from_env(Settings, environ)
