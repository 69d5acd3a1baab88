"""Prerequisites (R1.6): the KubeOn agent, the NVIDIA GPU Operator, Karpenter or managed node groups, and DCGM
exporter series in Prometheus. Each is found or missing, with what a missing one disables and how to fix it.
Read with the optimizer's own permissions (R5.1): the GPU Operator by its Deployment, else by the
``nvidia.com/gpu.deploy.*`` labels it puts on GPU nodes (the ClusterRole reads no ClusterPolicy or DaemonSet). A
check that cannot decide says so and never raises.

The worker logs one line per prerequisite at start and whenever one changes; `kubeon-gpu doctor` prints the table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from typing import Any
from typing import Literal

import yaml
from kubernetes import client

from activities.capacity import CapacityError
from activities.capacity import CapacityProvider
from activities.capacity.karpenter import is_gpu_pool
from activities.clients.prometheus import GR_ENGINE_ACTIVE
from activities.clients.prometheus import MetricsError
from activities.clients.prometheus import PrometheusClient
from models.eks import GroupScaling

log = logging.getLogger("kubeon.prerequisites")
Status = Literal["found", "missing", "unknown"]
AGENT_SELECTOR = "app.kubernetes.io/name=kubeon-agent"
GPU_OPERATOR_LABEL_PREFIX = "nvidia.com/gpu.deploy."


@dataclass(frozen=True)
class Prerequisite:
    name: str
    status: Status
    detail: str
    disables: str  # what does not work while it is missing
    fix: str

    def log_line(self) -> str:
        line = f"prerequisite {self.name}: {self.status}: {self.detail}"
        return line if self.status == "found" else f"{line}; disables {self.disables}; fix: {self.fix}"


def _api_reason(exc: client.ApiException) -> str:
    return {403: "forbidden", 404: "not found"}.get(exc.status or 0, f"HTTP {exc.status}")


def check_agent(api: client.ApiClient) -> Prerequisite:
    disables, fix = ("the hub's cluster inventory and cost views (the optimizer itself keeps working)",
                     "install the read-only KubeOn agent (its chart labels it app.kubernetes.io/name=kubeon-agent)")
    found: list[Any] = client.AppsV1Api(api).list_deployment_for_all_namespaces(label_selector=AGENT_SELECTOR).items
    if found:
        d = found[0]
        return Prerequisite("KubeOn agent", "found", f"Deployment {d.metadata.namespace}/{d.metadata.name}",
                            disables, fix)
    return Prerequisite("KubeOn agent", "missing", f"no Deployment labelled {AGENT_SELECTOR}", disables, fix)


def check_gpu_operator(api: client.ApiClient, namespace: str) -> Prerequisite:
    disables = "sharing (time-slicing and MIG through the GPU Operator)"
    fix = (f"install the NVIDIA GPU Operator in namespace {namespace} (helm install gpu-operator "
           "nvidia/gpu-operator -n gpu-operator), or set gpuOperator.namespace to where it runs")
    name = "NVIDIA GPU Operator"
    # The ClusterRole reads neither ClusterPolicies nor DaemonSets (R5.1): its Deployment, else its node labels.
    try:
        deployment: Any = client.AppsV1Api(api).read_namespaced_deployment("gpu-operator", namespace)
        return Prerequisite(name, "found", f"Deployment {namespace}/{deployment.metadata.name}", disables, fix)
    except client.ApiException as exc:
        if exc.status not in (403, 404):
            raise
        how = f"Deployment {namespace}/gpu-operator {_api_reason(exc)}"
    nodes: list[Any] = client.CoreV1Api(api).list_node().items
    labelled = [n.metadata.name for n in nodes
                if any(k.startswith(GPU_OPERATOR_LABEL_PREFIX) for k in (n.metadata.labels or {}))]
    if labelled:
        return Prerequisite(name, "found", f"{how}; {len(labelled)} node(s) carry its {GPU_OPERATOR_LABEL_PREFIX}* "
                                           "labels", disables, fix)
    return Prerequisite(name, "missing", f"{how}; no node carries its {GPU_OPERATOR_LABEL_PREFIX}* labels",
                        disables, fix)


SHARING_DISABLES = "time-slicing (Sharing policies propose, their operations fail)"


def _key_replicas(body: str) -> int | None:
    """The nvidia.com/gpu replicas a device-plugin config file gives (1: no sharing); None if unreadable."""
    try:
        doc = yaml.safe_load(body) or {}
        resources = ((doc.get("sharing") or {}).get("timeSlicing") or {}).get("resources") or []
    except (yaml.YAMLError, AttributeError):
        return None
    return next((int(r.get("replicas", 1)) for r in resources if r.get("name") == "nvidia.com/gpu"), 1)


def check_time_slicing(api: client.ApiClient, namespace: str, config_map: str) -> list[Prerequisite]:
    """The chart's time-slicing ConfigMap readable with the optimizer's Role (R5.3), and whether the GPU
    Operator's device plugin reads it (ClusterPolicy ``devicePlugin.config.name``): the ClusterRole cannot read the
    ClusterPolicy, so this is judged from nodes that name one of its keys and what they advertise."""
    name = "time-slicing ConfigMap"
    where = f"{namespace}/{config_map}"
    try:
        cm: Any = client.CoreV1Api(api).read_namespaced_config_map(config_map, namespace)
    except client.ApiException as exc:
        if exc.status not in (403, 404):
            raise
        fix = ("install the chart with gpuOperator.createRole=true and the right gpuOperator.namespace"
               if exc.status == 403 else
               f"create ConfigMap {where} (the optimizer may only get and patch it) and set the ClusterPolicy's "
               f"devicePlugin.config.name to {config_map}")
        return [Prerequisite(name, "missing", f"ConfigMap {where} {_api_reason(exc)}", SHARING_DISABLES, fix)]
    data = dict(cm.data or {})
    found = Prerequisite(name, "found", f"ConfigMap {where}: {len(data)} key(s)", SHARING_DISABLES, "-")
    plugin = "device plugin reads the ConfigMap"
    plugin_fix = (f"point the GPU Operator at it: kubectl patch clusterpolicies.nvidia.com/cluster-policy --type merge "
                  f"-p '{{\"spec\": {{\"devicePlugin\": {{\"config\": {{\"name\": \"{config_map}\"}}}}}}}}'")
    nodes: list[Any] = client.CoreV1Api(api).list_node().items
    agree: list[str] = []
    disagree: list[str] = []
    for n in nodes:
        labels = n.metadata.labels or {}
        key = labels.get("nvidia.com/device-plugin.config")
        if key is None or key not in data:
            continue
        want = _key_replicas(data[key])
        shown = labels.get("nvidia.com/gpu.replicas", "1")
        (agree if want is not None and str(want) == shown else disagree).append(
            f"{n.metadata.name} ({key}: replicas {want}, shows {shown})")
    if disagree and not agree:
        return [found, Prerequisite(plugin, "missing", "nodes name its keys but do not show them: "
                                    + ", ".join(disagree[:5]), SHARING_DISABLES, plugin_fix)]
    if agree:
        return [found, Prerequisite(plugin, "found", f"{len(agree)} node(s) show the key they name, e.g. {agree[0]}",
                                    SHARING_DISABLES, plugin_fix)]
    return [found, Prerequisite(plugin, "unknown", "no node names one of its keys yet (the first time-slicing "
                                "operation verifies it, and restores the node's label if it does not)",
                                SHARING_DISABLES, plugin_fix)]


def check_mig_strategy(api: client.ApiClient) -> Prerequisite:
    """MIG operations verify per-profile ``nvidia.com/mig-*`` resources: the ``mixed`` strategy (GFD's
    ``nvidia.com/mig.strategy`` label; the ClusterPolicy itself cannot be read)."""
    name, disables = "MIG strategy", "MIG sharing (its operations verify nvidia.com/mig-<profile> resources)"
    fix = "set the ClusterPolicy's mig.strategy to mixed (helm --set mig.strategy=mixed)"
    nodes: list[Any] = client.CoreV1Api(api).list_node().items
    strategies = {}
    for n in nodes:
        labels = n.metadata.labels or {}
        if labels.get("nvidia.com/mig.capable") == "true":
            strategies[str(n.metadata.name)] = labels.get("nvidia.com/mig.strategy", "")
    if not strategies:
        return Prerequisite(name, "unknown", "no node is labelled nvidia.com/mig.capable=true", disables, fix)
    others = sorted(n for n, s in strategies.items() if s and s != "mixed")
    if others:
        return Prerequisite(name, "missing", f"{len(others)} MIG-capable node(s) use strategy "
                            f"{strategies[others[0]]} (e.g. {others[0]})", disables, fix)
    return Prerequisite(name, "found", f"{len(strategies)} MIG-capable node(s), strategy mixed or not yet labelled",
                        disables, fix)


def check_capacity(api: client.ApiClient, provider: str, capacity: CapacityProvider | None = None) -> Prerequisite:
    disables = "autoscaling and packing"
    if provider == "eks-nodegroups" and capacity is not None:
        return check_eks(capacity, disables)
    if provider == "aks-nodepools" and capacity is not None:
        return check_aks(capacity, disables)
    if provider == "gke-nodepools" and capacity is not None:
        return check_gke(capacity, disables)
    if provider != "karpenter":
        return Prerequisite(f"capacity ({provider})", "unknown",
                            f"capacity.provider is {provider}: its node groups are checked through the cloud API "
                            "when used, not from the cluster", disables,
                            "make sure the optimizer's cloud credentials may read and resize the node groups")
    fix = "install Karpenter (karpenter.sh/v1 NodePool CRDs), or set capacity.provider to your managed node groups"
    try:
        pools: Any = client.CustomObjectsApi(api).list_cluster_custom_object("karpenter.sh", "v1", "nodepools")
    except client.ApiException as exc:
        if exc.status == 404:
            return Prerequisite("Karpenter", "missing", "no karpenter.sh/v1 NodePool CRD", disables, fix)
        raise
    items = pools.get("items") or []
    gpu = sorted(p["metadata"]["name"] for p in items if is_gpu_pool(p))
    detail = f"karpenter.sh/v1 NodePools: {len(items)}, with GPUs: {len(gpu)}" + (f" ({', '.join(gpu)})" if gpu else "")
    return Prerequisite("Karpenter", "found", detail, disables, fix)


def check_eks(capacity: CapacityProvider, disables: str) -> Prerequisite:
    """capacity.provider eks-nodegroups: the cluster's GPU node groups as the optimizer's AWS credentials see them."""
    where = f"EKS cluster {getattr(capacity, 'cluster', '?')} in {getattr(capacity, 'region', '?')}"
    fix = ("check KUBEON_CAPACITY_CLUSTER_NAME / KUBEON_CAPACITY_REGION and that the worker's IAM role has the "
           "policy in docs/home-capacity.md (eks:ListNodegroups, eks:DescribeNodegroup, ...)")
    return _check_groups("EKS node groups", where, fix, capacity, disables, lambda s: (
        f"{s.min_size}<={s.desired_size}<={s.max_size}"))


def check_aks(capacity: CapacityProvider, disables: str) -> Prerequisite:
    """capacity.provider aks-nodepools: the cluster's GPU agent pools as the optimizer's Azure identity sees them."""
    where = (f"AKS cluster {getattr(capacity, 'cluster', '?')} in resource group "
             f"{getattr(capacity, 'resource_group', '?')}")
    fix = ("check KUBEON_CAPACITY_SUBSCRIPTION / KUBEON_CAPACITY_RESOURCE_GROUP / KUBEON_CAPACITY_CLUSTER_NAME and "
           "that the worker's identity holds the role in docs/home-capacity.md (agentPools read/write, "
           "deleteMachines, machines read)")
    return _check_groups("AKS agent pools", where, fix, capacity, disables, lambda s: (
        f"{s.auto_scaling_group}, count {s.desired_size}"))


def _check_groups(name: str, where: str, fix: str, capacity: CapacityProvider, disables: str,
                  scaling: Callable[[GroupScaling], str]) -> Prerequisite:
    """A managed provider's GPU groups listed through its cloud API, each with its ``scaling`` and nodes."""
    try:
        groups = capacity.list_groups()
    except CapacityError as exc:
        return Prerequisite(name, "missing", f"{where}: {exc}", disables, fix)
    shown = ", ".join(f"{g.name} ({scaling(g.scaling)}, {len(g.nodes)} nodes)" if g.scaling else g.name
                      for g in groups)
    kind = name.split(" ", 1)[1]
    return Prerequisite(name, "found" if groups else "missing",
                        f"{where}: GPU {kind}: {len(groups)}" + (f" ({shown})" if shown else ""), disables, fix)


