"""KubeOn against Karpenter, side by side (issue 26): one control plane, the same one-GPU pods, in one run.

    .venv/bin/python -m bench.versus_karpenter --pods 200 --shapes 1      # every pod needs a node of its own
    .venv/bin/python -m bench.versus_karpenter --pods 200 --shapes 1,4    # packing: 1- and 4-GPU L4 nodes offered

Starts a real control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok; one CPU node), a Temporal
dev server, the real Karpenter (``sigs.k8s.io/karpenter/kwok``, the build of ``tests/harness/karpenter.py``) and a
``kubeon-gpu worker`` process (the sim provider, its nodes joining through the worker's in-process gateway with
their own certificates), all idle before the first round. Both are offered the same shapes at the same prices:
``g6.xlarge`` (1 NVIDIA-L4, $0.90/h) and, with ``--shapes 1,4``, ``g6.12xlarge`` (4 NVIDIA-L4, $3.40/h), written to
an instance-types file for Karpenter and to a sim location for KubeOn. Then, one after the other on the same control
plane:

1. **Karpenter**: a NodePool of those shapes (WhenEmpty, consolidateAfter 0s, a taint only the round's pods
   tolerate); ``--pods`` one-GPU Deployments created at once; until all are bound. Then the Deployments and the
   pool are deleted.
2. **KubeOn**: an Automatic Burst policy over the sim location; the same Deployments (the same container, requests
   and nodeSelector; the burst toleration instead of the pool's); until all are bound; then until every node has
   gone home.

For each: all bound (from the first create), per-pod Unschedulable -> bound p50/p95, when nodes appeared (first /
last), last pod Unschedulable -> all bound, nodes and $/h launched against the exact optimum, the CPU seconds of
the product's processes (Karpenter; KubeOn's worker and the Temporal server) and of the whole machine (busy /
available = wall x CPUs) during the round; then the ratios. The machine's CPU is shared by the control plane, the
bench's own watches and both products; a round's "machine busy" says how loaded the machine was.

What is not alike, and counted where it can be: Karpenter's kwok provider creates a Node object and lets kwok play
the kubelet; KubeOn's sim node does the real join (ticket, CSR signed by the control plane, its own certificate,
the gateway lifting the joining taint) inside the worker process, so the worker's CPU includes the nodes' joins,
which on a real cloud run on the nodes themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.burst_bench import Profiler
from bench.burst_bench import node_cidr_mask
from bench.burst_bench import optimum
from bench.burst_bench import output_to
from bench.burst_bench import stop_worker
from bench.burst_bench import wait_worker_started
from bench.observe import ClusterObserver
from bench.observe import NodeSeen
from bench.observe import PodSeen
from bench.observe import children
from bench.observe import cpu_seconds
from bench.observe import machine_cpu
from bench.observe import percentile
from bench.observe import utc_now
from models.provisioning import Offering
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import build_stack
from tests.harness.burst import worker_process
from tests.harness.controlplane import ControlPlane
from tests.harness.karpenter import INSTANCE_TYPES_FILE
from tests.harness.karpenter import L4
from tests.harness.karpenter import Karpenter
from tests.harness.karpenter import gpu_nodepool
from tests.harness.karpenter import gpu_tolerations
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.temporal import start_dev_server
from tests.harness.workloads import SMALL_REQUESTS
from tests.harness.workloads import gpu_pods

BENCH_LABEL = "kubeon-bench/run"
LOCATION = "sim/eu-west"
# Both products are offered these shapes at these prices (the burst bench's sim prices: four 1-GPU nodes $3.60/h,
# one 4-GPU node $3.40/h, so packing pays). The instance type names are Karpenter's kwok ones.
SHAPES = {1: ("g6.xlarge", 0.90), 4: ("g6.12xlarge", 3.40)}


def log(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {text}", flush=True)


def karpenter_instance_types(shapes: list[int], out: Path) -> Path:
    """The harness's instance-types file cut to ``shapes``, on-demand only, at the bench's prices."""
    names = {SHAPES[g][0]: SHAPES[g][1] for g in shapes}
    kept = []
    for itype in json.loads(INSTANCE_TYPES_FILE.read_text()):
        if itype["name"] not in names:
            continue
        offerings = [o for o in itype["offerings"] if {"key": "karpenter.sh/capacity-type", "operator": "In",
                                                         "values": ["on-demand"]} in o["Requirements"]]
        for o in offerings:
            o["Price"] = names[itype["name"]]
        kept.append({**itype, "offerings": offerings})
    out.write_text(json.dumps(kept, indent=1))
    return out


def sim_location(shapes: list[int]) -> list[dict[str, Any]]:
    return [{"name": LOCATION, "sim": {"capacity": 1000, "bootSeconds": 0.0}, "offerings": [
        {"instanceType": SHAPES[g][0], "gpus": g, "gpuProduct": L4, "usdPerHour": SHAPES[g][1]} for g in shapes]}]


def bench_deployment(name: str, run: str, tolerations: list[client.V1Toleration]) -> client.V1Deployment:
    """One pod asking for one NVIDIA-L4 GPU; only the toleration differs between the products' rounds."""
    dep = gpu_pods(name, requests=SMALL_REQUESTS, node_selector={"nvidia.com/gpu.product": L4},
                   tolerations=tolerations)
    assert dep.spec is not None and dep.spec.template.metadata is not None
    dep.spec.template.metadata.labels = {**(dep.spec.template.metadata.labels or {}), BENCH_LABEL: run}
    return dep


