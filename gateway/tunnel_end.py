"""The gateway's end of the burst nodes' WireGuard tunnels: the interface (driven through UAPI), its peers kept
exactly those of the redeemed slots, what a joining node is told about it, and what the gateway process runs for
it (``wireguard-go``, addresses and nftables rules, the API server proxy on the gateway's tunnel address)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from urllib.parse import urlsplit

import urllib3
from kubernetes import client

from gateway.settings import ConfigError
from gateway.settings import GatewayServerConfig
from gateway.slots import AddressPlan
from gateway.slots import Slot
from models.join import TunnelAnswer
from tunnel import keys
from tunnel import link
from tunnel.proxy import TcpProxy
from tunnel.uapi import Uapi

log = logging.getLogger("kubeon.gateway")


def _peers(slots: list[Slot]) -> dict[str, list[str]]:
    """The peer each joined slot wants: its key and allowed IPs. Reservations (tickets not redeemed yet) have no
    key and no peer."""
    return {s.wireguard_key: sorted([f"{s.tunnel_ip}/32", s.pod_cidr]) for s in slots if not s.reserved}


@dataclass
class GatewayTunnel:
    """The gateway's WireGuard interface (driven through UAPI; ``wireguard-go`` and the link are set up by the
    gateway process or the test bed) and what nodes are told about it."""

    interface: str
    private_key: str
    endpoint: str  # host:port nodes send UDP to; empty: the host nodes join at, and listen_port
    listen_port: int
    plan: AddressPlan = field(default_factory=AddressPlan)
    mtu: int = 1380
    persistent_keepalive: int = 25
    api_proxy_port: int = 443

    @property
    def uapi(self) -> Uapi:
        return Uapi(self.interface)

    @property
    def public_key(self) -> str:
        return keys.public_key(self.private_key)

    def configure(self) -> None:
        self.uapi.configure(self.private_key, self.listen_port)

    def answer(self, slot: Slot, endpoint: str) -> TunnelAnswer:
        gw = self.plan.gateway_ip
        return TunnelAnswer(
            gateway_public_key=self.public_key, endpoint=endpoint, address=f"{slot.tunnel_ip}/32",
            gateway_address=gw, allowed_ips=[f"{gw}/32", self.plan.service_cidr, self.plan.pod_cidr],
            mtu=self.mtu, persistent_keepalive=self.persistent_keepalive)

    def sync(self, slots: list[Slot], joined_since: Callable[[], list[Slot]] | None = None) -> dict[str, Any]:
        """Make the interface's peers exactly ``slots`` (missing added, differing fixed, stale removed), touching
        only what differs: a set interrupts nothing that is already right. ``slots`` may be older than a join that
        just added its node's peer (a join claims its slot, then adds the peer): before removing any peer, the
        slots joined since ``slots`` were read are asked for with ``joined_since`` (after the interface is read),
        and their peers stay too (such a node's first handshake would otherwise wait for WireGuard's 5 s retry)."""
        uapi = self.uapi
        device = uapi.get()
        if not device.has_private_key or device.listen_port != self.listen_port:
            self.configure()
        want = _peers(slots)
        if joined_since is not None and any(key not in want for key in device.peers):
            want |= _peers(joined_since())
        added, removed, new = [], [], []
        for key, ips in want.items():
            peer = device.peers.get(key)
            if peer is None or sorted(peer.allowed_ips) != ips:
                uapi.set_peer(key, ips)
                added.append(key)
                if peer is None:  # a new peer: its transfer counters start at 0
                    new.append(key)
        for key in device.peers:
            if key not in want:
                uapi.remove_peer(key)
                removed.append(key)
        return {"added": added, "removed": removed, "new": new}

    def counters(self) -> dict[str, tuple[int, int]]:
        """Each peer's raw ``(rx_bytes, tx_bytes)`` as wireguard-go counts them now (``gateway.transfer``)."""
        return {key: (peer.rx_bytes, peer.tx_bytes) for key, peer in self.uapi.get().peers.items()}


def build_tunnel(cfg: GatewayServerConfig) -> GatewayTunnel | None:
    if not cfg.tunnel_interface:
        return None
    assert cfg.wireguard_key_file is not None
    try:
        private = keys.check_key(cfg.wireguard_key_file.read_text().strip(), str(cfg.wireguard_key_file))
    except ValueError as exc:
        raise ConfigError(f"KUBEON_GATEWAY_WIREGUARD_KEY_FILE: {exc}") from None
    return GatewayTunnel(interface=cfg.tunnel_interface, private_key=private, endpoint=cfg.tunnel_endpoint,
                         listen_port=cfg.udp_port, plan=cfg.plan, mtu=cfg.mtu)


@dataclass
class TunnelLinks:
    """What the gateway process runs for its tunnel: wireguard-go and the API server proxy."""

    wireguard: object
    proxy: TcpProxy
    rules: TunnelFilter | None = None

    def stop(self) -> None:
        if self.rules is not None:
            self.rules.stop()
        self.proxy.stop()
        if hasattr(self.wireguard, "poll"):
            link.stop_wireguard_go(self.wireguard)  # type: ignore[arg-type]


