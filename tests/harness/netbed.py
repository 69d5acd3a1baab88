"""A network test bed where every non-loopback address lives in network namespaces the test creates.

- ``kb-gw-<tag>``: the gateway (its own ``kubeon-gpu gateway`` process with wireguard-go runs here). Its public
  address 198.51.100.1 (TEST-NET-2) sits on its loopback; each burst node reaches it over its own veth
  (192.0.2.0/24, TEST-NET-1, a /30 per node). A proxy listening on 127.0.0.1:<api port> inside it forwards to the
  host's loopback API server, so the gateway's kubeconfig works unchanged.
- ``kb-cl-<tag>``: the cluster side (203.0.113.0/30, TEST-NET-3, to the gateway). It plays the home nodes: a
  Service's ClusterIP is on its loopback (as kube-proxy would DNAT it), and it routes the burst pod CIDR and the
  tunnel CIDR to the gateway, as a real cluster's nodes must.
- ``kb-n<i>-<tag>``: one per burst node, with nothing but its underlay veth (and the tunnel it brings up).

IPv6 is off in every namespace. ``close()`` stops every process the bed started (by pid) and deletes the
namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from models.join import parse_user_data
from models.labels import LABEL_OPERATION
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tunnel import keys
from tunnel import link
from tunnel.proxy import TcpProxy
from tunnel.uapi import Uapi

GATEWAY_PUBLIC_IP = "198.51.100.1"
CLUSTER_LINK = ("203.0.113.1", "203.0.113.2")
# The cluster's ranges a bed routes: the harness API server's --service-cluster-ip-range, burst pods, tunnel addresses.
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.245.0.0/16"
TUNNEL_CIDR = "10.250.0.0/16"


@contextlib.contextmanager
def wireguard_device() -> Iterator[Uapi]:
    """A wireguard-go interface of its own in a network namespace of its own (nothing routed to it), driven
    through UAPI; both gone afterwards."""
    tag = secrets.token_hex(2)
    netns, iface = f"kb-wg-{tag}", f"kbw{tag}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    proc = link.start_wireguard_go(iface, netns=netns)
    try:
        yield Uapi(iface)
    finally:
        link.stop_wireguard_go(proc)
        subprocess.run(["ip", "netns", "del", netns], check=False)


def sh(*argv: str, netns: str | None = None, check: bool = True, input_text: str | None = None) -> str:
    cmd = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input_text)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


@dataclass
class BedNode:
    netns: str
    underlay: str  # its veth
    address: str  # its underlay address
    interface: str  # its WireGuard interface name (unique on the machine: the UAPI directory is shared)


@dataclass
class NetBed:
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[BedNode] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    proxies: list[TcpProxy] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def gw(self) -> str:
        return f"kb-gw-{self.tag}"

    @property
    def cl(self) -> str:
        return f"kb-cl-{self.tag}"

    @property
    def gateway_interface(self) -> str:
        return f"kbgw{self.tag}"

    def _netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        for key in ("all", "default", "lo"):
            sh("sysctl", "-q", "-w", f"net.ipv6.conf.{key}.disable_ipv6=1", netns=name)
        sh("ip", "link", "set", "lo", "up", netns=name)

    def _veth(self, a: str, a_ns: str, b: str, b_ns: str) -> None:
        sh("ip", "link", "add", "name", a, "netns", a_ns, "type", "veth", "peer", "name", b, "netns", b_ns)
        for name, ns in ((a, a_ns), (b, b_ns)):
            sh("sysctl", "-q", "-w", f"net.ipv6.conf.{name}.disable_ipv6=1", netns=ns)

    def create(self, api_port: int) -> NetBed:
        self._netns(self.gw)
        self._netns(self.cl)
        sh("ip", "addr", "add", f"{GATEWAY_PUBLIC_IP}/32", "dev", "lo", netns=self.gw)
        g, c = f"kbc{self.tag}g", f"kbc{self.tag}c"
        self._veth(g, self.gw, c, self.cl)
        sh("ip", "addr", "add", f"{CLUSTER_LINK[0]}/30", "dev", g, netns=self.gw)
        sh("ip", "addr", "add", f"{CLUSTER_LINK[1]}/30", "dev", c, netns=self.cl)
        sh("ip", "link", "set", g, "up", netns=self.gw)
        sh("ip", "link", "set", c, "up", netns=self.cl)
        # The API server on the gateway namespace's loopback, as in-cluster it is one Service away.
        self.proxies.append(TcpProxy(("127.0.0.1", api_port), ("127.0.0.1", api_port), listen_netns=self.gw).start())
        return self

    def route_cluster(self, *, service_cidr: str, pod_cidr: str, tunnel_cidr: str) -> None:
        """The gateway sends the service CIDR to the cluster side; the cluster side sends burst pods and tunnel
        addresses to the gateway (what a real cluster's route to the gateway does)."""
        sh("ip", "route", "replace", service_cidr, "via", CLUSTER_LINK[1], netns=self.gw)
        for cidr in (pod_cidr, tunnel_cidr):
            sh("ip", "route", "replace", cidr, "via", CLUSTER_LINK[0], netns=self.cl)

    def add_node(self) -> BedNode:
        i = len(self.nodes)
        node = BedNode(netns=f"kb-n{i}-{self.tag}", underlay=f"kbu{i}{self.tag}n", address=f"192.0.2.{4 * i + 2}",
                       interface=f"kbn{i}{self.tag}")
        self._netns(node.netns)
        gw_end = f"kbu{i}{self.tag}g"
        self._veth(gw_end, self.gw, node.underlay, node.netns)
        sh("ip", "addr", "add", f"192.0.2.{4 * i + 1}/30", "dev", gw_end, netns=self.gw)
        sh("ip", "addr", "add", f"{node.address}/30", "dev", node.underlay, netns=node.netns)
        sh("ip", "link", "set", gw_end, "up", netns=self.gw)
        sh("ip", "link", "set", node.underlay, "up", netns=node.netns)
        sh("ip", "route", "add", f"{GATEWAY_PUBLIC_IP}/32", "via", f"192.0.2.{4 * i + 1}", netns=node.netns)
        self.nodes.append(node)
        return node

    def spawn(self, argv: list[str], *, netns: str, log: Path, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill_pidfile(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int(path.read_text().strip())
            os.kill(pid, signal.SIGTERM)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for ns in reversed(self.namespaces):
            # Whatever still runs in it (wireguard-go a node started) goes with it: by pid, from `ip netns pids`.
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


# ----- the gateway as its own process in the bed -----------------------------------------------------------------

UDP_PORT = 51820


@dataclass
class Gateway:
    """`kubeon-gpu gateway` in the bed's gateway namespace, with its tunnel."""

    bed: NetBed
    workdir: Path
    env: dict[str, str]
    url: str  # from the host, through a proxy into the gateway's namespace
    ca_file: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        return (self.workdir / "gateway.log").read_text(errors="replace")

    def start(self) -> Gateway:
        self.proc = self.bed.spawn([sys.executable, "-m", "gateway.main"], netns=self.bed.gw,
                                   log=self.workdir / "gateway.log", env=self.env)
        marker = self.log.count("restored from the API")
        wait_for(lambda: self.log.count("restored from the API") > marker or self._dead(), timeout=60,
                 what="the gateway's tunnel up")
        assert not self._dead(), self.log
        wait_for(lambda: "Uvicorn running" in self.log.split("restored from the API")[-1], timeout=30,
                 what="the gateway serving")
        return self

    def _dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)  # ip netns exec execs: this is the gateway itself
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()




def start_tunnel_gateway(cluster: Cluster, bed: NetBed, workdir: Path, *, service_cidr: str, pod_cidr: str,
                         tunnel_cidr: str, extra_env: dict[str, str] | None = None) -> Gateway:
    """The chart's ServiceAccounts and rules, a CA and certificate for the gateway's public address, its ticket
    and WireGuard keys; the gateway started with its tunnel, reachable from the host at ``Gateway.url``."""
    from tests.harness.controlplane import _issue
    from tests.harness.controlplane import _name
    from tests.harness.controlplane import free_port
    from tests.harness.rbac import GATEWAY_SA
    from tests.harness.rbac import OPTIMIZER_NAMESPACE
    from tests.harness.rbac import grant_optimizer_and_gateway
    grant_optimizer_and_gateway(cluster)
    ca = _issue(_name("tunnel-gateway-ca"), None, is_ca=True)
    ca_file, _ = ca.write(workdir, "ca")
    cert, key = _issue(_name("gateway"), ca, server_ips=(GATEWAY_PUBLIC_IP, "127.0.0.1")).write(workdir, "tls")
    (workdir / "ticket.key").write_text(secrets.token_hex(32))
    (workdir / "wg.key").write_text(keys.generate_private_key() + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEON_")}
    env.update({
        "PYTHONUNBUFFERED": "1", "KUBEON_CLUSTER": "test",
        "KUBEON_GATEWAY_KUBECONFIG": str(cluster.service_account_kubeconfig(OPTIMIZER_NAMESPACE, GATEWAY_SA)),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(workdir / "ticket.key"),
        "KUBEON_GATEWAY_TLS_CERT_FILE": str(cert), "KUBEON_GATEWAY_TLS_KEY_FILE": str(key),
        "KUBEON_GATEWAY_LISTEN": f"{GATEWAY_PUBLIC_IP}:8443", "KUBEON_HEALTH_PORT": "8443",
        "KUBEON_GATEWAY_PUBLIC_URL": f"https://{GATEWAY_PUBLIC_IP}:8443",
        "KUBEON_GATEWAY_TUNNEL_INTERFACE": bed.gateway_interface,
        "KUBEON_GATEWAY_WIREGUARD_KEY_FILE": str(workdir / "wg.key"),
        "KUBEON_GATEWAY_UDP_PORT": str(UDP_PORT), "KUBEON_GATEWAY_SERVICE_CIDR": service_cidr,
        "KUBEON_GATEWAY_POD_CIDR": pod_cidr, "KUBEON_GATEWAY_TUNNEL_CIDR": tunnel_cidr,
        **(extra_env or {}),
    })
    port = free_port()
    bed.proxies.append(TcpProxy(("127.0.0.1", port), (GATEWAY_PUBLIC_IP, 8443), upstream_netns=bed.gw).start())
    return Gateway(bed, workdir, env, f"https://127.0.0.1:{port}", ca_file).start()


@dataclass
class Joined:
    node: BedNode
    name: str
    operation: str
    state: Path
    public_key: str


# The node image's DCGM: the dcgmi stand-in (its diagnostic runs when the node's burn-in label names GpuHealth).
DCGMI = f"{sys.executable} -m tests.harness.dcgmi"


def boot_node(bed: NetBed, user_data: str, capacity: dict[str, str], workdir: Path, provider_id: str,
              node: BedNode | None = None, failing_gpu_test: str = "") -> Joined:
    """A booting burst VM: its user data, `kubeon-gpu node join` in a namespace of its own (which starts the
    kubelet stand-in, and wireguard-go, both left running there until the bed closes). ``failing_gpu_test``: the
    DCGM deployment test that fails on its GPU (tests/harness/dcgmi.py)."""
    doc = parse_user_data(user_data)
    name = str(doc["nodeName"])
    config = workdir / f"{name}.join"
    config.write_text(user_data)
    node = node or bed.add_node()
    state = workdir / name
    proc = bed.spawn([sys.executable, "-m", "worker.cli", "node", "join", "--config", str(config),
                      "--state-dir", str(state), "--interface", node.interface,
                      "--kubelet-command", f"{sys.executable} -m tests.harness.kubelet", "--provider-id", provider_id,
                      "--gpu-health-command", f"{DCGMI} diag -r 1" + (f" --fail {failing_gpu_test}" if failing_gpu_test
                                                                      else ""),
                      "--capacity", ",".join(f"{k}={v}" for k, v in capacity.items())],
                     netns=node.netns, log=workdir / f"{name}.join.log")
    assert proc.wait(timeout=120) == 0, (workdir / f"{name}.join.log").read_text()
    op = str(doc["labels"][LABEL_OPERATION])
    return Joined(node, name, op, state, keys.public_key((state / "wireguard.key").read_text().strip()))