@dataclass
class Round:
    """What one product did with ``pods`` Deployments; times in seconds from the first create."""

    product: str
    pods: int
    all_bound: float  # nan: not all bound by the deadline
    to_bound: list[float]  # per pod: Unschedulable -> bound
    nodes_first: float
    nodes_last: float
    last_unschedulable_to_all_bound: float
    nodes: dict[str, int]  # instance type -> count
    usd_per_hour: float
    spare: int  # nodes no pod was ever bound to
    cpu: dict[str, float]  # process -> CPU seconds during the round
    machine_busy: float
    machine_available: float

    @property
    def product_cpu(self) -> float:
        return sum(self.cpu.values())


def measure(product: str, pods: list[PodSeen], nodes: list[NodeSeen], t0: Any, all_bound: float,
            cpu: dict[str, float], machine: tuple[float, float]) -> Round:
    """A round's figures from what the watches saw (``t0``: the UTC time of the first create)."""
    def since(at: Any) -> float:
        return (at - t0).total_seconds() if at is not None else math.nan

    to_bound = [(p.scheduled_seen - p.unschedulable_seen).total_seconds() for p in pods
                if p.scheduled_seen and p.unschedulable_seen]
    bound_at = [since(p.scheduled_seen) for p in pods if p.scheduled_seen]
    unsched_at = [since(p.unschedulable_seen) for p in pods if p.unschedulable_seen]
    appeared = sorted(since(n.first_seen) for n in nodes)
    kinds: dict[str, int] = {}
    for n in nodes:
        kinds[n.instance_type] = kinds.get(n.instance_type, 0) + 1
    prices = {name: usd for name, usd in SHAPES.values()}
    used = {p.node_name for p in pods if p.node_name}
    return Round(product=product, pods=len(pods), all_bound=all_bound, to_bound=to_bound,
                 nodes_first=appeared[0] if appeared else math.nan, nodes_last=appeared[-1] if appeared else math.nan,
                 last_unschedulable_to_all_bound=(max(bound_at) - max(unsched_at)) if bound_at and unsched_at
                 else math.nan,
                 nodes=kinds, usd_per_hour=round(sum(prices.get(k, math.nan) * c for k, c in kinds.items()), 4),
                 spare=len([n for n in nodes if n.name not in used]), cpu=cpu,
                 machine_busy=machine[0], machine_available=machine[1])


@dataclass
class Bench:
    t0: float
    run: str
    cluster: Cluster
    pool: ThreadPoolExecutor
    pods: int
    deadline: float

    async def create_all(self, namespace: str, deployments: list[client.V1Deployment]) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.pool, self.cluster.admin.apps.create_namespaced_deployment,
                                                    namespace, d) for d in deployments))

    async def delete_all(self, namespace: str) -> None:
        loop = asyncio.get_running_loop()
        names = [f"p-{i}" for i in range(self.pods)]
        await asyncio.gather(*(loop.run_in_executor(self.pool, self.cluster.admin.apps.delete_namespaced_deployment,
                                                    n, namespace) for n in names))

    async def until(self, check: Callable[[], bool], what: str, alive: Callable[[], bool]) -> bool:
        deadline, next_line = time.monotonic() + self.deadline, 0.0
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"a product's process exited while waiting for {what}")
            if check():
                return True
            if time.monotonic() > next_line:
                next_line = time.monotonic() + 5
                log(self.t0, f"  waiting for {what}")
            await asyncio.sleep(0.05)
        log(self.t0, f"gave up waiting for {what} after {self.deadline:.0f}s")
        return False

    async def round(self, product: str, namespace: str, tolerations: list[client.V1Toleration],
                    node_selector: str, processes: dict[str, int], alive: Callable[[], bool]) -> Round:
        """Create the Deployments at once and wait until all are bound, watching pods and ``node_selector``'s
        nodes; CPU of ``processes`` (name -> pid) and of the machine over the round."""
        observer = ClusterObserver(Kube.from_kubeconfig(self.cluster.plane.admin_kubeconfig).api,
                                   pod_selector=f"{BENCH_LABEL}={self.run}-{product}",
                                   node_selector=node_selector).start()
        try:
            deployments = [bench_deployment(f"p-{i}", f"{self.run}-{product}", tolerations) for i in range(self.pods)]
            cpu0 = {name: cpu_seconds(pid) or 0.0 for name, pid in processes.items()}
            machine0, started, t = machine_cpu(), utc_now(), time.monotonic()
            await self.create_all(namespace, deployments)
            log(self.t0, f"{product}: {self.pods} Deployments created in {time.monotonic() - t:.1f}s")

            def bound() -> bool:
                return len([p for p in observer.pods_snapshot() if p.scheduled_seen and not p.deleted]) >= self.pods

            ok = await self.until(bound, f"{product}: all {self.pods} pods bound", alive)
            wall = time.monotonic() - t
            cpu = {name: (cpu_seconds(pid) or 0.0) - cpu0[name] for name, pid in processes.items()}
            machine1 = machine_cpu()
            pods = [p for p in observer.pods_snapshot() if p.namespace == namespace]
            nodes = [n for n in observer.nodes_snapshot().values() if n.deleted_seen is None]
            result = measure(product, pods, nodes, started, wall if ok else math.nan, cpu,
                             (machine1[0] - machine0[0], wall * (os.cpu_count() or 1)))
            log(self.t0, f"{product}: all bound {result.all_bound:.1f}s, {sum(result.nodes.values())} nodes")
            return result
        finally:
            observer.stop()


