"""Launch latency and API calls per launch / terminate of the gcp and azure providers against their local
servers, with the node joining the local control plane through the gateway from the instance's user data.

For each provider, ``--samples`` times: a join ticket and user data as the launch activity makes them, then
``provider.launch`` (timed to its return, the instance running), the booter joins the node with the ticket in the
instance's user data (as the machine would), ``KubeOps.wait_node_ready`` (timed from the launch start to Node
Ready), then ``provider.terminate``. The servers record every request, so the calls of each step are counted
and named. The servers finish an operation after ``--operation-seconds`` (0.5 s): the latency is the providers'
polling overhead on top of that, not a cloud's boot time.

    .venv/bin/python -m bench.cloud_bench --samples 10
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from activities.clients.kube import KubeOps
from bench.options import parse_options
from common.kube import kube_api
from gateway.service import KubeGateway
from models.join import JoinTicketRequest
from models.join import render_user_data
from models.labels import Taint
from models.locations import BurstConfig
from models.node import LaunchRequest
from tests.harness.burst import build_stack
from tests.harness.clouds import local
from tests.harness.clouds.boot import Booter
from tests.harness.clouds.boot import gateway_join
from tests.harness.clouds.fake import FakeServer
from tests.harness.controlplane import ControlPlane
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import Kube


def _kind(request: dict[str, Any]) -> str:
    """A short name for what a recorded request is for."""
    path, method = request["path"], request["method"]
    if path == "/msi/token":
        return "token (managed identity)"
    path = re.sub(r"/subscriptions/[^/]+|/projects/[^/]+|/resourceGroups/[^/]+|/zones/[^/]+|/locations/[^/]+", "",
                  path)
    path = re.sub(r"(virtualMachines|instances|operations)/[^/]+", r"\1/{name}", path)
    return f"{method} {path.replace('/compute/v1', '').replace('/providers/Microsoft.Compute', '')}"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(cloud: str, server: FakeServer, gateway: KubeGateway, kube: KubeOps, samples: int) -> dict[str, Any]:
    from activities.providers.azure import AzureProvider
    from activities.providers.gcp import GcpProvider

    location = local.gcp_location() if cloud == "gcp" else local.azure_location()
    config = BurstConfig.model_validate({"locations": [location]})
    provider: Any = (GcpProvider(config, endpoint_url=server.url) if cloud == "gcp" else
                     AzureProvider(config, endpoint_url=server.url, ca_file=str(server.ca_file), polling_interval=0.2))
    name = location["name"]
    offering = min(provider.price_offerings(name), key=lambda o: o.usd_per_gpu_hour)
    running, ready, launch_calls, terminate_calls = [], [], Counter[str](), Counter[str]()
    with Booter(server, gateway_join(gateway), interval=0.1):
        for _ in range(samples):
            op, node = new_burst_node()
            labels = {"gpu.kubeon.io/location": name.replace("/", "."), "gpu.kubeon.io/operation": op}
            taints = [Taint(key="gpu.kubeon.io/burst")]
            grant = gateway.issue_ticket(JoinTicketRequest(operation=op, policy="bench", location=name,
                                                           node_name=node, labels=labels, taints=taints))
            user_data = render_user_data(gateway_url=grant.endpoint or "https://127.0.0.1:1", ticket=grant.ticket,
                                         node_name=node, labels=labels, taints=taints)
            req = LaunchRequest(operation=op, cluster="bench", policy="bench", allowed_locations=[name],
                                offering=offering, node_name=node, labels=labels, taints=taints)
            before = len(server.requests())
            start = time.monotonic()
            inst = provider.launch(req, user_data)
            running.append(time.monotonic() - start)
            launched = server.requests()[before:]
            kube.wait_node_ready(node, op, 120, lambda _d: None)
            ready.append(time.monotonic() - start)
            before = len(server.requests())
            provider.terminate(name, inst.instance_id, policy="bench")
            terminated = server.requests()[before:]
            launch_calls.update(_kind(r) for r in launched)
            terminate_calls.update(_kind(r) for r in terminated)
            gateway.remove_node(node, operation=op)
    return {"cloud": cloud, "type": offering.instance_type, "running": running, "ready": ready,
            "launch": launch_calls, "terminate": terminate_calls, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    args = parse_options("bench.cloud_bench", __doc__, argv, samples=10, operation_seconds=0.5)
    with tempfile.TemporaryDirectory(prefix="kubeon-cloud-bench-") as tmp:
        workdir = Path(tmp)
        plane = ControlPlane(workdir / "controlplane").start()
        servers: list[FakeServer] = []
        try:
            cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
            stack = build_stack(cluster, workdir / "stack")
            gateway = KubeGateway(kube_api(stack.gateway_kubeconfig), stack.ticket_key_file.read_bytes().strip())
            kube = KubeOps(kube_api(stack.optimizer_kubeconfig))
            gcp, azure = local.start_gcp(workdir), local.start_azure(workdir)
            servers += [gcp, azure]
            os.environ.update(local.azure_identity_env(azure))
            results = []
            for cloud, server in (("gcp", gcp), ("azure", azure)):
                server.fault(operation_seconds=args.operation_seconds, retry_after=0)
                results.append(run(cloud, server, gateway, kube, args.samples))
            kube.close()
        finally:
            for server in servers:
                server.stop()
            plane.stop()
    print(f"\n{'provider':<8} {'type':<24} {'launch->running p50/p95 s':>26} {'launch->Node Ready p50/p95 s':>29}")
    for r in results:
        up, ready = r["running"], r["ready"]
        print(f"{r['cloud']:<8} {r['type']:<24} {statistics.median(up):>12.2f} /{_pct(up, .95):>6.2f}"
              f"       {statistics.median(ready):>14.2f} /{_pct(ready, .95):>6.2f}")
    for r in results:
        for step in ("launch", "terminate"):
            calls: Counter[str] = r[step]
            total = sum(calls.values()) / r["samples"]
            print(f"\n{r['cloud']} API calls per {step}: {total:.1f}")
            for kind, count in calls.most_common():
                print(f"  {count / r['samples']:5.1f}  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