def check_gke(capacity: CapacityProvider, disables: str) -> Prerequisite:
    """capacity.provider gke-nodepools: the cluster's GPU node pools (sizes per zone) as the optimizer's Google
    service account sees them."""
    where = (f"GKE cluster {getattr(capacity, 'cluster', '?')} in {getattr(capacity, 'project', '?')}/"
             f"{getattr(capacity, 'location', '?')}")
    fix = ("check KUBEON_CAPACITY_PROJECT / KUBEON_CAPACITY_LOCATION / KUBEON_CAPACITY_CLUSTER_NAME and that the "
           "worker's service account has the role in docs/home-capacity.md (container.nodePools get/list/update, "
           "container.operations.get, compute.instanceGroupManagers get/update)")
    return _check_groups("GKE node pools", where, fix, capacity, disables, lambda s: s.auto_scaling_group)


def check_dcgm(metrics: PrometheusClient | None) -> Prerequisite:
    name = "DCGM exporter + Prometheus"
    disables = "scale to zero (Recommend only, R1.3), sharing and GPU type fit"
    if metrics is None:
        return Prerequisite(name, "missing", "prometheus.url is not set", disables,
                            "set prometheus.url to a Prometheus that scrapes the NVIDIA DCGM exporter")
    fix = "install the NVIDIA DCGM exporter (the GPU Operator ships it) and let this Prometheus scrape it"
    try:
        form = metrics.detect(refresh=True)
        profiling = bool(metrics.query(f"count({GR_ENGINE_ACTIVE})"))
    except MetricsError as exc:
        return Prerequisite(name, "missing", str(exc), disables, fix)
    activity = GR_ENGINE_ACTIVE if profiling else "DCGM_FI_DEV_GPU_UTIL / 100 (no profiling metrics)"
    return Prerequisite(name, "found", f"{metrics.url}: pods labelled {form.pod}/{form.namespace}, activity from "
                                       f"{activity}", disables, fix)