def report(shapes: list[int], pods: int, rounds: list[Round]) -> list[str]:
    offerings = [Offering(location=LOCATION, instance_type=SHAPES[g][0], gpus=g, gpu_product=L4,
                          instance_usd_per_hour=SHAPES[g][1], transfer_usd_per_gpu_hour=0.0) for g in shapes]
    opt_nodes, opt_usd = optimum(offerings, pods)
    k, b = rounds

    def p(values: list[float], q: int) -> float:
        return percentile(values, q) if values else math.nan

    def ratio(ours: float, theirs: float) -> str:
        return f"{ours / theirs:.2f}x" if theirs and not math.isnan(ours) and not math.isnan(theirs) else "n/a"

    def nodes(r: Round) -> str:
        return ", ".join(f"{c} x {t}" for t, c in sorted(r.nodes.items())) or "none"

    rows = [
        ("all bound (s)", b.all_bound, k.all_bound),
        ("per pod Unschedulable -> bound p50 (s)", p(b.to_bound, 50), p(k.to_bound, 50)),
        ("per pod Unschedulable -> bound p95 (s)", p(b.to_bound, 95), p(k.to_bound, 95)),
        ("nodes appear, first (s)", b.nodes_first, k.nodes_first),
        ("nodes appear, last (s)", b.nodes_last, k.nodes_last),
        ("last pod Unschedulable -> all bound (s)", b.last_unschedulable_to_all_bound,
         k.last_unschedulable_to_all_bound),
        ("$/h launched", b.usd_per_hour, k.usd_per_hour),
        ("product CPU seconds", b.product_cpu, k.product_cpu),
    ]
    lines = [f"{pods} one-GPU Deployments at once; shapes offered: "
             + ", ".join(f"{SHAPES[g][0]} ({g} GPU, ${SHAPES[g][1]:.2f}/h)" for g in shapes)
             + f"; optimum {opt_nodes} nodes, ${opt_usd:.2f}/h",
             f"{'':42} {'KubeOn':>10} {'Karpenter':>10} {'ratio':>7}"]
    lines += [f"{name:42} {ours:10.2f} {theirs:10.2f} {ratio(ours, theirs):>7}" for name, ours, theirs in rows]
    for r in (b, k):
        lines.append(f"{r.product}: {r.pods} pods, nodes {nodes(r)} ({r.spare} spare), "
                     f"+{100 * (r.usd_per_hour / opt_usd - 1):.1f} % over the optimum; per-pod samples "
                     f"{len(r.to_bound)}; CPU " + ", ".join(f"{n} {s:.1f} s" for n, s in r.cpu.items())
                     + f"; machine busy {r.machine_busy:.0f} of {r.machine_available:.0f} CPU-s")
    return lines


