"""Issue 21, the on-prem agent: it joins only the gateway its own configuration pins for the claiming cluster
(never the one the claim's user data names), refuses routes outside that cluster's CIDRs, and leaving a cluster
stops the kubelet and wireguard-go and empties the kubelet's directory. The hub is a stand-in here (the hub's
side is tests/hub/test_pool_credentials.py); the gateways are real HTTPS/HTTP servers on loopback."""

from __future__ import annotations

import http.server
import json
import os
import signal
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from models.join import render_user_data
from models.labels import Taint
from node.onprem_agent import Agent
from node.onprem_agent import AgentConfig
from node.pinned import GatewayPin
from tests.harness.controlplane import _issue
from tests.harness.controlplane import _name
from tests.harness.controlplane import free_port
from tests.harness.onprem import TEST_ROUTES
from tests.harness.quiet_http import QuietHandler

CLUSTER = "prod-eu"
TAINT = Taint(key="gpu.kubeon.io/burst")


class Recorder(QuietHandler):
    seen: list[dict[str, str]]
    answer: dict[str, Any] | None = None

    def do_POST(self) -> None:
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps(type(self).answer or {"error": "nope", "message": "rogue"}).encode()
        self.reply(200 if type(self).answer else 403, body, "application/json")


def serve(handler: type[Recorder], *, tls: tuple[Path, Path] | None = None) -> tuple[http.server.HTTPServer, int]:
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), handler)
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


class FakeHub:
    """The hub's answers to the agent's heartbeats: the claim, then (taken up) its user data and signed claim."""

    def __init__(self, user_data: str, cluster: str = CLUSTER) -> None:
        self.user_data, self.cluster = user_data, cluster
        self.bodies: list[dict[str, Any]] = []

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        claim = None
        if not (body["phase"] == "idle" and body["operation"] == "op-1"):  # not left or declined
            taken = body["phase"] == "joining"
            claim = {"operation": "op-1", "cluster": self.cluster, "policy": "p", "node_name": "burst-op-1",
                     "user_data": self.user_data if taken else None, "pool_claim": "kpc1.e30.c2ln" if taken else None}
        return {"server": "gpu-a", "pool": "dc1", "state": "claimed", "claim": claim, "heartbeat_seconds": 1}

    def close(self) -> None:
        pass


def agent_for(tmp_path: Path, hub: FakeHub, pins: dict[str, GatewayPin], *, simulated: bool = True, **extra: Any
              ) -> Agent:
    (tmp_path / "state").mkdir(exist_ok=True)
    credential = tmp_path / "state" / "server-credential"
    credential.write_text("kgs_0123456789abcdef_" + "s" * 43)
    enrolment = tmp_path / "enrolment-token"
    enrolment.write_text("kgp_0123456789abcdef_" + "p" * 43)
    cfg = AgentConfig(hub_url="http://127.0.0.1:9", join_token_file=enrolment, pool="dc1", server="gpu-a",
                      gpu_product="NVIDIA-L4", gpus=1, state_file=tmp_path / "state" / "state.json",
                      credentials_dir=tmp_path / "state" / "credentials", gateways=pins, simulated=simulated,
                      heartbeat_seconds=1, **extra)
    agent = Agent(cfg)
    agent.hub = hub  # type: ignore[assignment]
    return agent


@pytest.fixture
def rogue(tmp_path: Path) -> Iterator[tuple[str, str, type[Recorder]]]:
    """A gateway of the attacker's, on 127.0.0.1 with its own CA: what a cluster token holder's claim names."""
    ca = _issue(_name("rogue-ca"), None, is_ca=True)
    cert = _issue(_name("127.0.0.1"), ca, server_ips=("127.0.0.1",))
    crt, key = cert.write(tmp_path, "rogue")
    from cryptography.hazmat.primitives import serialization

    ca_pem = ca.cert.public_bytes(serialization.Encoding.PEM).decode()
    handler: type[Recorder] = type("Rogue", (Recorder,), {"seen": []})
    server, port = serve(handler, tls=(crt, key))
    try:
        yield f"https://127.0.0.1:{port}", ca_pem, handler
    finally:
        server.shutdown()


def test_h3_a_claim_naming_a_rogue_gateway_is_refused_and_no_token_is_sent(
        tmp_path: Path, rogue: tuple[str, str, type[Recorder]]) -> None:
    url, ca_pem, handler = rogue
    user_data = render_user_data(gateway_url=url, ticket="t.t", node_name="burst-op-1", labels={}, taints=[TAINT],
                                 ca_bundle=ca_pem)
    real = f"https://127.0.0.1:{free_port()}"  # the cluster's gateway, as this server's operator configured it
    hub = FakeHub(user_data)
    agent = agent_for(tmp_path, hub, {CLUSTER: GatewayPin(CLUSTER, real, allowed_routes=_routes())})
    agent.step()
    assert handler.seen == []  # nothing reached the rogue gateway: no pool claim, no token, no ticket
    assert agent.state.phase == "idle"
    assert hub.bodies[-1]["phase"] == "idle" and hub.bodies[-1]["operation"] == "op-1"  # reported: the hub frees it
    assert not (agent.cfg.credentials_dir / "node-state" / "join-answer.json").exists()


