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
from dataclasses import dataclass, field
from pathlib import Path

from tunnel.proxy import TcpProxy

GATEWAY_PUBLIC_IP = "198.51.100.1"
CLUSTER_LINK = ("203.0.113.1", "203.0.113.2")


def sh(*argv: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True)
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
