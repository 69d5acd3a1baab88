"""What a burst node (or a pod on it) reaches through the tunnel (issue 21, finding 8), on the real parts: the
gateway process with its nftables in the bed's gateway namespace, a joined node in its own namespace, which then
behaves as a hostile node would (its own routes and WireGuard AllowedIPs through the tunnel to wherever it likes).

Only the API server proxy on the gateway and the allowed Services answer; the embedded Temporal's Service (its
ClusterIP is assigned by the API server, the gateway reads it: KUBEON_GATEWAY_TUNNEL_DENIED_SERVICES), the
gateway namespace's own underlay address and the metadata address 169.254.169.254 do not."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gateway.settings import ConfigError
from gateway.settings import GatewayServerConfig
from gateway.settings import GatewaySettings
from tests.gateway.test_tunnel_end import MARKER
from tests.gateway.test_tunnel_end import http_get
from tests.gateway.test_tunnel_end import join_node
from tests.gateway.test_tunnel_end import ready
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.netbed import CLUSTER_LINK
from tests.harness.netbed import Gateway
from tests.harness.netbed import Joined
from tests.harness.netbed import NetBed
from tests.harness.netbed import sh
from tests.harness.rbac import GATEWAY_SA
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tunnel import keys
from tunnel import link
from tunnel.uapi import Uapi

pytestmark = pytest.mark.cluster

ALLOWED_IP = "10.96.77.79"
METADATA_IP = "169.254.169.254"
UNDERLAY_PORT = 8081


def tcp_open(netns: str, host: str, port: int, timeout: float = 3.0, source: str = "") -> bool:
    bind = f", source_address=({source!r}, 0)" if source else ""
    out = sh(sys.executable, "-c", "import socket, sys\ntry:\n"
             f"    socket.create_connection(({host!r}, {port}), timeout={timeout}{bind}).close(); print('open')\n"
             "except OSError as exc:\n    print('closed', exc)", netns=netns)
    return out.startswith("open")


@pytest.fixture(scope="module")
def temporal_ip(cluster: Cluster, bed: NetBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A stand-in for the embedded Temporal's Service in the gateway's namespace: its ClusterIP assigned by the
    API server (as in a real cluster, unknown at template time), answered on the cluster side; the gateway may
    read it (the chart's Role does the same for the real one)."""
    name = f"temporal-{uuid.uuid4().hex[:6]}"
    core, rbac = cluster.admin.core, cluster.admin.rbac
    with contextlib.suppress(client.ApiException):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=OPTIMIZER_NAMESPACE)))
    svc = core.create_namespaced_service(OPTIMIZER_NAMESPACE, client.V1Service(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=7233)])))
    rbac.create_namespaced_role(OPTIMIZER_NAMESPACE, client.V1Role(
        metadata=client.V1ObjectMeta(name=name), rules=[client.V1PolicyRule(
            api_groups=[""], resources=["services"], resource_names=[name], verbs=["get"])]))
    rbac.create_namespaced_role_binding(OPTIMIZER_NAMESPACE, client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name=name),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=GATEWAY_SA, namespace=OPTIMIZER_NAMESPACE)]))
    ip = str(svc.spec.cluster_ip)
    site = tmp_path_factory.mktemp("site")
    (site / "marker.txt").write_text(MARKER)
    for addr in (ip, ALLOWED_IP, METADATA_IP):
        sh("ip", "addr", "add", f"{addr}/32", "dev", "lo", netns=bed.cl)
    for addr, port in ((ip, 7233), (ALLOWED_IP, 80), (METADATA_IP, 80)):
        bed.spawn([sys.executable, "-m", "http.server", str(port), "--bind", addr, "--directory", str(site)],
                  netns=bed.cl, log=site.parent / f"{addr}.log")
    # The gateway's host reaches the metadata endpoint (as a cloud VM's pod network does)...
    sh("ip", "route", "replace", f"{METADATA_IP}/32", "via", CLUSTER_LINK[1], netns=bed.gw)
    # ...and something listens on an underlay address of the gateway's own namespace.
    bed.spawn([sys.executable, "-m", "http.server", str(UNDERLAY_PORT), "--bind", CLUSTER_LINK[0], "--directory",
               str(site)], netns=bed.gw, log=site.parent / "underlay.log")
    for ns, addr, port in ((bed.cl, ip, 7233), (bed.cl, ALLOWED_IP, 80), (bed.cl, METADATA_IP, 80),
                           (bed.gw, CLUSTER_LINK[0], UNDERLAY_PORT)):
        wait_for(functools.partial(tcp_open, ns, addr, port), timeout=20, what=f"the listener on {addr}:{port}")
    try:
        yield name, ip
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_service(name, OPTIMIZER_NAMESPACE)
        with contextlib.suppress(client.ApiException):
            rbac.delete_namespaced_role_binding(name, OPTIMIZER_NAMESPACE)
        with contextlib.suppress(client.ApiException):
            rbac.delete_namespaced_role(name, OPTIMIZER_NAMESPACE)


@pytest.fixture(scope="module")
def gateway_env(temporal_ip: tuple[str, str]) -> dict[str, str]:
    return {"KUBEON_GATEWAY_TUNNEL_DENIED_SERVICES": temporal_ip[0]}



def route_through_tunnel(gateway: Gateway, node: Joined, address: str) -> None:
    """What a hostile node can always do: route ``address`` into its tunnel and let its WireGuard peer (the
    gateway) carry it; the gateway must refuse it."""
    gw_key = keys.public_key((gateway.workdir / "wg.key").read_text().strip())
    uapi = Uapi(node.node.interface)
    peer = uapi.get().peers[gw_key]
    if f"{address}/32" not in peer.allowed_ips:
        uapi.set_peer(gw_key, [*peer.allowed_ips, f"{address}/32"])
    sh("ip", "route", "replace", f"{address}/32", "dev", node.node.interface, netns=node.node.netns)