def test_h3_a_claim_by_a_cluster_the_server_is_not_configured_for_is_declined(
        tmp_path: Path, rogue: tuple[str, str, type[Recorder]]) -> None:
    url, ca_pem, handler = rogue
    user_data = render_user_data(gateway_url=url, ticket="t.t", node_name="burst-op-1", labels={}, taints=[TAINT],
                                 ca_bundle=ca_pem)
    hub = FakeHub(user_data, cluster="someone-else")
    agent = agent_for(tmp_path, hub, {CLUSTER: GatewayPin(CLUSTER, url, allowed_routes=_routes())})
    agent.step()
    assert handler.seen == [] and agent.state.phase == "idle"
    assert [b["phase"] for b in hub.bodies] == ["idle", "idle"]  # never took it up: it never got the ticket


def _routes() -> tuple[Any, ...]:
    import ipaddress

    return tuple(ipaddress.ip_network(c) for c in TEST_ROUTES)


def _answer(**tunnel: Any) -> dict[str, Any]:
    return {"nodeName": "burst-op-1", "certificate": "x", "caBundle": "x", "apiServer": "https://10.96.0.1:443",
            "podCIDR": "10.245.3.0/24", "labels": {}, "taints": [],
            "tunnel": {"gatewayPublicKey": "k", "endpoint": "192.0.2.1:51820", "address": "10.250.0.5/32",
                       "gatewayAddress": "10.250.0.1", "mtu": 1380, "persistentKeepalive": 25,
                       "allowedIPs": ["10.250.0.1/32", "10.96.0.0/12", "10.245.0.0/16"], **tunnel}}


@pytest.mark.parametrize(("change", "named"), [
    ({"allowedIPs": ["10.250.0.1/32", "192.168.0.0/16"]}, "allowedIPs 192.168.0.0/16"),  # the management network
    ({"allowedIPs": ["0.0.0.0/0"]}, "allowedIPs 0.0.0.0/0"),
    ({"address": "192.168.1.7/32"}, "tunnel address"),
])
def test_h3_routes_outside_the_clusters_cidrs_are_refused_before_anything_is_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], named: str,
        caplog: pytest.LogCaptureFixture) -> None:
    import node.join

    applied: list[str] = []
    monkeypatch.setattr(node.join, "bring_up_tunnel", lambda *a, **k: applied.append("tunnel"))
    monkeypatch.setattr(node.join, "write_kubeconfig", lambda *a, **k: applied.append("kubeconfig"))
    handler: type[Recorder] = type("Gateway", (Recorder,), {"seen": [], "answer": _answer(**change)})
    server, port = serve(handler)
    try:
        url = f"http://127.0.0.1:{port}"
        user_data = render_user_data(gateway_url=url, ticket="t.t", node_name="burst-op-1", labels={},
                                     taints=[TAINT])
        hub = FakeHub(user_data)
        agent = agent_for(tmp_path, hub, {CLUSTER: GatewayPin(CLUSTER, url, allowed_routes=_routes())},
                          simulated=False, interface="kbtest0", kubelet_stop_command="")
        agent.step()
    finally:
        server.shutdown()
    assert applied == []  # no route, no address, no kubeconfig pointing anywhere
    assert len(handler.seen) == 1 and handler.seen[0]["x-kubeon-pool-claim"] == "kpc1.e30.c2ln"
    assert "x-kubeon-join-token" not in handler.seen[0]  # the pool's token never leaves the server
    assert agent.state.phase == "idle" and hub.bodies[-1] == {**hub.bodies[-1], "phase": "idle", "operation": "op-1"}
    assert named in caplog.text


def test_l6_leaving_stops_kubelet_and_wireguard_go_and_empties_the_kubelet_dir(tmp_path: Path) -> None:
    wg = tmp_path / "bin" / "wireguard-go"
    wg.parent.mkdir()
    wg.symlink_to("/bin/sleep")
    kubelet_dir = tmp_path / "var-lib-kubelet"
    (kubelet_dir / "pods" / "uid-1" / "volumes").mkdir(parents=True)
    (kubelet_dir / "pods" / "uid-1" / "volumes" / "secret-token").write_text("the last tenant's")
    (kubelet_dir / "cpu_manager_state").write_text("{}")
    agent = agent_for(tmp_path, FakeHub(""), {}, kubelet_dir=kubelet_dir)
    node_dir = agent.cfg.credentials_dir / "node-state"
    node_dir.mkdir(parents=True)
    procs = {name: subprocess.Popen([str(cmd), "300"], start_new_session=True)
             for name, cmd in (("kubelet", "/bin/sleep"), ("wireguard-go", wg))}
    try:
        for name, proc in procs.items():
            (node_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
        agent.state.phase, agent.state.operation = "serving", "op-1"
        agent._leave()  # the hub released the server: it moves on to another cluster
        for name, proc in procs.items():
            assert proc.wait(timeout=10) is not None, f"{name} still running"
        assert kubelet_dir.is_dir() and list(kubelet_dir.iterdir()) == []
        assert not agent.cfg.credentials_dir.exists()
        assert agent.state.phase == "idle" and agent.state.left == "op-1"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_l6_a_reused_pid_of_another_program_is_left_alone(tmp_path: Path) -> None:
    agent = agent_for(tmp_path, FakeHub(""), {})
    node_dir = agent.cfg.credentials_dir / "node-state"
    node_dir.mkdir(parents=True)
    other = subprocess.Popen(["/bin/sleep", "300"], start_new_session=True)  # not wireguard-go
    try:
        (node_dir / "wireguard-go.pid").write_text(f"{other.pid}\n")
        agent._leave()
        assert other.poll() is None
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
