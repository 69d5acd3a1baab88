"""On-prem pool benchmark: claim -> Node Ready and release -> server idle, over N rounds.

    .venv/bin/python -m bench.onprem_bench [--rounds 10]

Starts a real control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok), a Temporal dev server,
the hub as its own process (SQLite) with the pool onprem/dc1, one server agent as its own process
(`kubeon-gpu onprem-agent --simulated`, heartbeat 0.5 s), the gateway's HTTP app on loopback and the worker
in-process, all in a temporary directory. Each round: a one-GPU Deployment under an Automatic policy naming only
onprem/dc1; the operation claims the server, the agent joins; then the Deployment is deleted, the node drains
and the server is released. Figures:

* claim -> Node Ready: the hub's `pool.server_claimed` audit time to the bench seeing the Node Ready (polled
  every 50 ms; both clocks are this machine's);
* release -> idle: the hub's `pool.server_release_requested` to `pool.server_released` (the hub's clock).

Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from bench.observe import percentile
from models.policy import API_GROUP
from models.policy import PLURAL
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import BurstStack
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import unique
from tests.harness.controlplane import ControlPlane
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.onprem import AgentProcess
from tests.harness.onprem import GatewayThread
from tests.harness.onprem import claim_keys
from tests.harness.onprem import register_server
from tests.harness.onprem import write_gateways
from tests.harness.temporal import start_dev_server
from tests.hub.process import HubProcess
from worker.main import worker_services

ADMIN_KEY = "bench-admin-key-0123456789abcdef0123"


def _ready(cluster: Cluster, policy: str) -> str | None:
    for node in cluster.admin.core.list_node(label_selector=f"gpu.kubeon.io/policy={policy}").items:
        for cond in (node.status.conditions or []) if node.status else []:
            if cond.type == "Ready" and cond.status == "True":
                return str(node.metadata.name) if node.metadata else ""
    return None


def _events(admin: httpx.Client, action: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = admin.get("/v1/audit", params={"limit": 1000}).json()["events"]
    return [e for e in events if e["action"] == action]


POLICY = "onprem-bench"


def _prepare(workdir: Path, burst: BurstStack) -> tuple[HubProcess, httpx.Client, GatewayThread, AgentProcess]:
    """The hub with the cluster, its policy and the pool; the gateway; one server agent."""
    key_file = workdir / "admin.key"
    key_file.write_text(ADMIN_KEY)
    hub = HubProcess(["--database-url", f"sqlite:///{workdir / 'hub.db'}", "--bootstrap-admin-key-file",
                      str(key_file)], logdir=workdir).start()
    admin = httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    token = admin.post("/v1/clusters", json={"name": "bench"}).json()["token"]["token"]
    (workdir / "cluster.token").write_text(token)
    pool = admin.post("/v1/pools", json={"name": "dc1", "offline_after_seconds": 10,
                                         "rate_card": {"usd_per_gpu_hour": {"NVIDIA-L4": 0.4}}}).json()
    join = pool["join_token"]["token"]
    (workdir / "join.token").write_text(join)
    doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": POLICY},
           "spec": {"kind": "Burst", "mode": "Automatic", "workloads": {"tolerate": BURST_TAINT_KEY},
                    "locations": ["onprem/dc1"], "limits": {"maxNodes": 1, "maxGpuHour": 4.5}}}
    admin.put(f"/v1/clusters/bench/policies/{POLICY}", json=doc).raise_for_status()
    gateway = GatewayThread(burst.gateway_kubeconfig, burst.ticket_key_file.read_bytes().strip(),
                            workdir / "hub-claim-keys.pem")
    gateway.mount_claim_keys(claim_keys(hub.url))
    gateway.start()
    register_server(hub.url, ADMIN_KEY, "dc1", "gpu-a")
    gateways = write_gateways(workdir / "gateways.yaml", {"bench": gateway.url})
    agent = AgentProcess(hub_url=hub.url, join_token_file=workdir / "join.token", pool="dc1", server="gpu-a",
                         state_dir=workdir / "agent", gateways_file=gateways).start()
    return hub, admin, gateway, agent


def _round(cluster: Cluster, admin: httpx.Client, i: int) -> tuple[float, float]:
    """One claim, join, drain and release; (claim -> Node Ready, release -> idle) in seconds."""
    deploy = unique("infer")
    cluster.admin.apps.create_namespaced_deployment("bench", gpu_deployment(deploy))
    node = wait_for(lambda: _ready(cluster, POLICY), what="node Ready", timeout=120, interval=0.05)
    seen = time.time()
    claimed = _events(admin, "pool.server_claimed")[-1]
    ready = seen - datetime.fromisoformat(claimed["at"]).timestamp()
    cluster.admin.apps.delete_namespaced_deployment(deploy, "bench")
    wait_for(lambda: len(_events(admin, "pool.server_released")) > i or None, what="server released",
             timeout=180, interval=0.1)
    requested = _events(admin, "pool.server_release_requested")[-1]
    done = _events(admin, "pool.server_released")[-1]
    idle = datetime.fromisoformat(done["at"]).timestamp() - datetime.fromisoformat(requested["at"]).timestamp()
    wait_for(lambda: _ready(cluster, POLICY) is None or None, what=f"node {node} gone", timeout=60)
    return ready, idle


async def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-onprem-bench-"))
    claim_ready: list[float] = []
    release_idle: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        plane = ControlPlane(workdir / "controlplane")
        stack.callback(plane.stop)
        await asyncio.to_thread(plane.start)
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        env = await start_dev_server()
        stack.push_async_callback(env.shutdown)
        burst = build_stack(cluster, workdir / "stack")

        hub, admin, gateway, agent = await asyncio.to_thread(_prepare, workdir, burst)
        for closer in (hub.stop, admin.close, gateway.stop, agent.stop):
            stack.callback(closer)
        settings = burst.settings(
            temporal_address=env.client.service_client.config.target_host, task_queue="bench",
            locations=[{"name": "onprem/dc1"}],
            cluster_name="bench", hub_url=hub.url, hub_token_file=workdir / "cluster.token",
            hub_poll_interval=1.0, gateway_url=gateway.url)
        async with worker_services(settings, burst.runtime(settings)):
            await asyncio.to_thread(wait_for, lambda: cluster.admin.custom.get_cluster_custom_object(
                API_GROUP, "v1", PLURAL, POLICY), what="policy synced", timeout=60)
            cluster.admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="bench")))
            for i in range(args.rounds):
                ready, idle = await asyncio.to_thread(_round, cluster, admin, i)
                claim_ready.append(ready)
                release_idle.append(idle)
                print(f"round {i + 1}: claim->Ready {ready:.2f}s, release->idle {idle:.2f}s", flush=True)

    print(f"\non-prem pool, {args.rounds} rounds (agent heartbeat 0.5 s)")
    print(f"{'figure':<22}{'p50':>8}{'p95':>8}{'max':>8}")
    for name, values in (("claim -> Node Ready", claim_ready), ("release -> idle", release_idle)):
        print(f"{name:<22}{percentile(values, 50):>7.2f}s{percentile(values, 95):>7.2f}s{max(values):>7.2f}s")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.onprem_bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be between 1 and 100")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
