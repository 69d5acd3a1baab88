"""Packing against Karpenter's own consolidation (issue 23's figures), side by side on the real Karpenter (kwok
provider) and the real control plane, over the same fragmented workload.

Two GPU NodePools of 4-GPU L4 nodes (g6.12xlarge, $4.6016/h), each fragmented the same way: a wave of N 4-GPU pods
makes Karpenter launch N nodes, the wave is deleted, then 2N 1-GPU pods of one Deployment (a PDB maxUnavailable 1
over them) are spread over the N empty nodes by the default scheduler (2 per node; the optimum holds them on N/2).
Both pools are made with consolidation off (WhenEmpty, consolidateAfter Never) and a 10 % disruption budget, as
users run GPU pools. Then, at the same moment:
- pool **kubeon**: a Packing policy in Automatic (maxNodesAtOnce N, the pods' namespace) served by a real
  `kubeon-gpu worker` process (capacity.provider karpenter): its watcher plans and starts one round;
- pool **karpenter**: its disruption set to WhenEmptyOrUnderutilized, consolidateAfter 0s (Karpenter alone).
When the round ends (or ``--deadline``), both pools are read: nodes and $/h, pods evicted (serve pods that were
there at the start and are gone), and for the round its time per node removed, the NodeClaims Karpenter launched
in its pool meanwhile, and the worker's CPU seconds and peak RSS. ``--after`` seconds more of Karpenter alone then
show where its consolidation settles.

    .venv/bin/python -m bench.packing_bench                 # --nodes 50 --deadline 1500 --after 120
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from kubernetes import client
from temporalio.service import RPCError

from activities.capacity.karpenter import CATALOG_PRICES
from bench.burst_bench import output_to
from bench.observe import ProcessSampler
from bench.observe import cpu_seconds
from models.labels import LABEL_INSTANCE_TYPE
from models.packing import PackView
from models.packing import packing_workflow_id
from models.policy import API_GROUP
from models.policy import PLURAL
from tests.harness.burst import WorkerProcesses
from tests.harness.burst import build_stack
from tests.harness.controlplane import ControlPlane
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_workload
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.temporal import start_dev_server
from workflows.pack import PackWorkflow

NODE_GPUS = 4


def log(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {text}", flush=True)


@dataclass
class Pool:
    """One fragmented NodePool and its workload: ``name`` (also its taint), the namespace of its pods."""

    name: str
    namespace: str
    serve_uids: set[str] = field(default_factory=set)  # every serve pod seen (observe() adds replacements)
    claims_before: set[str] = field(default_factory=set)

    def nodes(self, karpenter: Karpenter) -> list[Any]:
        found: list[Any] = karpenter.nodes(self.name)
        return [n for n in found if n.metadata.deletion_timestamp is None]

    def usd_per_hour(self, karpenter: Karpenter) -> float:
        return round(sum(CATALOG_PRICES.get((n.metadata.labels or {}).get(LABEL_INSTANCE_TYPE, ""), 0.0)
                         for n in self.nodes(karpenter)), 4)

    def serve_pods(self, cluster: Cluster) -> list[Any]:
        found: list[Any] = cluster.admin.core.list_namespaced_pod(self.namespace, label_selector="app=serve").items
        return [p for p in found if p.metadata.deletion_timestamp is None]

    def observe(self, cluster: Cluster) -> set[str]:
        """The serve pods now; each is remembered (a replacement evicted again counts again)."""
        now = {str(p.metadata.uid) for p in self.serve_pods(cluster)}
        self.serve_uids |= now
        return now

    def evicted(self, cluster: Cluster) -> int:
        """Serve pods seen that are gone (evicted by us or by Karpenter's consolidation; a pod is seen every 2 s,
        and a replacement lives longer than that before it can be evicted: it must be Ready first)."""
        return len(self.serve_uids - self.observe(cluster))


def running(cluster: Cluster, namespace: str, app: str, count: int, timeout: float) -> list[Any]:
    def check() -> list[Any] | None:
        found: list[Any] = cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
        pods = [p for p in found if p.metadata.deletion_timestamp is None]
        return pods if len(pods) == count and all(p.status.phase == "Running" for p in pods) else None

    return list(wait_for(check, timeout=timeout, interval=1.0, what=f"{count} {app} pods running in {namespace}"))


def fragment(cluster: Cluster, karpenter: Karpenter, nodes: int, label: str, t0: float) -> Pool:
    """A pool of ``nodes`` 4-GPU nodes holding 2 x ``nodes`` 1-GPU pods spread by the default scheduler."""
    taint = f"{label}-{uuid.uuid4().hex[:4]}"
    pool = Pool(name=f"gpu-{taint}", namespace=cluster.create_namespace())
    karpenter.create_nodepool(gpu_nodepool(pool.name, taint=taint, gpu_limit=NODE_GPUS * nodes,
                                           gpu_counts=(NODE_GPUS,), budgets=[{"nodes": "10%"}]))
    apps = cluster.admin.apps
    apps.create_namespaced_deployment(pool.namespace, gpu_workload("wave", taint=taint, replicas=nodes,
                                                                   gpus=NODE_GPUS))
    running(cluster, pool.namespace, "wave", nodes, timeout=60 + 6 * nodes)
    apps.delete_namespaced_deployment("wave", pool.namespace)
    wait_for(lambda: not cluster.admin.core.list_namespaced_pod(pool.namespace, label_selector="app=wave").items,
             timeout=120, what="the wave gone")
    apps.create_namespaced_deployment(pool.namespace, gpu_workload("serve", taint=taint, replicas=2 * nodes))
    pods = running(cluster, pool.namespace, "serve", 2 * nodes, timeout=60 + 3 * nodes)
    cluster.admin.policy.create_namespaced_pod_disruption_budget(pool.namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="serve"),
        spec=client.V1PodDisruptionBudgetSpec(max_unavailable=1,
                                              selector=client.V1LabelSelector(match_labels={"app": "serve"}))))
    pool.serve_uids = {str(p.metadata.uid) for p in pods}
    pool.claims_before = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool.name)}
    spread = sorted({str(p.spec.node_name) for p in pods})
    log(t0, f"pool {pool.name}: {len(pool.nodes(karpenter))} nodes, {len(pods)} serve pods on {len(spread)} of them")
    return pool


def snapshot(cluster: Cluster, karpenter: Karpenter, pool: Pool) -> dict[str, Any]:
    return {"nodes": len(pool.nodes(karpenter)), "usd": pool.usd_per_hour(karpenter),
            "evicted": pool.evicted(cluster),
            "launched": len({c["metadata"]["name"] for c in karpenter.nodeclaims(pool.name)} - pool.claims_before),
            "pending": sum(1 for p in pool.serve_pods(cluster) if p.status.phase == "Pending")}


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.packing_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=50, help="4-GPU nodes in each pool (2 x this many 1-GPU pods)")
    p.add_argument("--deadline", type=float, default=1500, help="longest the round may take (s)")
    p.add_argument("--after", type=float, default=120, help="Karpenter alone watched this much longer (s)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    if not 2 <= args.nodes <= 50:
        p.error("--nodes must be within 2..50 (a Packing policy's maxNodesAtOnce is at most 50)")
    return args


async def main_async(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-packbench-"))
    async with contextlib.AsyncExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, workdir, True)
        plane = ControlPlane(workdir / "controlplane")
        stack.callback(plane.stop)
        plane.start()
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        karpenter = Karpenter(plane, workdir / "karpenter", cluster.admin)
        stack.callback(karpenter.stop)
        karpenter.start()
        with output_to(workdir / "temporal.log"):
            env = await start_dev_server()
        stack.push_async_callback(env.shutdown)
        log(t0, f"control plane, Karpenter and Temporal up; {os.cpu_count()} CPU(s)")
        burst = build_stack(cluster, workdir / "stack")

        ours = fragment(cluster, karpenter, args.nodes, "kubeon", t0)
        theirs = fragment(cluster, karpenter, args.nodes, "karpenter", t0)
        before = {"kubeon": snapshot(cluster, karpenter, ours), "karpenter": snapshot(cluster, karpenter, theirs)}

        queue = f"packbench-{uuid.uuid4().hex[:6]}"
        settings = burst.settings(temporal_address=env.client.service_client.config.target_host, task_queue=queue,
                                  locations=[], cluster_name=queue, burst_enabled=False, capacity_provider="karpenter",
                                  scale_resync_seconds=5)
        workers = WorkerProcesses(settings, workdir / "worker.log")
        stack.callback(workers.stop_all)
        proc = workers.start(wait=True)
        sampler = ProcessSampler(proc.pid).start()
        stack.callback(sampler.stop)
        cpu_before = cpu_seconds(proc.pid) or 0.0

        # Go: the Packing policy for ours, Karpenter's consolidation for theirs, at the same moment.
        policy = f"pack-{uuid.uuid4().hex[:6]}"
        started = time.monotonic()
        cluster.admin.custom.patch_cluster_custom_object(
            "karpenter.sh", "v1", "nodepools", theirs.name,
            {"spec": {"disruption": {"consolidationPolicy": "WhenEmptyOrUnderutilized", "consolidateAfter": "0s"}}})
        cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, {
            "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": policy},
            "spec": {"kind": "Packing", "mode": "Automatic", "nodePools": [ours.name],
                     "maxNodesAtOnce": args.nodes, "pods": {"namespaces": [ours.namespace]}, "interval": "1h"}})
        handle = env.client.get_workflow_handle(packing_workflow_id(queue, policy))

        async def query() -> PackView | None:
            try:
                return await handle.query(PackWorkflow.state)
            except RPCError:  # not started yet
                return None

        view = await wait_round(query, started + args.deadline, lambda line: log(t0, line),
                                lambda: [pool.observe(cluster) for pool in (ours, theirs)])
        elapsed = time.monotonic() - started
        cpu = (cpu_seconds(proc.pid) or 0.0) - cpu_before
        sampler.sample()
        at_end = {"kubeon": snapshot(cluster, karpenter, ours), "karpenter": snapshot(cluster, karpenter, theirs)}
        log(t0, f"round {view.phase if view else 'not done'} after {elapsed:.0f}s; Karpenter alone "
                f"{args.after:.0f}s more")
        deadline = time.monotonic() + args.after
        while time.monotonic() < deadline:
            theirs.observe(cluster)
            await asyncio.sleep(2)
        later = snapshot(cluster, karpenter, theirs)

        removed = len(view.removed) if view else 0
        optimum = args.nodes // 2
        price = CATALOG_PRICES["g6.12xlarge"]
        print("=" * 100)
        print(f"KubeOn packing vs Karpenter consolidation: {args.nodes} x 4-GPU L4 nodes per pool, "
              f"{2 * args.nodes} 1-GPU pods each (optimum {optimum} nodes, ${optimum * price:.2f}/h); "
              f"{os.cpu_count()} CPU(s)")
        rows = [("", "nodes before", "$/h before", f"nodes at {elapsed:.0f}s", f"$/h at {elapsed:.0f}s",
                 "pods evicted", "evicted per node removed", "NodeClaims launched", "pods Pending"),
                row("kubeon round", before["kubeon"], at_end["kubeon"]),
                row(f"Karpenter alone, {elapsed:.0f}s", before["karpenter"], at_end["karpenter"]),
                row(f"Karpenter alone, {elapsed + args.after:.0f}s", before["karpenter"], later)]
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
        print(f"round: phase {view.phase if view else 'not done'}, {removed} node(s) removed, "
              f"{len(view.moved) if view else 0} pod(s) moved, "
              f"{elapsed / removed if removed else float('nan'):.1f} s per node removed (policy created -> Done, "
              f"the watcher's first resync included); worker CPU {cpu:.1f} s "
              f"({cpu / removed if removed else float('nan'):.2f} s per node), peak RSS "
              f"{sampler.mib(sampler.peak_rss_kib):.0f} MiB")
        print("=" * 100, flush=True)
    return 0


def row(name: str, before: dict[str, Any], after: dict[str, Any]) -> tuple[str, ...]:
    removed = before["nodes"] - after["nodes"]
    per = f"{after['evicted'] / removed:.2f}" if removed > 0 else "-"
    return (name, str(before["nodes"]), f"{before['usd']:.2f}", str(after["nodes"]), f"{after['usd']:.2f}",
            str(after["evicted"]), per, str(after["launched"]), str(after["pending"]))


async def wait_round(handle: Callable[[], Awaitable[PackView | None]], deadline: float,
                     say: Callable[[str], None], observe: Callable[[], object]) -> PackView | None:
    """The round's view once it ends (Done, Stopped, ...), or the last one seen at ``deadline``; ``observe`` is
    called every 2 s meanwhile."""
    last: PackView | None = None
    shown = ""
    while time.monotonic() < deadline:
        observe()
        view = await handle()
        if view is not None:
            last = view
            line = f"round {view.phase}: {len(view.removed)} removed, {len(view.moved)} moved"
            if line != shown:
                say(line)
                shown = line
            if view.phase not in ("Planning", "AwaitingApproval", "Packing"):
                return view
        await asyncio.sleep(2)
    return last


if __name__ == "__main__":
    raise SystemExit(main())