class TunnelFilter:
    """The gateway's nftables table (``tunnel.link.gateway_rules``): what the tunnel may reach, with the ClusterIPs
    of ``KUBEON_GATEWAY_TUNNEL_DENIED_SERVICES`` refused. A ClusterIP is assigned when the Service is created,
    so the chart cannot name it: the gateway reads each Service (its Role: ``get`` on those names) at start and
    every ``interval`` seconds, and replaces the table when an address changed (a Service re-created)."""

    def __init__(self, cfg: GatewayServerConfig, tunnel: GatewayTunnel, api: client.ApiClient, *,
                 interval: float = 30.0) -> None:
        self._cfg = cfg
        self._tunnel = tunnel
        self._core = client.CoreV1Api(api)
        self._interval = interval
        self._ips: dict[str, tuple[str, ...]] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def denied(self) -> list[str]:
        return [*self._cfg.tunnel_denied, *(f"{ip}/32" for ips in self._ips.values() for ip in ips)]

    def _resolve(self) -> dict[str, tuple[str, ...]]:
        found = dict(self._ips)
        for name in self._cfg.tunnel_denied_services:
            try:
                spec = self._core.read_namespaced_service(name, self._cfg.namespace).spec
            except client.ApiException as exc:
                if exc.status == 404:
                    found[name] = ()  # no such Service: nothing to refuse (until it exists)
                else:
                    log.warning("cannot read Service %s/%s to refuse it in the tunnel: HTTP %s (kept: %s)",
                                self._cfg.namespace, name, exc.status, ", ".join(found.get(name, ())) or "none")
                continue
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                log.warning("cannot read Service %s/%s to refuse it in the tunnel: %s", self._cfg.namespace, name,
                            type(exc).__name__)
                continue
            ips = [*(spec.cluster_ips or []), spec.cluster_ip or ""] if spec is not None else []
            found[name] = tuple(sorted({ip for ip in ips if ip and ip != "None" and ":" not in ip}))
        return found

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the denied Services; replace the table when their addresses changed (or ``force``)."""
        found = self._resolve()
        if not force and found == self._ips:
            return False
        self._ips = found
        plan = self._cfg.plan
        link.apply_gateway_rules(self._tunnel.interface, service_cidr=plan.service_cidr,
                                 tunnel_cidr=plan.tunnel_cidr, pod_cidr=plan.pod_cidr, gateway_ip=plan.gateway_ip,
                                 api_port=self._tunnel.api_proxy_port, allowed=self._cfg.tunnel_allowed,
                                 cluster_pod_cidrs=self._cfg.tunnel_cluster_pod_cidrs, denied=self.denied())
        log.info("tunnel filter: to %s%s; refused: %s", ", ".join(self._cfg.tunnel_allowed or (plan.service_cidr,)),
                 f", cluster pods {', '.join(self._cfg.tunnel_cluster_pod_cidrs)}"
                 if self._cfg.tunnel_cluster_pod_cidrs else "",
                 ", ".join([*link.ALWAYS_DENIED, *self.denied()]))
        return True

    def start(self) -> None:
        if not self._cfg.tunnel_denied_services:
            return

        def loop() -> None:
            while not self._stopped.wait(self._interval):
                try:
                    self.refresh()
                except Exception as exc:  # the thread must outlive any one failure
                    log.warning("tunnel filter: cannot refresh the denied Services: %s", exc)

        self._thread = threading.Thread(target=loop, name="tunnel-filter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()


def api_upstream(cfg: GatewayServerConfig, api: client.ApiClient) -> tuple[str, int]:
    target = cfg.api_upstream or urlsplit(str(api.configuration.host)).netloc
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"KUBEON_GATEWAY_API_UPSTREAM {target!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def start_tunnel(cfg: GatewayServerConfig, tunnel: GatewayTunnel, api: client.ApiClient,
                 restore: Callable[[], object]) -> TunnelLinks:
    """wireguard-go on the interface (kept if it already runs), its key and port, the gateway's tunnel address
    and routes for the burst pod CIDR, nftables (MSS clamp, service CIDR masquerade), the peers from the API, and
    the API server proxy on <gateway tunnel IP>:443."""
    wireguard: object = None
    if not tunnel.uapi.path.exists():
        wireguard = link.start_wireguard_go(tunnel.interface)
    tunnel.configure()
    prefix = cfg.plan.tunnel_cidr.split("/")[1]
    link.bring_up(tunnel.interface, f"{cfg.plan.gateway_ip}/{prefix}", mtu=cfg.mtu, routes=[cfg.plan.pod_cidr])
    rules = TunnelFilter(cfg, tunnel, api)
    rules.refresh(force=True)
    rules.start()
    try:
        restore()  # the peers back from the API before the first node's packets
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        log.warning("cannot restore the tunnel's peers yet (%s); the reconciler retries every second",
                    type(exc).__name__)
    proxy = TcpProxy((cfg.plan.gateway_ip, tunnel.api_proxy_port), api_upstream(cfg, api),
                     max_per_peer=cfg.proxy_max_per_peer, max_connections=cfg.proxy_max_connections).start()
    log.info("tunnel %s up: %s, UDP %d, %d peer(s) restored from the API; API server proxy %s:%d -> %s:%d",
             tunnel.interface, cfg.plan.gateway_ip, cfg.udp_port, len(tunnel.uapi.get().peers), *proxy.address,
             *proxy.upstream)
    return TunnelLinks(wireguard=wireguard, proxy=proxy, rules=rules)
