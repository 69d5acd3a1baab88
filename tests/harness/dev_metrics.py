"""`make dev`'s GPU metrics: a GPU node pool for ScaleToZero and Sharing (namespace ``ml-inference`` with the
chart's scale Role, a kwok node with 4 simulated A100s labelled as GPU Feature Discovery labels one), the GPU
Operator stand-in acting on that node (namespace ``gpu-operator`` with its time-slicing ConfigMap and the chart's
time-slicing Role, R5.3), the DCGM exporter fixture and a real Prometheus scraping it (and the product's own
``/metrics``: ``products`` names their jobs and targets, e.g. the worker's and the gateway's).

A syncer gives each running pod on that node a simulated GPU. Its activity comes from its Deployment's annotation
``dev.kubeon.io/gpu-activity`` (0-1, default 0.6: busy); ``dev.kubeon.io/idle-history: 168h`` backfills that much
history at that activity for the Deployment's new pods (Prometheus restarts), so "idle for 30 minutes" is seen
at once instead of after 30 minutes. examples/scale-to-zero-workload.yaml carries both.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from kubernetes import client

from models.policy import duration_seconds
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.gpu_operator import GpuOperator
from tests.harness.gpu_operator import grant_time_slicing_role
from tests.harness.kube import Cluster
from tests.harness.prometheus import SCRAPE_JOB
from tests.harness.prometheus import Prometheus
from tests.harness.scale import scale_role_docs

NAMESPACE = "ml-inference"
NODE = "gpu-inference-1"
PRODUCT = "NVIDIA-A100-SXM4-80GB"
ACTIVITY = "dev.kubeon.io/gpu-activity"
IDLE_HISTORY = "dev.kubeon.io/idle-history"
GPU_OPERATOR_NAMESPACE = "gpu-operator"
TIME_SLICING_CONFIGMAP = "time-slicing-config"
# How long the stand-in's device plugin takes to see a changed ConfigMap (the kubelet's volume sync, seconds on a
# real node); make dev's worker waits a little longer (SHARING_PROPAGATION_SECONDS) before it labels the node.
PROPAGATION_DELAY = 2.0
SHARING_PROPAGATION_SECONDS = 4


def backfill_offsets(history_s: int) -> list[int]:
    """Seconds ago of each backfilled sample: every 30 s (the live scrape's pace) over the last hour, every 4 min
    before (under Prometheus' 5 min lookback, so every step of a week-long coverage subquery finds one; a week at
    30 s would be 20,160 samples per series for promtool to write and Prometheus to load)."""
    recent = min(history_s, 3600)
    return [*range(history_s, recent, -240), *range(recent, 10, -30)]


@dataclass
class DevMetrics:
    cluster: Cluster
    workdir: Path
    exporter: DcgmExporter = field(default_factory=DcgmExporter)
    prometheus: Prometheus | None = None
    gpu_operator: GpuOperator | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _backfilled: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    popen: Callable[..., Any] = field(default=subprocess.Popen, repr=False)  # `make dev`'s registry's

    def start(self, port: int = 0, products: dict[str, str] | None = None) -> DevMetrics:
        admin = self.cluster.admin
        admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        api = client.ApiClient()
        for doc in scale_role_docs(NAMESPACE):
            kind = "V1Role" if doc["kind"] == "Role" else "V1RoleBinding"
            obj = api._ApiClient__deserialize(doc, kind)  # type: ignore[attr-defined]
            if doc["kind"] == "Role":
                admin.rbac.create_namespaced_role(NAMESPACE, obj)
            else:
                admin.rbac.create_namespaced_role_binding(NAMESPACE, obj)
        self.cluster.create_kwok_node(NODE, gpus=4, labels=GpuOperator.gfd_labels(PRODUCT, 4))
        admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=GPU_OPERATOR_NAMESPACE)))
        admin.core.create_namespaced_config_map(GPU_OPERATOR_NAMESPACE, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=TIME_SLICING_CONFIGMAP), data={}))
        grant_time_slicing_role(self.cluster, GPU_OPERATOR_NAMESPACE)
        self.gpu_operator = GpuOperator(admin.api, namespace=GPU_OPERATOR_NAMESPACE,
                                        config_map=TIME_SLICING_CONFIGMAP, propagation_delay=PROPAGATION_DELAY,
                                        mig_seconds=2.0, node_selector=f"kubernetes.io/hostname={NODE}").start()
        self.exporter.start()
        self.exporter.add_node(NODE, gpus=4)
        self.prometheus = Prometheus(self.workdir / "prometheus", targets=[self.exporter.address], port=port,
                                     scrape_interval="5s", popen=self.popen,
                                     jobs={job: [target] for job, target in (products or {}).items()}).start()
        self.prometheus.wait_scraped(jobs=(SCRAPE_JOB,))  # the product's processes may start after it
        threading.Thread(target=self._sync_forever, name="dev-gpu-metrics", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self.prometheus is not None
        return self.prometheus.url

    def stop(self) -> None:
        self._stop.set()
        if self.gpu_operator is not None:
            self.gpu_operator.stop()
        if self.prometheus is not None:
            self.prometheus.stop()
        self.exporter.stop()

    def _sync_forever(self) -> None:
        while not self._stop.wait(3):
            try:
                self.sync()
            except Exception as exc:  # the dev loop keeps going; the next round retries
                print(f"[kubeon dev] GPU metrics sync: {exc}", flush=True)

    def sync(self) -> None:
        with self._lock:  # the syncer thread and a caller never restart Prometheus at once
            self._sync()

    def _sync(self) -> None:
        admin = self.cluster.admin
        listed: list[Any] = admin.apps.list_namespaced_deployment(NAMESPACE).items
        deployments = {str(d.metadata.name): d for d in listed}
        on_node: list[Any] = admin.core.list_namespaced_pod(NAMESPACE, field_selector=f"spec.nodeName={NODE}").items
        pods = [p for p in on_node if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
        live = {p.metadata.name for p in pods}
        for gpu in self.exporter.snapshot():
            if gpu.pod and gpu.pod not in live:
                self.exporter.release(NAMESPACE, gpu.pod)
        backfill: list[str] = []
        history_s = 0
        for pod in pods:
            owner = self._deployment_of(pod, deployments)
            notes: dict[str, Any] = (owner.metadata.annotations or {}) if owner is not None else {}
            activity = float(notes.get(ACTIVITY, "0.6"))
            self.exporter.assign(NAMESPACE, pod.metadata.name, activity=activity, fb_used_mib=9 * 1024)
            if IDLE_HISTORY in notes and pod.metadata.name not in self._backfilled:
                backfill.append(str(pod.metadata.name))
                history_s = max(history_s, duration_seconds(str(notes[IDLE_HISTORY])))
        if backfill and self.prometheus is not None:
            now = time.time()
            held = [g for g in self.exporter.snapshot() if g.pod in backfill]
            self.prometheus.stop()
            self.prometheus.backfill(openmetrics_history(
                [(now - ago, held) for ago in backfill_offsets(history_s)],
                extra={"job": SCRAPE_JOB, "instance": self.exporter.address}))
            self.prometheus.start()
            self.prometheus.wait_scraped(jobs=(SCRAPE_JOB,))
            self._backfilled.update(backfill)
            print(f"[kubeon dev] backfilled {history_s // 60}m of GPU history for {', '.join(backfill)}", flush=True)

    @staticmethod
    def _deployment_of(pod: Any, deployments: dict[str, Any]) -> Any:
        for ref in pod.metadata.owner_references or []:
            if ref.kind == "ReplicaSet":
                name = ref.name.rsplit("-", 1)[0]
                return deployments.get(name)
        return None
