"""Wiring: clients, providers, the gateway client and activities from Settings."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.runtime import Runtime as TemporalRuntime
from temporalio.service import RPCError
from temporalio.service import TLSConfig

from activities.burst import BurstActivities
from activities.capacity import CapacityProvider
from activities.capacity.karpenter import KarpenterCapacity
from activities.clients.audit_log import AuditLog
from activities.clients.gateway import GatewayClient
from activities.clients.hub import HubClient
from activities.clients.kube import KubeOps
from activities.clients.policies import PolicySyncer
from activities.clients.prometheus import PrometheusClient
from activities.context import HomeSettings
from activities.context import ReportSink
from activities.hub import HubActivities
from activities.packing import PackActivities
from activities.providers.base import Provider
from activities.scale import ScaleOps
from activities.sharing import SharingOps
from common.kube import kube_api
from models import search_attributes
from models.converter import DATA_CONVERTER
from models.hub import ActionReport
from models.hub import HubSyncConfig
from models.hub import HubSyncInput
from models.hub import hub_sync_workflow_id
from models.locations import BurstConfig
from models.node import Instance
from node.join import Redeemer
from worker import telemetry
from worker.config import ConfigError
from worker.config import Settings
from worker.config import managed_capacity
from worker.doctor import Prerequisite
from worker.doctor import run_checks
from workflows.hub_sync import HubSyncWorkflow


async def connect_temporal(settings: Settings, *, runtime: TemporalRuntime | None = None) -> Client:
    """A client whose calls, and whose workers' workflows and activities, are traced and counted (see
    worker/telemetry.py); ``runtime``: the worker's, with the SDK's Prometheus metrics."""
    api_key = settings.temporal_api_key_file.read_text().strip() if settings.temporal_api_key_file else None
    return await Client.connect(
        settings.temporal_address, namespace=settings.temporal_namespace,
        data_converter=DATA_CONVERTER, tls=TLSConfig() if settings.temporal_tls else False,
        api_key=api_key, interceptors=telemetry.client_interceptors(), runtime=runtime,
    )


async def register_search_attributes(temporal: Client) -> None:
    """Register the project's search attributes (idempotent). Servers without the list call (the time-skipping
    test server) get the add call alone."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.service import RPCStatusCode

    wanted = {k.name: IndexedValueType.ValueType(k.indexed_value_type) for k in search_attributes.ALL}
    try:
        existing = await temporal.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=temporal.namespace))
        wanted = {k: v for k, v in wanted.items() if k not in existing.custom_attributes}
    except RPCError as exc:
        if exc.status != RPCStatusCode.UNIMPLEMENTED:
            raise
    if wanted:
        try:
            await temporal.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=temporal.namespace, search_attributes=wanted))
        except RPCError as exc:
            if "already" not in str(exc).lower():
                raise


@dataclass
class Runtime:
    settings: Settings
    kube: KubeOps
    burst: BurstConfig
    gateway: GatewayClient
    providers: dict[str, Provider]
    audit: AuditLog
    closers: list[Any] = field(default_factory=list)
    hub: HubClient | None = None
    metrics: PrometheusClient | None = None

    def activities(self, temporal: Client | None) -> BurstActivities:
        return BurstActivities(kube=self.kube, providers=self.providers, gateway=self.gateway, config=self.burst,
                               audit=self.audit, temporal=temporal, task_queue=self.settings.task_queue,
                               report_sink=self.report_sink(temporal) if self.hub and temporal else None,
                               capacity=self.capacity(),
                               home=HomeSettings(
                                   launch_grace_seconds=self.settings.capacity_launch_grace_seconds,
                                   register_seconds=self.settings.capacity_register_seconds))

    def capacity(self) -> CapacityProvider | None:
        """The home capacity provider of capacity.provider (none: no home autoscaler)."""
        if self.settings.capacity_provider == "karpenter":
            return KarpenterCapacity(self.kube.api)
        return managed_capacity(self.kube.api, self.settings)

    def pack_activities(self) -> PackActivities | None:
        """Packing rounds, through the home capacity provider (none without one)."""
        capacity = self.capacity()
        return PackActivities(self.kube, capacity) if capacity is not None else None

    def scale_ops(self) -> ScaleOps:
        return ScaleOps(self.kube.api, self.metrics)

    def sharing_ops(self) -> SharingOps:
        return SharingOps(self.kube.api, self.metrics)

    def prerequisites(self) -> list[Prerequisite]:
        return run_checks(self.kube.api, self.metrics, gpu_operator_namespace=self.settings.gpu_operator_namespace,
                          capacity_provider=self.settings.capacity_provider,
                          capacity=self.capacity() if self.settings.capacity_provider != "karpenter" else None,
                          time_slicing_configmap=self.settings.time_slicing_configmap)

    def hub_activities(self, temporal: Client) -> HubActivities | None:
        if self.hub is None:
            return None
        syncer = PolicySyncer(self.kube.api, default_mode=self.settings.default_mode,
                              locations=[loc.name for loc in self.burst.locations], metrics=self.metrics is not None)
        return HubActivities(hub=self.hub, syncer=syncer, temporal=temporal)

    async def _signal_hub_sync(self, temporal: Client, signal: str, arg: object) -> str:
        """Signal-with-start the cluster's hub sync workflow: every replica may; one runs, and the signal is
        durable even if the workflow was not running yet."""
        handle = await temporal.start_workflow(
            HubSyncWorkflow.run,
            HubSyncInput(cluster=self.settings.cluster, poll_interval_seconds=self.settings.hub_poll_interval),
            id=hub_sync_workflow_id(self.settings.cluster), task_queue=self.settings.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, start_signal=signal, start_signal_args=[arg],
            static_summary=f"Hub sync of cluster {self.settings.cluster} from {self.settings.hub_url}")
        return handle.id

    async def start_hub_sync(self, temporal: Client) -> str:
        """Start the hub sync, or hand a running one (another replica's, an earlier version's) these settings."""
        return await self._signal_hub_sync(
            temporal, "configure", HubSyncConfig(poll_interval_seconds=self.settings.hub_poll_interval))

    def report_sink(self, temporal: Client) -> ReportSink:
        """Queue an action report in the hub sync workflow's state."""

        async def send(report: ActionReport) -> None:
            await self._signal_hub_sync(temporal, "report", report)

        return send

    def close(self) -> None:
        for closer in self.closers:
            closer()
        self.kube.close()


