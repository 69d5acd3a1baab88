"""A Sharing rollout under a disruption budget: one Automatic MIG policy over N quiet A100-80GB nodes (2 GPUs, two
1-GPU pods at 5 % and 9 GiB peak each) with ``spec.maxNodesAtOnce`` B, on the real parts: the local control plane
(kwok nodes and pods), the Temporal dev server, the worker in-process (its Sharing watcher, resync 1 s), a real
Prometheus with backfilled DCGM history, the GPU Operator stand-in (MIG manager: 0.3 s pending -> success).

Every 0.25 s the bench asks each node's operation its phase (the ``state`` query) and the apiserver which nodes
are cordoned. Printed: the time from the first node seen changing to the last seen Shared, the most operations
seen in a changing phase at once and the most nodes seen cordoned at once (both must be <= B), and each node's
apply time (first seen changing -> seen Shared; 0.25 s resolution).

    .venv/bin/python -m bench.sharing_rollout              # --nodes 20 --budget 2
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from bench.options import parse_options
from models.policy import API_GROUP
from models.policy import PLURAL
from models.sharing import SharingPhase
from models.sharing import SharingView
from models.sharing import sharing_workflow_id
from tests.harness.burst import build_stack
from tests.harness.controlplane import ControlPlane
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.gpu_operator import GpuOperator
from tests.harness.gpu_operator import gpu_operator_namespace
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.prometheus import SCRAPE_JOB
from tests.harness.prometheus import Prometheus
from tests.harness.temporal import start_dev_server
from tests.harness.workloads import gpu_pod
from worker.main import worker_services
from worker.sharing_watcher import changing

PRODUCT = "NVIDIA-A100-SXM4-80GB"
POLL = 0.25


async def phases(temporal: Client, cluster: str, nodes: list[str]) -> dict[str, SharingView | None]:
    async def one(node: str) -> SharingView | None:
        try:
            return await temporal.get_workflow_handle(sharing_workflow_id(cluster, node)).query(
                "state", result_type=SharingView, rpc_timeout=timedelta(seconds=10))
        except RPCError:
            return None
    return dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes)), strict=True))


async def rollout(n_nodes: int, budget: int, workdir: Path) -> dict[str, Any]:
    plane = ControlPlane(workdir / "controlplane")
    plane.start()
    env = await start_dev_server()
    operator = exporter = prometheus = None
    try:
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        stack = build_stack(cluster, workdir / "stack")
        ns = cluster.create_namespace("bench")
        operator_ns = gpu_operator_namespace(cluster)
        nodes = [f"a100-roll-{i:02d}" for i in range(n_nodes)]
        exporter = DcgmExporter().start()
        for node in nodes:
            cluster.create_kwok_node(node, labels={**GpuOperator.gfd_labels(PRODUCT, 2), "pool": "roll", "pin": node},
                                     gpus=2)
            exporter.add_node(node, gpus=2)
        operator = GpuOperator(cluster.admin.api, namespace=operator_ns).start()
        pods = [f"{node}-{k}" for node in nodes for k in range(2)]
        for pod in pods:
            cluster.admin.core.create_namespaced_pod(ns, gpu_pod(pod, labels={"app": "rollout"},
                                                                  node_selector={"pin": pod.rsplit("-", 1)[0]}))

        def all_running() -> bool:
            found: list[Any] = cluster.admin.core.list_namespaced_pod(ns).items
            return sum(1 for p in found if p.status.phase == "Running") == len(pods)
        wait_for(all_running, what="every pod running", timeout=120)
        for pod in pods:
            exporter.assign(ns, pod, activity=0.05, fb_used_mib=9 * 1024)
        prometheus = Prometheus(workdir / "prometheus", targets=[exporter.address])
        now = time.time()
        held = [g for g in exporter.snapshot() if g.pod]
        prometheus.backfill(openmetrics_history([(now - ago, held) for ago in range(70 * 60, 15, -30)],
                                                extra={"job": SCRAPE_JOB, "instance": exporter.address}))
        prometheus.start()
        prometheus.wait_scraped()
        settings = stack.settings(
            temporal_address=env.client.service_client.config.target_host, task_queue="rollout", locations=[],
            cluster_name="rollout", burst_enabled=False, prometheus_url=prometheus.url, scale_resync_seconds=1,
            gpu_operator_namespace=operator_ns, sharing_propagation_seconds=2, sharing_verify_timeout_seconds=30)
        first: dict[str, float] = {}
        shared: dict[str, float] = {}
        most_ops = most_cordoned = 0
        async with worker_services(settings, stack.runtime(settings)) as (temporal, _runtime, _watcher):
            cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
                "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "rollout"},
                "spec": {"kind": "Sharing", "mode": "Automatic", "nodes": {"matchLabels": {"pool": "roll"}},
                         "mig": {"allowed": ["all-1g.10gb"]}, "idle": {"threshold": 0.4, "window": "1h"},
                         "usdPerGpuHour": 4.1, "maxNodesAtOnce": budget}})
            deadline = time.monotonic() + 60 + 30 * n_nodes
            while len(shared) < n_nodes:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout not done: {len(shared)} of {n_nodes} shared")
                t = time.monotonic()
                seen = await phases(temporal, settings.cluster, nodes)
                listed: list[Any] = cluster.admin.core.list_node(label_selector="pool=roll").items
                most_cordoned = max(most_cordoned, sum(1 for n in listed if n.spec.unschedulable))
                now_changing = 0
                for node, view in seen.items():
                    if view is None:
                        continue
                    if view.phase == SharingPhase.FAILED:
                        raise RuntimeError(f"{node} failed: {view.message}")
                    if view.phase == SharingPhase.SHARED:
                        shared.setdefault(node, t)
                        first.setdefault(node, t)
                    elif changing(view):
                        now_changing += 1
                        first.setdefault(node, t)
                most_ops = max(most_ops, now_changing)
                await asyncio.sleep(max(0.0, POLL - (time.monotonic() - t)))
        applied = [shared[n] - first[n] for n in nodes]
        return {"nodes": n_nodes, "budget": budget, "total": max(shared.values()) - min(first.values()),
                "most_ops": most_ops, "most_cordoned": most_cordoned, "applied": applied}
    finally:
        for part in (operator, prometheus, exporter):
            if part is not None:
                part.stop()
        await env.shutdown()
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_options("sharing_rollout", __doc__, argv, nodes=20, budget=2)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        r = asyncio.run(rollout(args.nodes, args.budget, Path(tmp)))
    applied = sorted(r["applied"])
    print(f"sharing rollout: {r['nodes']} nodes, MIG all-1g.10gb, Automatic, maxNodesAtOnce {r['budget']}")
    print(f"  first node changing -> all {r['nodes']} shared: {r['total']:.1f} s")
    print(f"  most operations changing at once: {r['most_ops']}; most nodes cordoned at once: {r['most_cordoned']} "
          f"(budget {r['budget']})")
    print(f"  per node apply (first seen changing -> Shared): median {statistics.median(applied):.1f} s, "
          f"min {applied[0]:.1f} s, max {applied[-1]:.1f} s")
    if max(r["most_ops"], r["most_cordoned"]) > r["budget"]:
        print("  BUDGET EXCEEDED")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
