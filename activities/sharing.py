"""Kubernetes side of Sharing (time-slicing through the GPU Operator) with the optimizer's own credentials: get and
patch the one time-slicing ConfigMap in ``gpuOperator.namespace`` (the chart's Role, R5.3), label nodes (``patch
nodes``, R5.1), read nodes and pods. Facts the design rests on (../shared/notes/metrics-sharing-packing.md §1): the
device plugin's config-manager reacts only to the node's ``nvidia.com/device-plugin.config`` label and reads the
ConfigMap through a mounted volume that lags; so a key a node uses is never edited, a new content-addressed key
is written and named by the label once it has had time to propagate, and keys are removed only when no node names
them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from kubernetes import client
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.kube import gpus_requested
from activities.clients.kube import is_live
from activities.clients.policies import enforceable_policies
from activities.clients.policies import patch_policy_status
from activities.clients.prometheus import PrometheusClient
from activities.context import poll
from models.policy import SharingPolicy
from models.sharing import CONFIG_LABEL
from models.sharing import COUNT_LABEL
from models.sharing import KEY_PREFIX
from models.sharing import MIG_CONFIG_LABEL
from models.sharing import MIG_STATE_LABEL
from models.sharing import PENDING_PREFIX
from models.sharing import PRODUCT_LABEL
from models.sharing import REPLICAS_LABEL
from models.sharing import STATUS_KEY
from models.sharing import STRATEGY_LABEL
from models.sharing import WRITTEN_PREFIX
from models.sharing import CleanupRequest
from models.sharing import CleanupResult
from models.sharing import LabelRequest
from models.sharing import MigLabelRequest
from models.sharing import MigStateRequest
from models.sharing import MigStateResult
from models.sharing import MigVerifyRequest
from models.sharing import NodeConfig
from models.sharing import UnservableRequest
from models.sharing import UnservableResult
from models.sharing import VerifyRequest
from models.sharing import VerifyResult
from models.sharing import WriteKeyRequest
from models.sharing import WriteKeyResult
from models.sharing import pending_annotation
from models.sharing import time_slicing_config
from models.sharing import time_slicing_key
from planning.sharing import GpuPod
from planning.sharing import NodeFacts

# Must match workflows.sharing (workflows may not import activities).
SHARING_FORBIDDEN = "SharingForbidden"
CONFIG_MAP_MISSING = "TimeSlicingConfigMapMissing"


def role_missing(namespace: str, config_map: str) -> str:
    return (f"the optimizer may not get/patch ConfigMap {namespace}/{config_map}: the chart's time-slicing Role is "
            "missing (values gpuOperator.namespace, gpuOperator.timeSlicingConfigMap, gpuOperator.createRole)")


def config_map_missing(namespace: str, config_map: str) -> str:
    return (f"ConfigMap {namespace}/{config_map} does not exist: create it (the optimizer may only get and patch "
            "it) and point the GPU Operator's ClusterPolicy devicePlugin.config.name at it")


def base_product(label: str) -> str:
    return label.removesuffix("-SHARED")


def _parse_time(stamp: str | None) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(stamp) if stamp else None
    except ValueError:
        return None


class SharingOps:
    """ConfigMap keys, node labels, node and pod reads: the watcher's, and SharingWorkflow's activities."""

    def __init__(self, api: client.ApiClient, metrics: PrometheusClient | None) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.metrics = metrics

    # -- the time-slicing ConfigMap ------------------------------------------------------------------------
    def _read_config_map(self, namespace: str, name: str) -> dict[str, str]:
        try:
            cm: Any = self.core.read_namespaced_config_map(name, namespace)
        except client.ApiException as exc:
            if exc.status == 403:
                raise ApplicationError(role_missing(namespace, name), type=SHARING_FORBIDDEN,
                                       non_retryable=True) from None
            if exc.status == 404:
                raise ApplicationError(config_map_missing(namespace, name), type=CONFIG_MAP_MISSING,
                                       non_retryable=True) from None
            raise
        return dict(cm.data or {})

    def _read_annotations(self, namespace: str, name: str) -> dict[str, str]:
        cm: Any = self.core.read_namespaced_config_map(name, namespace)
        return dict(cm.metadata.annotations or {})

    def _patch_config_map(self, namespace: str, name: str, data: dict[str, str | None],
                          annotations: dict[str, str | None] | None = None) -> None:
        body: dict[str, Any] = {"data": data}
        if annotations:
            body["metadata"] = {"annotations": annotations}
        try:
            self.core.patch_namespaced_config_map(name, namespace, body)
        except client.ApiException as exc:
            if exc.status == 403:
                raise ApplicationError(role_missing(namespace, name), type=SHARING_FORBIDDEN,
                                       non_retryable=True) from None
            raise

    @activity.defn(name="write_time_slicing_key")
    def write_key(self, req: WriteKeyRequest) -> WriteKeyResult:
        """Add the config's content-addressed key, with when it was written (its propagation counts from then); one
        already there is left as it is (never edited), and when it was written is read back: an earlier attempt
        cut off by a crash after its write, or another node's operation, may have written it a moment ago."""
        key = time_slicing_key(req.replicas, req.fail_requests_greater_than_one)
        body = time_slicing_config(req.replicas, req.fail_requests_greater_than_one)
        data = self._read_config_map(req.namespace, req.config_map)
        mark: dict[str, str | None] = {pending_annotation(req.node): key} if req.node else {}
        if key in data:
            if mark:
                self._patch_config_map(req.namespace, req.config_map, {}, mark)
            stamp = self._read_annotations(req.namespace, req.config_map).get(WRITTEN_PREFIX + key)
            return WriteKeyResult(key=key, written=False, written_at=_parse_time(stamp))
        now = dt.datetime.now(dt.UTC)
        self._patch_config_map(req.namespace, req.config_map, {key: body},
                               {**mark, WRITTEN_PREFIX + key: now.isoformat()})
        return WriteKeyResult(key=key, written=True, written_at=now)

    @activity.defn(name="remove_unused_time_slicing_keys")
    def cleanup(self, req: CleanupRequest) -> CleanupResult:
        """Remove the optimizer's keys no node's label names and no operation is bringing to its node (others'
        keys are never touched); ``release``: that node's pending mark first."""
        if req.release:
            self._patch_config_map(req.namespace, req.config_map, {}, {pending_annotation(req.release): None})
        data = self._read_config_map(req.namespace, req.config_map)
        pending = {v for k, v in self._read_annotations(req.namespace, req.config_map).items()
                   if k.startswith(PENDING_PREFIX)}
        nodes: list[Any] = self.core.list_node().items
        named = {(n.metadata.labels or {}).get(CONFIG_LABEL) for n in nodes} | pending
        unused = sorted(k for k in data if k.startswith(KEY_PREFIX) and k not in named)
        if unused:
            self._patch_config_map(req.namespace, req.config_map, dict.fromkeys(unused),
                                   {WRITTEN_PREFIX + k: None for k in unused})
        return CleanupResult(removed=unused)

    # -- nodes ---------------------------------------------------------------------------------------------
    @activity.defn(name="read_node_config")
    def node_config(self, node: str) -> NodeConfig:
        n: Any = self.core.read_node(node)
        labels = n.metadata.labels or {}
        return NodeConfig(node=node, label=labels.get(CONFIG_LABEL), replicas=int(labels.get(REPLICAS_LABEL, "1")),
                          gpus=int(labels.get(COUNT_LABEL, "0")))

    @activity.defn(name="set_device_plugin_config")
    def set_label(self, req: LabelRequest) -> None:
        self.core.patch_node(req.node, {"metadata": {"labels": {CONFIG_LABEL: req.key}}})

    def check(self, req: VerifyRequest) -> VerifyResult:
        n: Any = self.core.read_node(req.node)
        labels = dict(n.metadata.labels or {})
        allocatable = int((n.status.allocatable or {}).get("nvidia.com/gpu", "0"))
        shown = {k: labels.get(k, "") for k in (REPLICAS_LABEL, PRODUCT_LABEL, STRATEGY_LABEL)}
        want = req.gpus * req.replicas
        problems = []
        if allocatable != want:
            problems.append(f"allocatable nvidia.com/gpu is {allocatable}, not {req.gpus} x {req.replicas} = {want}")
        if shown[REPLICAS_LABEL] != str(req.replicas):
            problems.append(f"{REPLICAS_LABEL} is {shown[REPLICAS_LABEL] or 'unset'}, not {req.replicas}")
        shared = shown[PRODUCT_LABEL].endswith("-SHARED")
        if shared != (req.replicas > 1):
            problems.append(f"{PRODUCT_LABEL} is {shown[PRODUCT_LABEL]}")
        strategy = "time-slicing" if req.replicas > 1 else "none"
        if shown[STRATEGY_LABEL] != strategy:
            problems.append(f"{STRATEGY_LABEL} is {shown[STRATEGY_LABEL] or 'unset'}, not {strategy}")
        return VerifyResult(ok=not problems, allocatable=allocatable, labels=shown, reason="; ".join(problems))

    @activity.defn(name="uncordon_node")
    def uncordon(self, node: str) -> None:
        self.core.patch_node(node, {"spec": {"unschedulable": None}})

    def mig_label(self, node: str) -> tuple[str | None, str | None]:
        n: Any = self.core.read_node(node)
        labels = n.metadata.labels or {}
        return labels.get(MIG_CONFIG_LABEL), labels.get(MIG_STATE_LABEL)

    @activity.defn(name="set_mig_config")
    def set_mig(self, req: MigLabelRequest) -> None:
        """The geometry label, and the MIG manager's state label cleared in the same patch: a ``success`` read
        afterwards is the MIG manager's answer to this change, not what it said of the previous one."""
        self.core.patch_node(req.node, {"metadata": {"labels": {MIG_CONFIG_LABEL: req.geometry,
                                                                MIG_STATE_LABEL: None}}})

    def mig_resources(self, req: MigVerifyRequest) -> VerifyResult:
        n: Any = self.core.read_node(req.node)
        alloc = n.status.allocatable or {}
        wrong = [f"{k} is {alloc.get(k, '0')}, not {v}" for k, v in sorted(req.expected.items())
                 if int(alloc.get(k, "0")) != v]
        return VerifyResult(ok=not wrong, allocatable=sum(int(alloc.get(k, "0")) for k in req.expected),
                            labels={k: str(alloc.get(k, "0")) for k in req.expected}, reason="; ".join(wrong))

    @activity.defn(name="unservable_pods")
    def unservable(self, req: UnservableRequest) -> UnservableResult:
        n: Any = self.core.read_node(req.node)
        allocatable = int((n.status.allocatable or {}).get("nvidia.com/gpu", "0"))
        pods: list[Any] = [p for p in self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={req.node}").items if is_live(p) and gpus_requested(p)]
        pods.sort(key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))
        requested, over = 0, []
        for p in pods:
            requested += gpus_requested(p)
            if requested > allocatable:
                over.append(f"{p.metadata.namespace}/{p.metadata.name}")
        return UnservableResult(allocatable=allocatable, requested=requested, pods=over)

    # -- what the watcher decides from ---------------------------------------------------------------------
    def list_policies(self) -> list[SharingPolicy]:
        return [p for p in enforceable_policies(self.custom) if isinstance(p, SharingPolicy)]

    def patch_status(self, policy: str, status: dict[str, Any]) -> None:
        patch_policy_status(self.custom, policy, STATUS_KEY, status)

    def node_facts(self, match_labels: dict[str, str]) -> list[NodeFacts]:
        """The selected GPU nodes, their GPU pods, and the pending GPU pods each could take (by nodeSelector)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items() if match_labels else []))
        nodes: list[Any] = self.core.list_node(label_selector=selector).items
        pods: list[Any] = self.core.list_pod_for_all_namespaces().items
        pending = [p for p in pods if is_live(p) and not p.spec.node_name and gpus_requested(p)]
        out = []
        for n in nodes:
            labels = n.metadata.labels or {}
            if COUNT_LABEL not in labels:
                continue
            name = str(n.metadata.name)
            mine = tuple(GpuPod(p.metadata.namespace, p.metadata.name, gpus_requested(p)) for p in pods
                         if p.spec.node_name == name and is_live(p) and gpus_requested(p))
            waiting = tuple(GpuPod(p.metadata.namespace, p.metadata.name, gpus_requested(p)) for p in pending
                            if all(labels.get(k) == v for k, v in (p.spec.node_selector or {}).items()))
            out.append(NodeFacts(
                name=name, product=base_product(labels.get(PRODUCT_LABEL, "")), gpus=int(labels[COUNT_LABEL]),
                replicas=int(labels.get(REPLICAS_LABEL, "1")), mig_config=labels.get(MIG_CONFIG_LABEL, "all-disabled"),
                pods=mine, waiting=waiting))
        return out

    # -- activities (and those marked above); their names are what histories hold --------------------------
    @activity.defn(name="verify_time_slicing")
    async def verify_time_slicing(self, req: VerifyRequest) -> VerifyResult:
        """Until the node shows the config (allocatable and labels) or the timeout; heartbeats."""
        result, _ = await poll(lambda: self.check(req), lambda r: r.ok, timeout_seconds=req.timeout_seconds,
                               describe=lambda r: r.reason or "verified")
        return result

    @activity.defn(name="read_mig_config")
    def read_mig_config(self, node: str) -> MigStateResult:
        label, state = self.mig_label(node)
        return MigStateResult(state=state or "", previous=label)

    @activity.defn(name="wait_mig_state")
    async def wait_mig_state(self, req: MigStateRequest) -> MigStateResult:
        """Until the MIG manager reports ``success`` or ``failed`` for the geometry, or the timeout; heartbeats."""
        (_, state), reported = await poll(
            lambda: self.mig_label(req.node),
            lambda got: got[0] == req.geometry and got[1] in ("success", "failed"),
            timeout_seconds=req.timeout_seconds, describe=lambda got: f"{got[0]}: {got[1]}")
        return MigStateResult(state=state if reported else f"timeout (still {state or 'unset'})")

    @activity.defn(name="verify_mig_resources")
    async def verify_mig_resources(self, req: MigVerifyRequest) -> VerifyResult:
        """Until the node advertises the geometry's resources or the timeout (the device plugin registers them
        after the MIG manager's success, not with it); heartbeats."""
        result, _ = await poll(lambda: self.mig_resources(req), lambda r: r.ok,
                               timeout_seconds=req.timeout_seconds, describe=lambda r: r.reason or "verified")
        return result

    def all(self) -> list[Callable[..., Any]]:
        return [self.write_key, self.node_config, self.set_label, self.verify_time_slicing, self.cleanup,
                self.unservable, self.uncordon, self.read_mig_config, self.set_mig, self.wait_mig_state,
                self.verify_mig_resources]