def test_the_tunnel_reaches_only_the_api_proxy_and_the_allowed_services(
        bed: NetBed, gateway: Gateway, joined: Joined, temporal_ip: tuple[str, str]) -> None:
    ns = joined.node.netns
    gateway_ip = "10.250.0.1"
    # Still served: the API server proxy on the gateway, and a Service of the service CIDR.
    assert tcp_open(ns, gateway_ip, 443)
    assert http_get(ns, f"http://{ALLOWED_IP}/marker.txt").strip() == MARKER
    # The embedded Temporal's Service: what a `temporal workflow signal --name approve` would connect to.
    assert not tcp_open(ns, temporal_ip[1], 7233), "the Temporal Service answered through the tunnel"
    # The gateway itself, on anything but the proxy: its tunnel address and an underlay address.
    assert not tcp_open(ns, gateway_ip, 8443)
    route_through_tunnel(gateway, joined, CLUSTER_LINK[0])
    assert not tcp_open(ns, CLUSTER_LINK[0], UNDERLAY_PORT), "the gateway's underlay answered through the tunnel"
    # The metadata address, which the gateway's own namespace reaches.
    assert tcp_open(bed.gw, METADATA_IP, 80)  # positive control: the route exists on the gateway's side
    route_through_tunnel(gateway, joined, METADATA_IP)
    assert not tcp_open(ns, METADATA_IP, 80), "169.254.169.254 answered through the tunnel"
    # The node still works through the tunnel after all this.
    assert tcp_open(ns, gateway_ip, 443)
    rules = sh("nft", "list", "table", "ip", link.NFT_TABLE, netns=bed.gw)
    assert temporal_ip[1] in rules and "169.254.0.0/16" in rules


def test_burst_pods_still_reach_each_other_through_the_gateway(
        cluster: Cluster, bed: NetBed, gateway: Gateway, joined: Joined, tmp_path: Path) -> None:
    """Burst pod CIDR to burst pod CIDR, node to node through the gateway: allowed by the filter."""
    other = join_node(cluster, bed, gateway, tmp_path)
    try:
        wait_for(lambda: ready(cluster, other.name), timeout=60, what=f"{other.name} Ready through the tunnel")
        def pod_cidr(name: str) -> str | None:
            return cluster.admin.core.read_node(name).spec.pod_cidr

        cidrs = [wait_for(functools.partial(pod_cidr, n.name), timeout=30, what=f"{n.name}'s pod CIDR")
                 for n in (joined, other)]
        pods = [str(ipaddress.ip_network(str(cidr))[10]) for cidr in cidrs]
        for node, addr in zip((joined, other), pods, strict=True):
            sh("ip", "addr", "add", f"{addr}/32", "dev", "lo", netns=node.node.netns)
        bed.spawn([sys.executable, "-m", "http.server", "8090", "--bind", pods[1]], netns=other.node.netns,
                  log=tmp_path / "pod.log")
        wait_for(functools.partial(tcp_open, other.node.netns, pods[1], 8090), timeout=20, what="the pod listening")
        assert tcp_open(joined.node.netns, pods[1], 8090, source=pods[0])
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.admin.core.delete_node(other.name)


def _config(**values: str) -> GatewayServerConfig:
    return GatewayServerConfig.from_settings(GatewaySettings.model_validate(
        {"gateway_ticket_key_file": "/dev/null", "gateway_service_cidr": "10.96.0.0/12", **values}))


def test_allowed_destinations_must_lie_in_the_service_cidr_and_pods_off_link_local() -> None:
    cfg = _config(gateway_tunnel_allowed_destinations="10.96.0.10/32, 10.100.0.0/16",
                  gateway_tunnel_cluster_pod_cidrs="10.244.0.0/16", gateway_tunnel_denied_cidrs="192.168.0.0/16",
                  gateway_tunnel_denied_services="kubeon-gpu-optimizer-temporal")
    assert cfg.tunnel_allowed == ("10.96.0.10/32", "10.100.0.0/16")
    assert cfg.tunnel_denied_services == ("kubeon-gpu-optimizer-temporal",)
    with pytest.raises(ConfigError, match="not inside the service CIDR"):
        _config(gateway_tunnel_allowed_destinations="10.244.0.0/16")
    with pytest.raises(ConfigError, match=r"169\.254"):
        _config(gateway_tunnel_cluster_pod_cidrs="169.254.0.0/17")
    with pytest.raises(ConfigError, match="KUBEON_GATEWAY_TUNNEL_DENIED_CIDRS"):
        _config(gateway_tunnel_denied_cidrs="10.0.0.1/8")
    rules = link.gateway_rules("kg", service_cidr="10.96.0.0/12", tunnel_cidr="10.250.0.0/16",
                               pod_cidr="10.245.0.0/16", gateway_ip="10.250.0.1", allowed=cfg.tunnel_allowed,
                               cluster_pod_cidrs=cfg.tunnel_cluster_pod_cidrs, denied=cfg.tunnel_denied)
    # From the tunnel: the narrower Services, the allowed pods, other burst nodes; to the gateway only :443.
    assert "ip daddr { 10.96.0.10/32, 10.100.0.0/16 } accept" in rules
    assert "ip daddr { 10.244.0.0/16 } accept" in rules
    assert 'oifname "kg" ip daddr 10.245.0.0/16 accept' in rules
    assert "elements = { 169.254.0.0/16, 192.168.0.0/16 }" in rules
    assert "ip daddr 10.250.0.1 tcp dport 443 accept" in rules
    assert "ip daddr { 10.96.0.0/12 } accept" not in rules
