"""A stand-in for the NVIDIA GPU Operator's node-side components, at the API level, on kwok nodes of the real
control plane: the device plugin's config-manager with GPU Feature Discovery (time-slicing), and the MIG manager.
No GPU exists here, so what the real components do to the hardware is played by writing what they then write
to the Node: its labels and its ``status.capacity`` / ``status.allocatable``. It runs as a thread (``start`` /
``stop``, or a ``with`` block) or as a process (``python -m tests.harness.gpu_operator --kubeconfig K``).

Where each behaviour comes from (sources read for ../shared/notes/metrics-sharing-packing.md, sections 1-2):

- Config selection, the ``nvidia.com/device-plugin.config`` label: NVIDIA/k8s-device-plugin
  ``cmd/config-manager/main.go`` (@1b826ac): an informer on its own Node; it acts only when the label's value
  changes (``oldLabel != newLabel``); the label value if set, else ``DEFAULT_CONFIG`` (ClusterPolicy
  ``devicePlugin.config.default``: ``default_config`` here), else the fallback the GPU Operator sets
  (``FALLBACK_STRATEGIES=empty``, gpu-operator ``controllers/object_controls.go``): no sharing.
- A label naming a key the mounted ConfigMap lacks: ``updateConfigName`` returns "specified config %v does not
  exist" and the sidecar exits (its container restarts and tries again). Here: the node keeps its previous
  config, the refusal is recorded in ``events``, and it is retried each poll (the restart loop).
- The ConfigMap reaches the pod as a mounted volume, eventually (kubelet sync period + ConfigMap cache TTL,
  Kubernetes docs): ``propagation_delay`` seconds here, applied to every change of the ConfigMap's data (the
  stand-in reads the ConfigMap through the API and sees the mounted copy as it was that long ago).
- The Operator does not watch the ConfigMap (cloud-native-docs ``gpu-operator/gpu-sharing.rst``, "Updating a
  Time-Slicing Config Map"): a changed body of a key a node already uses is not applied until the label changes.
- Config validation, ``api/config/v1`` (``config.go``, ``replicas.go``): ``version`` v1 (empty = v1);
  ``sharing.timeSlicing.resources`` non-empty; each ``name`` set and ``replicas >= 2``; ``renameByDefault``
  advertises ``<name>.shared`` and ``nvidia.com/gpu`` 0.
- What GFD labels and what the node advertises (gpu-sharing.rst, "Changes to Node Labels"): capacity
  ``nvidia.com/gpu`` = GPUs x replicas; ``nvidia.com/gpu.replicas``; ``nvidia.com/gpu.product`` with
  ``-SHARED`` (unless renamed); ``nvidia.com/gpu.sharing-strategy`` ``none`` | ``time-slicing``;
  ``nvidia.com/gpu.count`` stays the physical count.
- MIG manager (cloud-native-docs ``gpu-operator/gpu-operator-mig.rst``): ``nvidia.com/mig.config=<geometry>``
  selects the config; ``nvidia.com/mig.config.state`` goes ``pending`` -> (``rebooting`` with ``WITH_REBOOT``)
  -> ``success`` | ``failed``; it "terminates all the GPU pods" on the node before reconfiguring (here: deletes
  the pods bound to the node that request ``nvidia.com/gpu`` or ``nvidia.com/mig-*``). Strategy ``mixed``: one
  resource per profile ``nvidia.com/mig-<g>g.<mem>gb`` with ``nvidia.com/mig-<profile>.count`` labels;
  ``single``: the slices are ``nvidia.com/gpu`` and the product gets ``-MIG-<profile>``.
- Geometries: NVIDIA/gpu-operator ``assets/state-mig-manager/0400_configmap.yaml`` (``default-mig-parted-config``,
  @206adb6): A100-40GB ``all-1g.5gb`` 7, ``all-2g.10gb`` 3, ``all-3g.20gb`` 2, ``all-7g.40gb`` 1; A100-80GB
  ``all-1g.10gb`` 7, ``all-2g.20gb`` 3, ``all-3g.40gb`` 2, ``all-7g.80gb`` 1; ``all-balanced`` A100-40GB
  {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}, A100-80GB {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}. H100-80GB: the same
  profiles as A100-80GB and the same ``all-balanced`` (the notes' reading of the newer config, device
  0x233010DE).

Unverified, and chosen here: the plugin keeps its previous config while the sidecar restarts over a missing key,
and over an invalid config body; the MIG manager does not retry a ``failed`` geometry until the label changes;
a failed reconfiguration leaves the previous resources advertised; pods above the new allocatable after replicas
are reduced keep running (the kubelet does not evict them). The real components also stop the device plugin, GFD
and DCGM exporter during a MIG change; that pause is not played.

Fault injection: ``fail_next_mig(node)`` (the next reconfiguration ends ``failed``), ``stick_pending(node)``
(the next stays ``pending``), a label naming a missing key (refused as above), ``disconnect()`` (the
ClusterPolicy does not point the device plugin at this ConfigMap: labels are ignored). Holds, for tests that act
at one step of an operation (``release(node)`` lets the node go on): ``hold_config(node)`` (the config-manager
does not act on the node's label yet: a slow sidecar restart), ``hold_mig(node, geometry)`` (a reconfiguration
to ``geometry`` stays ``pending``), ``hold_mig_resources(node, geometry)`` (it reports ``success`` but the
device plugin does not advertise the new resources yet: the plugin restarts after the MIG manager is done, its
lag unverified).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Self

import urllib3
import yaml
from kubernetes import client
from kubernetes import config

CONFIG_LABEL = "nvidia.com/device-plugin.config"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
PRESENT_LABEL = "nvidia.com/gpu.present"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
STRATEGY_LABEL = "nvidia.com/gpu.sharing-strategy"
MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"

# Memory as GFD reports it (MiB), by product family.
MEMORY_MIB = {"A100-SXM4-40GB": 40960, "A100-PCIE-40GB": 40960, "A100-SXM4-80GB": 81920,
              "A100-80GB-PCIe": 81920, "H100-80GB-HBM3": 81559, "H100-PCIe": 81559}

_A100_40 = {"all-1g.5gb": {"1g.5gb": 7}, "all-2g.10gb": {"2g.10gb": 3}, "all-3g.20gb": {"3g.20gb": 2},
            "all-7g.40gb": {"7g.40gb": 1}, "all-balanced": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}
_80GB = {"all-1g.10gb": {"1g.10gb": 7}, "all-2g.20gb": {"2g.20gb": 3}, "all-3g.40gb": {"3g.40gb": 2},
         "all-7g.80gb": {"7g.80gb": 1}, "all-balanced": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}
DISABLED = "all-disabled"


def geometries(product: str) -> dict[str, dict[str, int]]:
    """The MIG geometries the default mig-parted config gives a product (per GPU), ``all-disabled`` aside."""
    p = product.upper()
    if "A100" in p and "40GB" in p:
        return _A100_40
    if ("A100" in p and "80GB" in p) or ("H100" in p and "80GB" in p) or p.endswith("H100-PCIE"):
        return _80GB
    return {}


def base_product(label: str) -> str:
    """The physical product a GFD label names (``-SHARED`` and ``-MIG-<profile>`` suffixes off)."""
    return re.sub(r"(-MIG-[0-9a-z.]+)?(-SHARED)?$", "", label)


class ConfigRefused(ValueError):
    pass


@dataclass(frozen=True)
class Sharing:
    replicas: int = 1  # 1: not shared
    rename: bool = False
    fail_requests_greater_than_one: bool = False


def parse_config(body: str) -> Sharing:
    """A device-plugin config file, as ``api/config/v1`` validates it; raises ``ConfigRefused``."""
    try:
        doc = yaml.safe_load(body) or {}
    except yaml.YAMLError as exc:
        raise ConfigRefused(f"unparsable config: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigRefused("config is not a mapping")
    if doc.get("version", "v1") not in ("v1", "", None):
        raise ConfigRefused(f"unknown version: {doc.get('version')}")
    sharing = doc.get("sharing") or {}
    ts = sharing.get("timeSlicing")
    if ts is None:
        return Sharing()
    resources = ts.get("resources") or []
    if not resources:
        raise ConfigRefused("no resources specified")
    replicas = 1
    for r in resources:
        if not r.get("name"):
            raise ConfigRefused("resource name is required")
        if not isinstance(r.get("replicas"), int) or r["replicas"] < 2:
            raise ConfigRefused("number of replicas must be >= 2")
        if r["name"] == GPU:
            replicas = r["replicas"]
    return Sharing(replicas=replicas, rename=bool(ts.get("renameByDefault")),
                   fail_requests_greater_than_one=bool(ts.get("failRequestsGreaterThanOne")))


@dataclass
class NodeState:
    product: str
    gpus: int
    applied_key: str | None = None  # the config key in force (None: the fallback, no sharing)
    applied_label: str | None = ""  # the label value last acted on ("" = never seen)
    sharing: Sharing = field(default_factory=Sharing)
    mig: str = DISABLED
    mig_target: str | None = None  # a reconfiguration under way
    mig_started: float = 0.0
    mig_phase: str = ""
    mig_fail_next: bool = False
    mig_stick_next: bool = False
    mig_label_seen: str | None = ""  # the label value last acted on ("" = never seen); unchanged: nothing to do
    hold_config: bool = False  # the config-manager does not act on the label until released
    hold_mig: str | None = None  # a reconfiguration to this geometry stays pending until released
    hold_resources: str | None = None  # ... reports success, its resources advertised once released
    unpublished: bool = False  # a geometry in force whose resources are not advertised yet


@dataclass
class GpuOperator:
    """The config-manager + GFD and the MIG manager for every node labelled ``nvidia.com/gpu.present=true``."""

    api: client.ApiClient
    namespace: str = "gpu-operator"
    config_map: str = "time-slicing-config"
    propagation_delay: float = 0.0
    default_config: str | None = None
    mig_seconds: float = 0.3  # from pending to the next state
    with_reboot: bool = False
    reboot_seconds: float = 0.3
    mig_strategy: str = "mixed"
    interval: float = 0.2
    # More labels a managed node must have (a label selector), as a DaemonSet's nodeSelector narrows it: make dev's
    # stand-in keeps to its own node on a control plane that tests share.
    node_selector: str = ""
    events: list[str] = field(default_factory=list)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    connected: bool = True
    last_error: str = ""  # what failed the last failed pass (the loop goes on)
    _history: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    # -- setting up --------------------------------------------------------------------------------------------
    @staticmethod
    def gfd_labels(product: str, gpus: int) -> dict[str, str]:
        """What GFD puts on a GPU node before any sharing."""
        return {PRESENT_LABEL: "true", PRODUCT_LABEL: product, COUNT_LABEL: str(gpus),
                MEMORY_LABEL: str(MEMORY_MIB.get(product.removeprefix("NVIDIA-"), 81920)),
                REPLICAS_LABEL: "1", STRATEGY_LABEL: "none",
                MIG_CAPABLE_LABEL: "true" if geometries(product) else "false",
                "nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/gpu.deploy.mig-manager": "true"}

    # -- faults ------------------------------------------------------------------------------------------------
    def fail_next_mig(self, node: str) -> None:
        with self._lock:
            self.nodes[node].mig_fail_next = True

    def stick_pending(self, node: str) -> None:
        with self._lock:
            self.nodes[node].mig_stick_next = True

    def hold_config(self, node: str) -> None:
        with self._lock:
            self.nodes[node].hold_config = True

    def hold_mig(self, node: str, geometry: str) -> None:
        with self._lock:
            self.nodes[node].hold_mig = geometry

    def hold_mig_resources(self, node: str, geometry: str) -> None:
        with self._lock:
            self.nodes[node].hold_resources = geometry

    def release(self, node: str) -> None:
        """The node's holds lifted: what was held happens at the next pass."""
        with self._lock:
            state = self.nodes[node]
            state.hold_config, state.hold_mig, state.hold_resources = False, None, None

    def disconnect(self, connected: bool = False) -> None:
        """ClusterPolicy ``devicePlugin.config.name`` not (``False``) or again (``True``) this ConfigMap."""
        self.connected = connected

    def _event(self, text: str) -> None:
        with self._lock:
            self.events.append(text)
            del self.events[:-500]

    def events_for(self, node: str) -> list[str]:
        with self._lock:
            return [e for e in self.events if e.startswith(f"{node}: ")]

    # -- running -----------------------------------------------------------------------------------------------
    def start(self) -> Self:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-operator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except (client.ApiException, OSError, urllib3.exceptions.HTTPError) as exc:
                # The API server failed a pass (a dropped connection, a restart; urllib3's errors are not
                # OSErrors): the next pass retries, as the real components' informers do. Before, such an error
                # ended the thread and every later test waited on a node nothing reconciled.
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.interval)

    def step(self, now: float | None = None) -> None:
        """One pass over the managed nodes (the loop calls it every ``interval``)."""
        now = time.monotonic() if now is None else now
        self._observe_config_map(now)
        selector = ",".join(s for s in (f"{PRESENT_LABEL}=true", self.node_selector) if s)
        nodes: list[Any] = self.core.list_node(label_selector=selector).items
        for node in nodes:
            with self._lock:
                try:
                    self._reconcile(node, now)
                except client.ApiException as exc:
                    # A node deleted since the list (another test's, on a shared control plane) is skipped, as an
                    # informer drops it; before, its 404 ended the pass and the nodes after it waited for the next.
                    if exc.status != 404:
                        raise

    # -- the ConfigMap as the plugin pod's volume sees it ------------------------------------------------------
    def _observe_config_map(self, now: float) -> None:
        try:
            cm: Any = self.core.read_namespaced_config_map(self.config_map, self.namespace)
            data = dict(cm.data or {})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            data = {}
        with self._lock:
            if not self._history or self._history[-1][1] != data:
                self._history.append((now, data))
            # Keep the newest entry older than the delay and everything after it.
            old = [i for i, (at, _) in enumerate(self._history) if at <= now - self.propagation_delay]
            if len(old) > 1:
                del self._history[:old[-1]]

    def mounted(self, now: float | None = None) -> dict[str, str]:
        """The ConfigMap's data as the device plugin's mounted volume holds it now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = [data for at, data in self._history if at <= now - self.propagation_delay]
            return dict(seen[-1]) if seen else {}

    # -- one node ----------------------------------------------------------------------------------------------
    def _reconcile(self, node: Any, now: float) -> None:
        name = str(node.metadata.name)
        labels = dict(node.metadata.labels or {})
        state = self.nodes.get(name)
        if state is None:
            state = self.nodes[name] = NodeState(product=base_product(labels.get(PRODUCT_LABEL, "unknown")),
                                                 gpus=int(labels.get(COUNT_LABEL, "1")))
            if labels.get(MIG_STATE_LABEL) == "success" and labels.get(MIG_CONFIG_LABEL):
                state.mig = labels[MIG_CONFIG_LABEL]
            state.mig_label_seen = labels.get(MIG_CONFIG_LABEL)
        self._config_manager(name, labels, state, now)
        self._mig_manager(name, labels, state, now)

    def _config_manager(self, name: str, labels: dict[str, str], state: NodeState, now: float) -> None:
        if not self.connected or state.hold_config:
            return
        label = labels.get(CONFIG_LABEL)
        if label == state.applied_label:
            return  # the informer fires on a change of the label only
        key = label or self.default_config
        if key is None:
            sharing = Sharing()
        else:
            body = self.mounted(now).get(key)
            if body is None:
                refusal = f"{name}: specified config {key} does not exist (config-manager exits; retried)"
                if self.events_for(name)[-1:] != [refusal]:
                    self._event(refusal)
                return
            try:
                sharing = parse_config(body)
            except ConfigRefused as exc:
                self._event(f"{name}: config {key} refused: {exc}")
                return
        state.applied_label, state.applied_key, state.sharing = label, key, sharing
        self._event(f"{name}: config {key or '(none)'} applied: replicas {sharing.replicas}")
        self._publish(name, state)

    def _mig_manager(self, name: str, labels: dict[str, str], state: NodeState, now: float) -> None:
        wanted = labels.get(MIG_CONFIG_LABEL)
        if state.unpublished and state.hold_resources is None:
            state.unpublished = False
            self._publish(name, state)
            self._event(f"{name}: mig config {state.mig}: resources advertised")
        if state.mig_target is None:
            # Acts on a change of the label only (a failed geometry is not retried until the label changes); a
            # change back to the geometry in force is a reconfiguration too, which succeeds.
            if wanted is None or wanted == state.mig_label_seen:
                return
            state.mig_label_seen = wanted
            state.mig_target, state.mig_started, state.mig_phase = wanted, now, "pending"
            self._label(name, {MIG_STATE_LABEL: "pending"})
            self._event(f"{name}: mig config {wanted}: pending")
            self._delete_gpu_pods(name)
            if state.mig_stick_next:
                state.mig_stick_next = False
                state.mig_phase = "stuck"
            return
        if state.mig_phase == "stuck":
            if wanted != state.mig_target:  # a new label starts over
                state.mig_target = None
            return
        if now - state.mig_started < self.mig_seconds or state.hold_mig == state.mig_target:
            return
        if state.mig_phase == "pending" and self.with_reboot:
            state.mig_phase, state.mig_started = "rebooting", now
            self._label(name, {MIG_STATE_LABEL: "rebooting"})
            self._event(f"{name}: mig config {state.mig_target}: rebooting")
            return
        if state.mig_phase == "rebooting" and now - state.mig_started < self.reboot_seconds:
            return
        target = state.mig_target
        state.mig_target = None
        if state.mig_fail_next or (target != DISABLED and target not in geometries(state.product)):
            state.mig_fail_next = False
            self._label(name, {MIG_STATE_LABEL: "failed"})
            self._event(f"{name}: mig config {target}: failed")
            return
        state.mig = target
        if state.hold_resources == target:
            state.unpublished = True
        else:
            self._publish(name, state)
        self._label(name, {MIG_STATE_LABEL: "success"})
        self._event(f"{name}: mig config {target}: success")

    # -- writing the node --------------------------------------------------------------------------------------
    def resources(self, state: NodeState) -> dict[str, int]:
        """What the device plugin advertises for the node's state (nvidia.com/* only)."""
        out: dict[str, int] = {}
        replicas = state.sharing.replicas
        slices = {} if state.mig == DISABLED else geometries(state.product).get(state.mig, {})
        if slices and self.mig_strategy == "mixed":
            out[GPU] = 0
            for profile, count in slices.items():
                out[f"{MIG_PREFIX}{profile}"] = count * state.gpus
        elif slices:
            out[GPU] = sum(slices.values()) * state.gpus * replicas
        else:
            out[GPU] = state.gpus * replicas
        if state.sharing.rename and replicas > 1:
            out[f"{GPU}.shared"], out[GPU] = out[GPU], 0
        return out

    def _publish(self, name: str, state: NodeState) -> None:
        node: Any = self.core.read_node(name)
        res = self.resources(state)
        stale = {k: None for k in (node.status.capacity or {}) if k.startswith(MIG_PREFIX) or k == f"{GPU}.shared"}
        values = {**stale, **{k: str(v) for k, v in res.items()}}
        self.core.patch_node_status(name, {"status": {"capacity": values, "allocatable": values}})
        replicas = state.sharing.replicas
        product = state.product
        slices = {} if state.mig == DISABLED else geometries(state.product).get(state.mig, {})
        if slices and self.mig_strategy == "single" and len(slices) == 1:
            product += f"-MIG-{next(iter(slices))}"
        if replicas > 1 and not state.sharing.rename:
            product += "-SHARED"
        labels: dict[str, str | None] = {
            k: None for k in (node.metadata.labels or {}) if k.startswith(MIG_PREFIX) and k.endswith(".count")}
        labels.update({PRODUCT_LABEL: product, REPLICAS_LABEL: str(replicas),
                       STRATEGY_LABEL: "time-slicing" if replicas > 1 else "none",
                       MIG_STRATEGY_LABEL: self.mig_strategy})
        if self.mig_strategy == "mixed":
            for profile, count in slices.items():
                labels[f"{MIG_PREFIX}{profile}.count"] = str(count * state.gpus)
        self._label(name, labels)

    def _label(self, name: str, labels: dict[str, str | None]) -> None:
        self.core.patch_node(name, {"metadata": {"labels": labels}})

    def _delete_gpu_pods(self, name: str) -> None:
        pods: list[Any] = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items
        for pod in pods:
            if any(k == GPU or k.startswith(MIG_PREFIX) for c in pod.spec.containers
                   for k in ((c.resources.requests or {}) | (c.resources.limits or {}) if c.resources else {})):
                with contextlib.suppress(client.ApiException):
                    self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                                    grace_period_seconds=0)
                self._event(f"{name}: mig manager deleted GPU pod {pod.metadata.namespace}/{pod.metadata.name}")