def build_gateway(settings: Settings) -> GatewayClient:
    """The gateway seam: the gateway Deployment over HTTPS at KUBEON_GATEWAY_URL, authenticated with the worker's
    ServiceAccount token. (Tests and the bench may hand ``build_runtime`` a gateway of their own instead.)"""
    from activities.clients.gateway import HttpGatewayClient

    return HttpGatewayClient(settings.gateway_url, settings.gateway_token_file,
                             ca_file=str(settings.gateway_ca_file) if settings.gateway_ca_file else None)


def build_runtime(settings: Settings, *, gateway: GatewayClient | None = None,
                  redeem: Redeemer | None = None) -> Runtime:
    """``gateway``: the gateway to use (default: ``build_gateway``); ``redeem``: how simulated instances redeem
    their ticket (default: over HTTPS at the gateway their user data names; a test with a gateway in its own
    process passes its ``join``)."""
    burst = settings.burst_config()
    kube = KubeOps(kube_api(settings.kubeconfig, pool_size=settings.max_concurrent_activities + 8))
    gw = gateway or build_gateway(settings)
    providers: dict[str, Provider] = {}
    closers: list[Any] = []
    close_gateway = getattr(gw, "close", None) or getattr(gw, "stop", None)
    if close_gateway is not None:
        closers.append(close_gateway)
    kinds = {loc.provider for loc in burst.locations}
    if "aws" in kinds:
        from activities.providers.aws import AwsProvider

        providers["aws"] = AwsProvider(burst, endpoint_url=settings.aws_endpoint_url)
    if "gcp" in kinds:
        from activities.providers.gcp import GcpProvider

        providers["gcp"] = GcpProvider(burst, endpoint_url=settings.gcp_endpoint_url)
    if "azure" in kinds:
        from activities.providers.azure import AzureProvider

        providers["azure"] = AzureProvider(burst, endpoint_url=settings.azure_endpoint_url,
                                           ca_file=str(settings.azure_ca_file) if settings.azure_ca_file else None)
    if "sim" in kinds:
        from activities.providers.sim import KWOK_ANNOTATIONS
        from activities.providers.sim import SimProvider
        from models.join import GpuHealth
        from models.join import parse_user_data
        from node.join import RETRY_SECONDS
        from node.join import redeem_over_https
        from node.register import join_simulated

        def boot(instance: Instance, user_data: str, capacity: dict[str, str], health: GpuHealth) -> None:
            # The simulated instance joins through the same protocol as a real node: its own keys and CSR, the
            # ticket of its user data redeemed at the gateway (over HTTPS at the URL its user data names, verified
            # with the CA bundle it carries; or ``redeem``), then it registers its own Node with its own
            # certificate. No tunnel: it reaches the API server over loopback; kwok plays its kubelet. A gateway
            # answering 5xx (a slot conflict's 503 "retry") is tried again as `node join` on a real node does: with
            # one try, a node that lost such a race stayed unjoined and its pod waited for the join timeout (seen
            # in the side-by-side bench: 198 of 200 bound).
            doc = parse_user_data(user_data)
            join_simulated(doc, settings.state_dir / "sim-nodes" / instance.instance_id,
                           redeem or redeem_over_https(doc, ca_file=settings.gateway_ca_file),
                           provider_id=f"sim://{instance.location}/{instance.instance_id}", capacity=capacity,
                           annotations=KWOK_ANNOTATIONS, gpu_health=health, retry_seconds=RETRY_SECONDS)

        sim = SimProvider(burst, settings.state_dir / "sim-instances.json", on_boot=boot)
        providers["sim"] = sim
        closers.append(sim.stop)
    if "onprem" in kinds:
        if not settings.hub_url:
            raise ConfigError("burst.locations names onprem pools: they are claimed through the hub (set hub.url)")
        from activities.providers.onprem import OnPremProvider
        from activities.providers.onprem import PoolClient

        pools = PoolClient(settings.hub_url, settings.hub_token_file,
                           ca_file=str(settings.hub_ca_file) if settings.hub_ca_file else None)
        providers["onprem"] = OnPremProvider(burst, pools)
        closers.append(pools.close)
    unsupported = kinds - set(providers)
    if unsupported:
        raise ConfigError(f"burst.locations names providers not supported yet: {', '.join(sorted(unsupported))}")
    audit = AuditLog(settings.state_dir / "audit.jsonl")
    hub = None
    if settings.hub_url:
        hub = HubClient(settings.hub_url, settings.hub_token_file,
                        ca_file=str(settings.hub_ca_file) if settings.hub_ca_file else None)
        closers.append(hub.close)
    metrics = PrometheusClient(settings.prometheus_url) if settings.prometheus_url else None
    if metrics is not None:
        closers.append(metrics.close)
    return Runtime(settings=settings, kube=kube, burst=burst, gateway=gw, providers=providers, audit=audit,
                   closers=closers, hub=hub, metrics=metrics)