def run_checks(api: client.ApiClient, metrics: PrometheusClient | None, *, gpu_operator_namespace: str,
               capacity_provider: str, time_slicing_configmap: str = "time-slicing-config",
               capacity: CapacityProvider | None = None) -> list[Prerequisite]:
    """Every check; one that fails unexpectedly is reported as unknown, never raised."""
    checks: list[tuple[str, str, Callable[[], Prerequisite]]] = [
        ("KubeOn agent", "the hub's cluster inventory", lambda: check_agent(api)),
        ("NVIDIA GPU Operator", "sharing", lambda: check_gpu_operator(api, gpu_operator_namespace)),
        ("capacity", "autoscaling and packing", lambda: check_capacity(api, capacity_provider, capacity)),
        ("DCGM exporter + Prometheus", "scale to zero, sharing and GPU type fit", lambda: check_dcgm(metrics)),
    ]
    out = []
    for name, disables, check in checks:
        try:
            out.append(check())
        except Exception as exc:
            out.append(Prerequisite(name, "unknown", f"check failed: {exc}", disables,
                                    "see the worker log; re-run `kubeon-gpu doctor`"))
    try:
        out += check_time_slicing(api, gpu_operator_namespace, time_slicing_configmap)
    except Exception as exc:
        out.append(Prerequisite("time-slicing ConfigMap", "unknown", f"check failed: {exc}", SHARING_DISABLES,
                                "see the worker log; re-run `kubeon-gpu doctor`"))
    try:
        out.append(check_mig_strategy(api))
    except Exception as exc:
        out.append(Prerequisite("MIG strategy", "unknown", f"check failed: {exc}", "MIG sharing",
                                "see the worker log; re-run `kubeon-gpu doctor`"))
    return out


def render(prereqs: list[Prerequisite]) -> str:
    header = ["PREREQUISITE", "STATUS", "DETAIL", "DISABLES WHEN MISSING", "FIX"]
    rows = [header] + [[p.name, p.status, p.detail, "-" if p.status == "found" else p.disables,
                        "-" if p.status == "found" else p.fix] for p in prereqs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def as_json(prereqs: list[Prerequisite]) -> list[dict[str, str]]:
    return [asdict(p) for p in prereqs]


class PrerequisiteLog:
    """Logs each prerequisite once at start and again only when its status changes."""

    def __init__(self) -> None:
        self._last: dict[str, Status] = {}

    def report(self, prereqs: list[Prerequisite]) -> None:
        for p in prereqs:
            if self._last.get(p.name) != p.status:
                (log.info if p.status == "found" else log.warning)(p.log_line())
                self._last[p.name] = p.status
