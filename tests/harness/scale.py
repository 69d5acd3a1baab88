"""A ScaleToZero stack for end-to-end tests: the burst stack's CRD and chart identities, the chart's scale Role in
the namespaces a test grants, GPU kwok nodes, the DCGM exporter fixture and a real Prometheus whose history is
backfilled for the pods a test makes idle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from kubernetes import client

from models.policy import API_GROUP
from models.policy import PLURAL
from models.scale import STATUS_KEY
from models.scale import ScalePhase
from models.scale import ScaleView
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import unique
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.gpu_metrics import GpuMetricsStack
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.prometheus import Prometheus
from worker.config import Settings

SCALE_LABEL = "gpu.kubeon.io/scale-to-zero"


def scale_role_docs(namespace: str) -> list[dict[str, Any]]:
    """The chart's scale Role and RoleBinding, rendered with scaleToZero.namespaces={namespace}."""
    from tests.charts.helm import BURST_VALUES
    from tests.charts.helm import template

    rendered = template("--set", f"scaleToZero.namespaces={{{namespace}}}", values=[BURST_VALUES])
    return [d for d in rendered.docs if d["kind"] in ("Role", "RoleBinding")
            and d["metadata"]["name"].endswith("-scale") and d["metadata"].get("namespace") == namespace]


class ScaleStack(GpuMetricsStack):
    def settings(self, *, temporal_address: str, task_queue: str, prometheus: bool = True, **overrides: Any
                 ) -> Settings:
        values: dict[str, Any] = {"prometheus_url": self.prometheus.url if prometheus else "",
                                  "scale_resync_seconds": 1, "scale_observe_seconds": 1,
                                  "scale_rescale_check_seconds": 1, "burst_enabled": False}
        values.update(overrides)
        return self.burst.settings(temporal_address=temporal_address, task_queue=task_queue, locations=[],
                                   cluster_name=task_queue, **values)

    def grant_scale_role(self, namespace: str) -> None:
        api = client.ApiClient()
        rbac = self.cluster.admin.rbac
        for doc in scale_role_docs(namespace):
            if doc["kind"] == "Role":
                rbac.create_namespaced_role(namespace, api._ApiClient__deserialize(doc, "V1Role"))  # type: ignore[attr-defined]
            else:
                rbac.create_namespaced_role_binding(
                    namespace, api._ApiClient__deserialize(doc, "V1RoleBinding"))  # type: ignore[attr-defined]

    def deploy(self, namespace: str, name: str, *, replicas: int = 2, opt_in: bool = True) -> None:
        deployment = gpu_deployment(name, replicas=replicas, gpu_product=None, tolerate=False)
        assert deployment.metadata is not None
        deployment.metadata.labels = {SCALE_LABEL: "true"} if opt_in else {"app": name}
        self.cluster.admin.apps.create_namespaced_deployment(namespace, deployment)

    def running_pods(self, namespace: str, name: str, count: int) -> list[str]:
        def running() -> list[str] | None:
            pods: list[Any] = self.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
            names = sorted(str(p.metadata.name) for p in pods if p.status.phase == "Running"
                           and p.metadata.deletion_timestamp is None)
            return names if len(names) == count else None
        return wait_for(running, what=f"{count} running pod(s) of {namespace}/{name}", timeout=90)

    def replicas(self, namespace: str, name: str) -> tuple[int, int]:
        d: Any = self.cluster.admin.apps.read_namespaced_deployment(name, namespace)
        return int(d.spec.replicas), int(d.status.ready_replicas or 0)

    def create_policy(self, name: str, namespaces: list[str], *, mode: str | None, **spec: Any) -> None:
        body: dict[str, Any] = {"kind": "ScaleToZero", "namespaces": namespaces,
                                "selector": {"matchLabels": {SCALE_LABEL: "true"}},
                                "idle": {"threshold": 0.05, "idleFor": "30m"}, **spec}
        if mode:
            body["mode"] = mode
        self.cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name}, "spec": body})

    def scale_status(self, policy: str) -> dict[str, Any]:
        doc: Any = self.cluster.admin.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, policy)
        return dict((doc.get("status") or {}).get(STATUS_KEY) or {})

    def decision(self, policy: str, workload: str) -> dict[str, Any] | None:
        for d in self.scale_status(policy).get("decisions", []):
            if d["workload"] == workload:
                return dict(d)
        return None


def build_scale_stack(cluster: Cluster, workdir: Path) -> ScaleStack:
    burst = build_stack(cluster, workdir)
    for i in range(4):
        name = f"gpu-scale-{i}"
        try:
            cluster.create_kwok_node(name, gpus=8)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    exporter = DcgmExporter().start()
    for i in range(4):
        exporter.add_node(f"gpu-scale-{i}", gpus=8)
    prometheus = Prometheus(workdir / "prometheus", targets=[exporter.address]).start()
    return ScaleStack(burst=burst, exporter=exporter, prometheus=prometheus)


async def wait_scale_phase(handle: Any, *phases: ScalePhase, timeout: float = 90.0) -> ScaleView:
    deadline = time.monotonic() + timeout
    last: ScaleView | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # not started yet, or the worker is restarting
            last = await handle.query("state", result_type=ScaleView, rpc_timeout=timedelta(seconds=10))
        if last is not None and last.phase in phases:
            return last
        await asyncio.sleep(0.3)
    raise AssertionError(f"scale operation never reached {[p.value for p in phases]}; last: "
                         f"{last.phase.value if last else None} {last.history if last else ''}")


async def ended_in(handle: Any, phase: ScalePhase, saying: str = "") -> dict[str, Any]:
    """A scale operation's result, once it has ended in ``phase`` with ``saying`` in its message."""
    done: dict[str, Any] = await handle.result()
    assert done["phase"] == phase.value, done
    assert saying in done["message"], done
    return done


__all__ = ["SCALE_LABEL", "ScaleStack", "build_scale_stack", "ended_in", "unique", "wait_scale_phase"]