async def main_async(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    shapes = sorted({int(s) for s in args.shapes.split(",")})
    if not set(shapes) <= set(SHAPES):
        raise SystemExit(f"--shapes: each of {sorted(SHAPES)}, got {args.shapes}")
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-versus-"))
    run = uuid.uuid4().hex[:6]
    log(t0, f"work directory {workdir}")
    async with contextlib.AsyncExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, workdir, True)
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench")
        stack.callback(pool.shutdown, wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()
        plane = ControlPlane(workdir / "controlplane")
        stack.callback(plane.stop)
        await loop.run_in_executor(pool, plane.start)
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        cluster.create_kwok_node("home-cpu", gpus=0)
        log(t0, f"control plane up in {plane.started_seconds:.1f}s")

        karpenter = Karpenter(plane=plane, workdir=workdir / "karpenter", admin=cluster.admin,
                              instance_types_file=karpenter_instance_types(shapes, workdir / "instance-types.json"))
        stack.callback(karpenter.stop)
        await loop.run_in_executor(pool, karpenter.start)
        log(t0, f"karpenter ready in {karpenter.started_seconds:.1f}s")

        with output_to(workdir / "temporal.log"):
            env = await start_dev_server()
        stack.push_async_callback(env.shutdown)
        temporal_pid = next((pid for pid, name in children().items() if name.startswith("temporal")), None)
        burst = await loop.run_in_executor(pool, build_stack, cluster, workdir / "burst")
        settings = burst.settings(temporal_address=env.client.service_client.config.target_host,
                                  task_queue=f"versus-{run}", locations=sim_location(shapes),
                                  cluster_name=f"versus-{run}", serve_check_seconds=1)
        worker_log = workdir / "worker.log"
        worker = worker_process(settings, worker_log, {"KUBEON_GATEWAY_NODE_CIDR_MASK": str(node_cidr_mask(args.pods))},
                                stack=burst)
        stack.callback(stop_worker, worker)
        await wait_worker_started(worker, worker_log)
        log(t0, "worker started")

        b = Bench(t0=t0, run=run, cluster=cluster, pool=pool, pods=args.pods, deadline=args.deadline)
        rounds: list[Round] = []
        profile: list[str] = []
        try:
            # Karpenter first: its NodePool is gone before KubeOn's round, so nothing of it is left to serve or
            # watch KubeOn's pods (the worker's capacity provider is "none": it bursts every pod its policy takes).
            nodepool = f"versus-{run}"
            karpenter.create_nodepool(gpu_nodepool(nodepool, taint=nodepool, gpu_counts=tuple(shapes),
                                                   consolidation="WhenEmpty", consolidate_after="0s",
                                                   budgets=[{"nodes": "100%"}]))
            ns = cluster.create_namespace("versus-karpenter")
            rounds.append(await b.round("Karpenter", ns, gpu_tolerations(nodepool), f"karpenter.sh/nodepool={nodepool}",
                                        {"karpenter": karpenter.pid}, karpenter.running))
            await b.delete_all(ns)
            await loop.run_in_executor(pool, karpenter.force_delete_nodepool, nodepool)
            log(t0, "Karpenter's round removed")

            cluster.admin.custom.create_cluster_custom_object("gpu.kubeon.io", "v1", "gpupolicies", {
                "apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": f"versus-{run}"},
                "spec": {"kind": "Burst", "mode": "Automatic", "workloads": {"tolerate": BURST_TAINT_KEY},
                         "locations": [LOCATION], "limits": {"maxNodes": 1000, "maxGpuHour": 100},
                         "returnHome": True}})
            ns = cluster.create_namespace("versus-kubeon")
            processes = {"worker": worker.pid} | ({"temporal": temporal_pid} if temporal_pid else {})
            burst_toleration = [client.V1Toleration(key=BURST_TAINT_KEY, operator="Exists", effect="NoSchedule")]
            profiler = Profiler.start(worker.pid, args.profile) if args.profile else None
            rounds.append(await b.round("KubeOn", ns, burst_toleration, "gpu.kubeon.io/operation", processes,
                                        lambda: worker.poll() is None))
            profile = profiler.stop(top=25) if profiler else []
            await b.delete_all(ns)
            home = ClusterObserver(cluster.admin.api, pod_selector=f"{BENCH_LABEL}=none",
                                   node_selector="gpu.kubeon.io/operation").start()
            stack.callback(home.stop)
            await b.until(lambda: not home.nodes_snapshot() or all(n.deleted_seen for n in
                                                                    home.nodes_snapshot().values()),
                          "KubeOn's nodes home", lambda: worker.poll() is None)
        finally:
            if len(rounds) == 2:
                print("=" * 100)
                print(f"KubeOn against Karpenter, same control plane and pods, {os.cpu_count()} CPU(s), "
                      f"load average {os.getloadavg()[0]:.1f} at the end")
                print("\n".join(report(shapes, args.pods, rounds) + profile))
                print("=" * 100, flush=True)
    for pid in children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0 if all(not math.isnan(r.all_bound) for r in rounds) and len(rounds) == 2 else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.versus_karpenter", description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=200, help="one-GPU Deployments created at once, in each round")
    p.add_argument("--shapes", default="1", help="GPUs per node offered to both: 1, or 1,4")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds any one wait may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--profile", type=Path, default=None,
                   help="sample the worker with py-spy during KubeOn's round into this file (the bench extra)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return asyncio.run(main_async(parse_args(argv)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