def grant_time_slicing_role(cluster: Any, namespace: str) -> None:
    """The chart's time-slicing Role and RoleBinding (R5.3), rendered for ``namespace``, created as the chart
    creates them (the optimizer's ServiceAccount: ``tests.harness.rbac.install_chart_identities``)."""
    from tests.charts.helm import BURST_VALUES  # helm is built with the control plane
    from tests.charts.helm import template  # helm is built with the control plane

    api = client.ApiClient()
    rendered = template("--set", f"gpuOperator.namespace={namespace}", values=[BURST_VALUES])
    for doc in rendered.docs:
        if doc["kind"] in ("Role", "RoleBinding") and doc["metadata"].get("namespace") == namespace:
            if doc["kind"] == "Role":
                cluster.admin.rbac.create_namespaced_role(
                    namespace, api._ApiClient__deserialize(doc, "V1Role"))  # type: ignore[attr-defined]
            else:
                cluster.admin.rbac.create_namespaced_role_binding(
                    namespace, api._ApiClient__deserialize(doc, "V1RoleBinding"))  # type: ignore[attr-defined]


def gpu_operator_namespace(cluster: Any) -> str:
    """A namespace of its own for the GPU Operator: the chart's time-slicing Role there
    (:func:`grant_time_slicing_role`) and its time-slicing ConfigMap with one key (``any``); its name."""
    namespace: str = cluster.create_namespace("gpu-operator")
    grant_time_slicing_role(cluster, namespace)
    cluster.admin.core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="time-slicing-config"), data={"any": "version: v1\n"}))
    return namespace


@contextlib.contextmanager
def running(api: client.ApiClient, **kwargs: Any) -> Iterator[GpuOperator]:
    operator = GpuOperator(api, **kwargs).start()
    try:
        yield operator
    finally:
        operator.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--namespace", default="gpu-operator")
    parser.add_argument("--config-map", default="time-slicing-config")
    parser.add_argument("--propagation-delay", type=float, default=5.0)
    parser.add_argument("--with-reboot", action="store_true")
    args = parser.parse_args(argv)
    operator = GpuOperator(config.new_client_from_config(config_file=str(args.kubeconfig)),
                           namespace=args.namespace, config_map=args.config_map,
                           propagation_delay=args.propagation_delay, with_reboot=args.with_reboot)
    operator._run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
