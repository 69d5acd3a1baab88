"""Ticket redeemed -> Node Ready through the WireGuard tunnel, for N burst nodes joining at once.

The test bed of tests/worker/test_gateway_tunnel.py: the local control plane, `kubeon-gpu gateway` with its
tunnel in a network namespace, and N burst nodes, each in its own namespace running `kubeon-gpu node join` and
the kubelet stand-in. For each node: from starting `node join` (keys, the ticket redeemed, the CSR signed, the
tunnel up, the kubelet started) to the Node Ready with the gateway's joining taint lifted (the point a pod can
land). Every address is inside the namespaces it creates; everything is stopped at the end.

    .venv/bin/python -m bench.tunnel_join --nodes 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from kubernetes import watch

from activities.clients.gateway import HttpGatewayClient
from models.join import JoinTicketRequest
from models.join import render_user_data
from models.labels import JOINING_TAINT
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from tests.harness.controlplane import ControlPlane
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.netbed import POD_CIDR
from tests.harness.netbed import SERVICE_CIDR
from tests.harness.netbed import TUNNEL_CIDR
from tests.harness.netbed import BedNode
from tests.harness.netbed import NetBed
from tests.harness.netbed import boot_node
from tests.harness.netbed import start_tunnel_gateway
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA
from tunnel import keys
from tunnel.uapi import Uapi
from tunnel.uapi import UapiError


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _registered(kubelet_log: Path) -> float:
    """When the kubelet stand-in logged its Node registered (its log's ISO timestamp)."""
    import datetime as dt

    for line in kubelet_log.read_text().splitlines():
        if line.endswith(": registered"):
            return dt.datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()
    return float("nan")


class PeerWatch:
    """The gateway interface's peers as seen every ``every`` seconds: when each key's first handshake completed
    (the wall time wireguard-go reports) and how often a key seen there was gone at a later look (a peer removed
    while its node joined: that node's next handshake waits for WireGuard's 5 s retry)."""

    def __init__(self, interface: str, every: float = 0.05) -> None:
        self._uapi = Uapi(interface, timeout=2.0)
        self._every = every
        self.handshake: dict[str, float] = {}
        self.removed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        present: set[str] = set()
        while not self._stop.wait(self._every):
            try:
                peers = self._uapi.get().peers
            except UapiError:
                continue
            for key in present - peers.keys():
                self.removed[key] = self.removed.get(key, 0) + 1
            present = set(peers)
            for key, peer in peers.items():
                if peer.last_handshake and key not in self.handshake:
                    self.handshake[key] = peer.last_handshake


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.tunnel_join", description=__doc__)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=180.0, help="per node, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the directory (gateway.log, each node's files)")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 60:
        parser.error("--nodes must be between 1 and 60 (one /30 of 192.0.2.0/24 per node)")
    workdir = Path(tempfile.mkdtemp(prefix="kubeon-tunnel-bench-"))
    plane = ControlPlane(workdir / "controlplane")
    bed = NetBed()
    gateway = None
    try:
        plane.start()
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        bed.create(api_port=int(urlsplit(plane.server).port or 443))
        bed.route_cluster(service_cidr=SERVICE_CIDR, pod_cidr=POD_CIDR, tunnel_cidr=TUNNEL_CIDR)
        gateway = start_tunnel_gateway(cluster, bed, workdir, service_cidr=SERVICE_CIDR, pod_cidr=POD_CIDR,
                                       tunnel_cidr=TUNNEL_CIDR)
        token = workdir / "optimizer.token"
        token.write_text(cluster.service_account_token(OPTIMIZER_NAMESPACE, OPTIMIZER_SA))
        user_data = []
        with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
            for _ in range(args.nodes):
                op, name = new_burst_node()
                labels = {LABEL_OPERATION: op, LABEL_POLICY: "bench", LABEL_LOCATION: "tunnel.bench"}
                taints = [Taint(key="gpu.kubeon.io/burst")]
                grant = http.issue_ticket(JoinTicketRequest(operation=op, policy="bench", location="sim/bench",
                                                            node_name=name, labels=labels, taints=taints, gpus=1))
                user_data.append((name, render_user_data(gateway_url=grant.endpoint, ticket=grant.ticket,
                                                         node_name=name, labels=labels, taints=taints,
                                                         ca_bundle=gateway.ca_file.read_text())))
        # The namespaces first (a VM exists before it boots): their set-up is not part of the join.
        booting = [(name, data, bed.add_node()) for name, data in user_data]
        capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}
        core = cluster.admin.core

        ready: dict[str, float] = {}
        arrived = threading.Condition()
        names = {name for name, _, _ in booting}

        def watch_nodes() -> None:
            """One watch of the Nodes (not a read per node per 0.1 s): when each is Ready with no joining taint."""
            stream = watch.Watch()
            while len(ready) < len(names) and not stopped.is_set():
                for event in stream.stream(core.list_node, timeout_seconds=5):
                    node = event["object"]
                    name = node.metadata.name
                    if name in names and name not in ready and node.status is not None and any(
                            c.type == "Ready" and c.status == "True" for c in node.status.conditions or []) and \
                            JOINING_TAINT.key not in {t.key for t in (node.spec.taints if node.spec else None) or []}:
                        with arrived:
                            ready[name] = time.monotonic()
                            arrived.notify_all()
                    if stopped.is_set() or len(ready) == len(names):
                        stream.stop()

        def one(item: tuple[str, str, BedNode]) -> tuple[float, dict[str, float]]:
            name, data, vm = item
            t0, wall0 = time.monotonic(), time.time()
            boot_node(bed, data, capacity, workdir, f"sim://bench/{name}", node=vm)
            joined = time.monotonic() - t0
            with arrived:
                if not arrived.wait_for(lambda: name in ready, timeout=args.timeout):
                    raise TimeoutError(f"{name} not Ready within {args.timeout}s")
            state = workdir / name
            steps = {"keys": (state / "wireguard.key").stat().st_mtime - wall0,
                     "answer": (state / "join-answer.json").stat().st_mtime - wall0,
                     "kubelet started": (state / "kubelet.pid").stat().st_mtime - wall0,
                     "node join exited": joined,
                     "registered": _registered(state / "kubelet.log") - wall0}
            return ready[name] - t0, steps

        def tunnel_steps(name: str) -> tuple[float, int]:
            """Seconds from the node's join answer to its first handshake at the gateway (inf: none seen); how
            often its peer was removed."""
            state = workdir / name
            key = keys.public_key((state / "wireguard.key").read_text().strip())
            answered = (state / "join-answer.json").stat().st_mtime
            return peers.handshake.get(key, float("inf")) - answered, peers.removed.get(key, 0)

        stopped = threading.Event()
        watcher = threading.Thread(target=watch_nodes, daemon=True)
        watcher.start()
        peers = PeerWatch(bed.gateway_interface).start()
        started = time.monotonic()
        try:
            with ThreadPoolExecutor(max_workers=args.nodes) as pool:
                timed = list(pool.map(one, booting))
        finally:
            stopped.set()
            peers.stop()
        wall = time.monotonic() - started
        results = [t for t, _ in timed]
        print(f"\nsteps after starting `node join`, median of {args.nodes}: " + ", ".join(
            f"{step} {statistics.median(steps[step] for _, steps in timed):.2f} s" for step in timed[0][1]))
        slowest, slowest_steps = max(timed, key=lambda t: t[0])
        print(f"slowest node, Ready without the joining taint at {slowest:.2f} s: " + ", ".join(
            f"{step} {at:.2f} s" for step, at in slowest_steps.items()))
        tunnel = [tunnel_steps(name) for name, _, _ in booting]
        handshakes = [t for t, _ in tunnel]
        print(f"tunnel: join answer -> first handshake at the gateway, median {statistics.median(handshakes):.2f} s, "
              f"max {max(handshakes):.2f} s; gateway peers removed while joining: {sum(r for _, r in tunnel)}")
        print(f"\nticket redeemed -> Node Ready through the tunnel, {args.nodes} nodes joining at once")
        print(f"  p50 {statistics.median(results):.2f} s   p95 {percentile(results, 0.95):.2f} s   "
              f"max {max(results):.2f} s   all Ready after {wall:.2f} s")
        return 0
    finally:
        if gateway is not None:
            gateway.stop()
        bed.close()
        plane.stop()
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
