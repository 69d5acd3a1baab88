"""Interfaces, addresses, routes and nftables rules with iproute2 and nft, in this network namespace or in a named
one (``netns``: ``ip -n NS``, ``ip netns exec NS nft``), and ``wireguard-go`` as a foreground child process.

``wireguard-go`` is run with ``-f`` (``$!`` is then the daemon, not a re-exec'd parent) and
``WG_PROCESS_FOREGROUND=1``. Its UAPI socket directory is not per network namespace: every interface on the
machine needs a name of its own.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path
from typing import IO
from typing import Any
from typing import Final

from tunnel.uapi import SOCKET_DIR

DEFAULT_MTU = 1380
MAX_IFNAME = 15


class LinkError(RuntimeError):
    """A network command failed; the message holds the command and its error output."""


def run(argv: list[str], *, netns: str | None = None, input_text: str | None = None) -> str:
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv] if argv[0] != "ip" else ["ip", "-n", netns, *argv[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, input=input_text)
    if proc.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


def check_ifname(name: str) -> str:
    if not 0 < len(name) <= MAX_IFNAME or not all(c.isalnum() or c in "-_." for c in name):
        raise LinkError(f"interface name {name!r}: 1 to {MAX_IFNAME} letters, digits, '-', '_' or '.'")
    return name


def start_wireguard_go(interface: str, *, netns: str | None = None, log: IO[bytes] | None = None,
                       socket_dir: Path = SOCKET_DIR, timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """``wireguard-go -f <interface>`` (in ``netns``), returned once its UAPI socket answers."""
    check_ifname(interface)
    argv = ["wireguard-go", "-f", interface]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    env = {**os.environ, "WG_PROCESS_FOREGROUND": "1"}
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL, start_new_session=True)
    sock = socket_dir / f"{interface}.sock"
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if proc.poll() is not None:
            raise LinkError(f"wireguard-go {interface} exited with {proc.returncode} before its socket appeared")
        if time.monotonic() > deadline:
            proc.kill()
            raise LinkError(f"wireguard-go {interface}: no UAPI socket {sock} after {timeout}s")
        time.sleep(0.05)
    return proc


def stop_wireguard_go(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bring_up(interface: str, address: str, *, mtu: int = DEFAULT_MTU, routes: list[str] = (),  # type: ignore[assignment]
             netns: str | None = None) -> None:
    """Address, MTU and link up, then one route per CIDR through the interface (``wg``/UAPI adds no routes).
    Idempotent: an address or route already there is kept."""
    current = run(["ip", "-o", "addr", "show", "dev", interface], netns=netns)
    if f" {address} " not in current:
        run(["ip", "addr", "add", address, "dev", interface], netns=netns)
    run(["ip", "link", "set", interface, "mtu", str(mtu), "up"], netns=netns)
    for cidr in routes:
        run(["ip", "route", "replace", cidr, "dev", interface], netns=netns)


NFT_TABLE = "kubeon_gateway"
# Never reachable from the tunnel, whatever else is allowed: link-local (cloud metadata endpoints, 169.254.169.254).
ALWAYS_DENIED: Final = ("169.254.0.0/16",)


def _elements(cidrs: Iterable[str]) -> str:
    return ", ".join(dict.fromkeys(cidrs))


def gateway_rules(interface: str, *, service_cidr: str, tunnel_cidr: str, pod_cidr: str,
                  gateway_ip: str | None = None, api_port: int = 443, allowed: Sequence[str] = (),
                  cluster_pod_cidrs: Sequence[str] = (), denied: Sequence[str] = ()) -> str:
    """nftables for the gateway.

    - Clamp the TCP MSS of forwarded SYNs to the route's MTU (both directions through the tunnel).
    - Filter what comes out of the tunnel (issue 21, finding 8): a new connection from a burst node or pod may
      reach only ``allowed`` (default: the service CIDR), the ``cluster_pod_cidrs`` the user allows, and other
      burst pods (the burst pod CIDR, back into the tunnel); never ``denied`` (node networks, the embedded
      Temporal's Service) nor 169.254.0.0/16; other burst nodes only at their pod CIDRs (not their kubelets on
      their tunnel addresses). Replies to connections the cluster opened pass (conntrack).
    - Traffic from the tunnel to the gateway itself: only the API server proxy on ``gateway_ip:api_port``.
    - Masquerade tunnel traffic to the service CIDR (replies come back to the gateway, whose node's kube-proxy
      DNATs the service IP); masquerade cluster traffic into the tunnel to the gateway's tunnel address (burst
      nodes route only the gateway, the service CIDR and the burst pod CIDR through it)."""
    allowed = list(allowed) or [service_cidr]
    reach = "\n".join(f"    ip daddr {{ {_elements(cidrs)} }} accept" for cidrs in (allowed, cluster_pod_cidrs)
                      if cidrs)
    to_gateway = (f"    ip daddr {gateway_ip} tcp dport {api_port} accept\n"
                  f"    ip daddr {gateway_ip} icmp type echo-request accept\n") if gateway_ip else ""
    return (
        f"table ip {NFT_TABLE} {{\n"
        "  set denied {\n"
        "    type ipv4_addr; flags interval; auto-merge;\n"
        f"    elements = {{ {_elements([*ALWAYS_DENIED, *denied])} }}\n"
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority mangle; policy accept;\n"
        f"    iifname \"{interface}\" tcp flags syn tcp option maxseg size set rt mtu\n"
        f"    oifname \"{interface}\" tcp flags syn tcp option maxseg size set rt mtu\n"
        "  }\n"
        "  chain tunnel_forward {\n"
        "    type filter hook forward priority filter; policy accept;\n"
        f"    iifname != \"{interface}\" accept\n"
        "    ct state established,related accept\n"
        "    ip daddr @denied counter drop\n"
        f"    oifname \"{interface}\" ip daddr {pod_cidr} accept\n"
        f"{reach}\n"
        "    counter drop\n"
        "  }\n"
        "  chain tunnel_input {\n"
        "    type filter hook input priority filter; policy accept;\n"
        f"    iifname != \"{interface}\" accept\n"
        "    ct state established,related accept\n"
        f"{to_gateway}"
        "    counter drop\n"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"    iifname \"{interface}\" ip daddr {service_cidr} masquerade\n"
        f"    oifname \"{interface}\" ip saddr != {{ {tunnel_cidr}, {pod_cidr} }} masquerade\n"
        "  }\n"
        "}\n"
    )


def apply_gateway_rules(interface: str, *, service_cidr: str, tunnel_cidr: str, pod_cidr: str,
                        netns: str | None = None, **filter_args: Any) -> None:
    """Replace the gateway's nftables table (one transaction: no moment without the filter), and turn on IPv4
    forwarding. ``filter_args``: those of ``gateway_rules``."""
    run(["nft", "-f", "-"], netns=netns, input_text=f"table ip {NFT_TABLE}\ndelete table ip {NFT_TABLE}\n"
        + gateway_rules(interface, service_cidr=service_cidr, tunnel_cidr=tunnel_cidr, pod_cidr=pod_cidr,
                        **filter_args))
    # In a pod the chart sets it (securityContext.sysctls): /proc/sys is read-only there.
    if run(["sysctl", "-n", "net.ipv4.ip_forward"], netns=netns).strip() != "1":
        run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], netns=netns)
