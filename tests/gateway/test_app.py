"""The burst gateway as a real process (``python -m gateway.main``) on loopback, against the real control
plane: the gateway with its own ServiceAccount, the optimizer with its own token (TokenRequest), burst nodes
joining over HTTP with the ticket as their only credential; and over HTTPS with the certificate the Helm chart
generates, reached by the names it is issued for."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.clients.gateway import IN_CLUSTER_TOKEN_FILE
from activities.clients.gateway import GatewayRefused
from activities.clients.gateway import GatewayUnavailable
from activities.clients.gateway import HttpGatewayClient
from activities.clients.gateway import TransportFactory
from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.service import KubeGateway
from gateway.settings import ConfigError
from gateway.settings import GatewayServerConfig
from gateway.settings import load_settings as load_gateway_settings
from models.errors import AddressesExhausted
from models.errors import TicketError
from models.join import GpuHealth
from models.join import parse_user_data
from models.join import render_user_data
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.node import Instance
from models.node import NodePhase
from node.join import JoinRefusedByGateway
from node.join import JoinUnavailable
from node.join import NodeFiles
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import NAMESPACE as CHART_NAMESPACE
from tests.charts.helm import template as helm_template
from tests.gateway.helpers import BURST_TAINT
from tests.gateway.helpers import CAPACITY
from tests.gateway.helpers import node_absent
from tests.gateway.helpers import ticket_request
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import approve_batch
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.controlplane import _issue
from tests.harness.controlplane import _name
from tests.harness.controlplane import free_port
from tests.harness.controlplane import write_kubeconfig
from tests.harness.joining import join_over_http
from tests.harness.joining import join_with_user_data
from tests.harness.joining import redeem_for
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.processes import answers_ok
from tests.harness.processes import stop_process
from tests.harness.rbac import GATEWAY_RULES
from tests.harness.rbac import GATEWAY_SA
from tests.harness.rbac import GATEWAY_SERVICE_RULES
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA
from tests.harness.rbac import grant_optimizer_and_gateway
from worker.config import load_settings
from worker.main import worker_services
from worker.runtime import build_gateway

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent.parent
GATEWAY_USER = f"system:serviceaccount:{OPTIMIZER_NAMESPACE}:{GATEWAY_SA}"
OPTIMIZER_USER = f"system:serviceaccount:{OPTIMIZER_NAMESPACE}:{OPTIMIZER_SA}"
# What the gateway needs beyond node rules: verifying the optimizer's token.
TOKENREVIEW_RULE = {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
GATEWAY_AUDIENCE = "kubeon-gpu-gateway"


def gateway_rules() -> list[dict[str, list[str]]]:
    return GATEWAY_RULES + ([] if TOKENREVIEW_RULE in GATEWAY_RULES else [TOKENREVIEW_RULE])


def mint_token(cluster: Cluster, name: str, audiences: list[str] | None = None) -> str:
    """A ServiceAccount token from the TokenRequest API, as the kubelet projects one into a pod."""
    return cluster.service_account_token(OPTIMIZER_NAMESPACE, name, audiences=audiences)


def can(cluster: Cluster, user: str, verb: str, resource: str, group: str = "") -> bool:
    sar = client.AuthorizationV1Api(cluster.admin.api).create_subject_access_review(client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(user=user, resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=resource, group=group, namespace=None))))
    return bool(sar.status.allowed)


@dataclass
class GatewayProcess:
    """``python -m gateway.main`` on free loopback ports; stopped with SIGTERM, nothing left behind."""

    workdir: Path
    env: dict[str, str]
    name: str = "gateway"
    url: str = ""
    health_url: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> str:
        return (self.workdir / f"{self.name}.log").read_text(errors="replace")

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        port, health = free_port(), free_port()
        scheme = "https" if "KUBEON_GATEWAY_TLS_CERT_FILE" in self.env else "http"
        self.url, self.health_url = f"{scheme}://127.0.0.1:{port}", f"http://127.0.0.1:{health}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEON_")}
        env.update({"PYTHONUNBUFFERED": "1", "KUBEON_CLUSTER": "test", "KUBEON_GATEWAY_LISTEN": f"127.0.0.1:{port}",
                    "KUBEON_HEALTH_PORT": str(health), **self.env})
        with open(self.workdir / f"{self.name}.log", "wb") as log:
            self._proc = proc = subprocess.Popen([sys.executable, "-m", "gateway.main"], env=env, cwd=ROOT,
                                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
        try:
            wait_for(lambda: answers_ok(proc, f"{self.health_url}/readyz", name=f"gateway {self.name}",
                                        log=lambda: self.log),
                     timeout=timeout, what=f"gateway {self.name} /readyz")
        except AssertionError:
            self.stop()
            raise
        return self

    def readyz(self) -> dict[str, Any]:
        response = httpx.get(f"{self.health_url}/readyz", timeout=5)
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc

    def stop(self, timeout: float = 20.0) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        stop_process(proc, timeout, group=True)
        return proc.returncode


@dataclass
class Setup:
    cluster: Cluster
    workdir: Path
    gateway_kubeconfig: Path
    ticket_key: bytes
    ticket_key_file: Path
    optimizer_token_file: Path


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    workdir = tmp_path_factory.mktemp("gateway")
    grant_optimizer_and_gateway(cluster, gateway_rules())
    wait_for(lambda: can(cluster, GATEWAY_USER, "create", "tokenreviews", "authentication.k8s.io"),
             what="the gateway's tokenreviews rule in effect")
    key = secrets.token_hex(32).encode()
    key_file = workdir / "ticket.key"
    key_file.write_bytes(key + b"\n")
    token_file = workdir / "optimizer.token"
    token_file.write_text(mint_token(cluster, OPTIMIZER_SA))
    return Setup(cluster=cluster, workdir=workdir,
                 gateway_kubeconfig=cluster.service_account_kubeconfig(OPTIMIZER_NAMESPACE, GATEWAY_SA, create=False),
                 ticket_key=key, ticket_key_file=key_file, optimizer_token_file=token_file)


@pytest.fixture(scope="module")
def gateway(setup: Setup) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
    }).start()
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code in (0, -signal.SIGTERM), f"gateway exited {code}:\n{proc.log}"


@pytest.fixture
def optimizer(gateway: GatewayProcess, setup: Setup) -> Iterator[HttpGatewayClient]:
    http = HttpGatewayClient(gateway.url, setup.optimizer_token_file)
    yield http
    http.close()


def join_raw(gateway: GatewayProcess, ticket: str, node: str = "burst-x", **extra: Any) -> httpx.Response:
    """POST /v1/join with a well-formed request of fresh keys (``extra`` overrides its fields)."""
    files = NodeFiles(Path(f"/tmp/kubeon-test-nodes/raw-{uuid.uuid4().hex}"))
    body = {**redeem_for(files, ticket, node).model_dump(mode="json", by_alias=True), **extra}
    return httpx.post(f"{gateway.url}/v1/join", json=body, timeout=30)


# ----- who the gateway is ------------------------------------------------------------------------------------


def test_gateway_acts_with_its_own_service_account_not_admin(gateway: GatewayProcess, setup: Setup) -> None:
    assert gateway.readyz()["identity"] == GATEWAY_USER
    assert f"acting as {GATEWAY_USER}" in gateway.log
    assert httpx.get(f"{gateway.health_url}/healthz", timeout=5).json() == {"status": "ok"}
    # What that identity may do: kubelet CSRs, patch and delete nodes, token reviews; it creates no Node.
    assert not can(setup.cluster, GATEWAY_USER, "create", "nodes")
    assert can(setup.cluster, GATEWAY_USER, "delete", "nodes")
    assert can(setup.cluster, GATEWAY_USER, "create", "certificatesigningrequests", "certificates.k8s.io")
    assert can(setup.cluster, GATEWAY_USER, "create", "tokenreviews", "authentication.k8s.io")
    for verb, resource in (("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("delete", "pods"),
                           ("create", "clusterrolebindings")):
        group = "rbac.authorization.k8s.io" if resource == "clusterrolebindings" else ""
        assert not can(setup.cluster, GATEWAY_USER, verb, resource, group), (verb, resource)
    # And the optimizer itself may not create or delete Nodes: only the gateway does.
    assert not can(setup.cluster, OPTIMIZER_USER, "create", "nodes")
    assert not can(setup.cluster, OPTIMIZER_USER, "delete", "nodes")
    # No secret reached the log.
    assert setup.ticket_key.decode() not in gateway.log
    assert setup.optimizer_token_file.read_text() not in gateway.log


# ----- tickets, joins and removals ---------------------------------------------------------------------------


def test_ticket_join_and_remove_over_http(gateway: GatewayProcess, optimizer: HttpGatewayClient, setup: Setup,
                                          nodes: list[str]) -> None:
    cluster = setup.cluster
    req = ticket_request(nodes)
    grant = optimizer.issue_ticket(req)
    ticket = grant.ticket
    assert ticket and setup.optimizer_token_file.read_text() not in ticket
    # No public URL and no Service configured (in-process and dev set-ups): the worker's own URL stands.
    assert (grant.endpoint, grant.server_name) == ("", "")

    # A booting burst node joins with nothing but the ticket (and its own keys), then registers itself.
    provider_id = f"sim://sim/eu-west/i-{req.node_name}"
    assert join_over_http(gateway.url, ticket, CAPACITY, KWOK_ANNOTATIONS, provider_id) == req.node_name
    node = cluster.admin.core.read_node(req.node_name)
    assert node.metadata.labels[LABEL_OPERATION] == req.operation
    assert node.metadata.labels[LABEL_LOCATION] == "sim.eu-west"
    assert node.metadata.labels[LABEL_POLICY] == "inference-burst"
    assert (BURST_TAINT, "NoSchedule") in [(t.key, t.effect) for t in node.spec.taints]
    assert node.spec.provider_id == provider_id
    assert node.metadata.managed_fields[0].manager != "kubeon-gateway"
    wait_for(lambda: cluster.node_ready(req.node_name), what=f"{req.node_name} Ready (kwok)")
    # The gateway's reconciler checks it against its ticket and lifts the joining taint.
    wait_for(lambda: {t.key for t in cluster.admin.core.read_node(req.node_name).spec.taints} == {BURST_TAINT},
             what="the joining taint lifted")
    # The node retries its join (lost answer, same keys): same Node.
    assert join_over_http(gateway.url, ticket, CAPACITY, KWOK_ANNOTATIONS, provider_id) == req.node_name
    assert cluster.admin.core.read_node(req.node_name).metadata.uid == node.metadata.uid
    # Another ticket for the same node name is refused: one node per name, one ticket per node.
    second = optimizer.issue_ticket(req).ticket
    with pytest.raises(JoinRefusedByGateway, match="already joined with another ticket") as refused:
        join_over_http(gateway.url, second, CAPACITY, KWOK_ANNOTATIONS, provider_id)
    assert refused.value.status == 409

    # Removal: only by the operation that owns it.
    with pytest.raises(TicketError, match="has no address slot of operation op-someone-else"):
        optimizer.remove_node(req.node_name, operation="op-someone-else")
    response = httpx.delete(f"{gateway.url}/v1/nodes/{req.node_name}", params={"operation": "op-someone-else"},
                            headers={"Authorization": f"Bearer {setup.optimizer_token_file.read_text()}"})
    assert response.status_code == 409
    assert response.json()["error"] == "not_owned"
    assert cluster.admin.core.read_node(req.node_name).metadata.uid == node.metadata.uid

    assert optimizer.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    assert optimizer.remove_node(req.node_name, operation=req.operation) is False
    # The ticket, still within its lifetime and readable in the instance's user data, is never good again.
    replay = join_raw(gateway, ticket, req.node_name)
    assert replay.status_code == 403 and replay.json()["error"] == "ticket_replayed", replay.text
    assert node_absent(cluster, req.node_name)


def test_forged_expired_and_garbage_tickets_are_403(gateway: GatewayProcess, optimizer: HttpGatewayClient,
                                                    setup: Setup, nodes: list[str]) -> None:
    api = client.ApiClient()  # never used: issuing a ticket makes no API call
    req = ticket_request(nodes)
    good = optimizer.issue_ticket(req).ticket
    body, _, sig = good.partition(".")
    forged = {
        "tampered body": f"{body[:-4]}AAAA.{sig}",
        "another key": KubeGateway(api, secrets.token_bytes(32)).sign_ticket(req),
        "garbage": "not-a-ticket",
        # Signed with the real key but long expired (an injected clock at the epoch).
        "expired": KubeGateway(api, setup.ticket_key, clock=lambda: 0.0).sign_ticket(req),
    }
    for what, ticket in forged.items():
        response = join_raw(gateway, ticket, req.node_name)
        assert response.status_code == 403, (what, response.text)
        doc = response.json()
        assert doc["error"] == ("ticket_expired" if what == "expired" else "ticket_invalid"), what
        assert ("expired" if what == "expired" else "signature is invalid") in doc["message"], (what, doc)
        with pytest.raises(JoinRefusedByGateway) as refused:
            join_over_http(gateway.url, ticket, CAPACITY, KWOK_ANNOTATIONS, "", node_name=req.node_name)
        assert refused.value.status == 403
    assert node_absent(setup.cluster, req.node_name)
    assert "Traceback" not in gateway.log


def test_metrics_count_joins_by_outcome_and_carry_no_ticket(gateway: GatewayProcess, optimizer: HttpGatewayClient,
                                                            nodes: list[str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.harness.dashboard import dashboard_metric_names

    def scrape() -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
        response = httpx.get(f"{gateway.health_url}/metrics", timeout=5)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(response.text) for s in f.samples}
        return response.text, samples

    def joins(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], outcome: str) -> float:
        return samples.get(("kubeon_gateway_joins_total", (("outcome", outcome),)), 0.0)

    _, before = scrape()
    req = ticket_request(nodes)
    ticket = optimizer.issue_ticket(req).ticket
    assert join_over_http(gateway.url, ticket, CAPACITY, KWOK_ANNOTATIONS, "") == req.node_name
    assert join_raw(gateway, "not-a-ticket").status_code == 403
    assert join_raw(gateway, ticket, capacity="lots").status_code == 400
    text, after = scrape()
    assert {o: joins(after, o) - joins(before, o) for o in ("admitted", "refused", "invalid")} == {
        "admitted": 1, "refused": 1, "invalid": 1}
    tickets = ("kubeon_gateway_requests_total", (("code", "201"), ("route", "/v1/tickets")))
    issued = after.get(tickets, 0.0) + after.get((tickets[0], (("code", "200"), ("route", "/v1/tickets"))), 0.0)
    assert issued >= 1
    assert ticket not in text and req.node_name not in text  # labels name routes and outcomes, no IDs
    names = {name for name, _ in after}
    missing = {n for n in dashboard_metric_names() if n.startswith("kubeon_gateway_")} - names
    assert not missing, sorted(missing)


def test_join_bodies_are_checked_and_refusals_name_the_cause(gateway: GatewayProcess, optimizer: HttpGatewayClient,
                                                              setup: Setup, nodes: list[str]) -> None:
    req = ticket_request(nodes)
    ticket = optimizer.issue_ticket(req).ticket
    # A CSR for another node, a malformed WireGuard key, wrong usages: 400 naming the cause, nothing admitted.
    other = join_raw(gateway, ticket, "control-plane-1")
    assert other.status_code == 400 and other.json()["error"] == "csr_invalid"
    assert f"CN=system:node:{req.node_name}" in other.json()["message"]
    key = join_raw(gateway, ticket, req.node_name, wireguardPublicKey="not-a-key")
    assert key.status_code == 400 and key.json()["error"] == "wireguard_key_invalid"
    assert "wireguardPublicKey" in key.json()["message"]
    usages = join_raw(gateway, ticket, req.node_name, usages=["digital signature", "server auth"])
    assert usages.status_code == 400 and "usages" in usages.json()["message"]
    extra = join_raw(gateway, ticket, req.node_name, capacity={"cpu": "8"})
    assert extra.status_code == 400 and "capacity" in extra.json()["message"]
    assert node_absent(setup.cluster, req.node_name)

    # Missing fields, not JSON, too big (by Content-Length and chunked): clear 4xx answers, never a 500.
    missing = httpx.post(f"{gateway.url}/v1/join", json={"ticket": ticket}, timeout=10)
    assert missing.status_code == 400 and "wireguardPublicKey" in missing.json()["message"]
    not_json = httpx.post(f"{gateway.url}/v1/join", content=b"{nope", timeout=10,
                          headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400
    huge = httpx.post(f"{gateway.url}/v1/join", json={"ticket": "x" * 100_000}, timeout=10)
    assert huge.status_code == 413 and huge.json()["error"] == "body_too_large"
    assert "the limit is 65536 bytes" in huge.json()["message"]

    def chunks() -> Iterator[bytes]:
        yield b'{"ticket": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    chunked = httpx.post(f"{gateway.url}/v1/join", content=chunks(), timeout=10,
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and "the limit is 65536 bytes" in chunked.json()["message"]
    assert httpx.get(f"{gateway.url}/v1/nope", timeout=10).status_code == 404
    # Then the node joins properly with the same ticket.
    assert join_over_http(gateway.url, ticket, CAPACITY, KWOK_ANNOTATIONS, "") == req.node_name
    assert "Traceback" not in gateway.log


def test_ticket_requests_must_be_for_tainted_removable_burst_nodes(optimizer: HttpGatewayClient,
                                                                   nodes: list[str]) -> None:
    req = ticket_request(nodes)
    cases = {
        "untainted": req.model_copy(update={"taints": []}),
        "another operation's label": req.model_copy(update={"labels": {**req.labels, LABEL_OPERATION: "op-x"}}),
        "a control-plane role": req.model_copy(update={
            "labels": {**req.labels, "node-role.kubernetes.io/control-plane": ""}}),
        "a bad node name": req.model_copy(update={"node_name": "Not_A_Node"}),
        "a week-long ticket": req.model_copy(update={"ttl_seconds": 7 * 24 * 3600}),
    }
    for what, bad in cases.items():
        with pytest.raises(GatewayRefused, match="join ticket refused") as refused:
            optimizer.issue_ticket(bad)
        assert refused.value.status == 400, what


# ----- who may ask ---------------------------------------------------------------------------------------------


def test_only_the_optimizer_may_ask_for_tickets_and_removals(gateway: GatewayProcess, setup: Setup,
                                                             nodes: list[str]) -> None:
    req = ticket_request(nodes)
    body = req.model_dump(mode="json")
    url = f"{gateway.url}/v1/tickets"

    none = httpx.post(url, json=body, timeout=10)
    assert none.status_code == 401, none.text
    assert none.json()["error"] == "unauthorized" and "Authorization" in none.json()["message"]
    assert none.headers["WWW-Authenticate"].startswith("Bearer")
    assert httpx.post(url, json=body, headers={"Authorization": "Basic b3B0aW1pemVy"}, timeout=10).status_code == 401
    forged = httpx.post(url, json=body, headers={"Authorization": "Bearer not.a.token"}, timeout=10)
    assert forged.status_code == 401 and "not accepted" in forged.json()["message"]

    # Another ServiceAccount's perfectly valid token: authenticated, but not the optimizer.
    other = f"random-{uuid.uuid4().hex[:6]}"
    setup.cluster.admin.core.create_namespaced_service_account(OPTIMIZER_NAMESPACE, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name=other)))
    other_file = setup.workdir / f"{other}.token"
    other_file.write_text(mint_token(setup.cluster, other))
    intruder = HttpGatewayClient(gateway.url, other_file)
    try:
        with pytest.raises(GatewayRefused, match=f"system:serviceaccount:{OPTIMIZER_NAMESPACE}:{other} may not use"
                           ) as refused:
            intruder.issue_ticket(req)
        assert refused.value.status == 403
        with pytest.raises(GatewayRefused) as refused:
            intruder.remove_node(req.node_name, operation=req.operation)
        assert refused.value.status == 403
    finally:
        intruder.close()
    # The gateway's own token is no optimizer's either.
    own = setup.workdir / "gateway.token"
    own.write_text(mint_token(setup.cluster, GATEWAY_SA))
    with HttpGatewayClient(gateway.url, own) as gw_itself, pytest.raises(GatewayRefused, match="may not use"):
        gw_itself.issue_ticket(req)

    delete = httpx.delete(f"{gateway.url}/v1/nodes/{req.node_name}", params={"operation": req.operation})
    assert delete.status_code == 401
    # The token file is read on each call (projected tokens rotate): a new token works at once.
    rotating = setup.workdir / "rotating.token"
    rotating.write_text("stale")
    with HttpGatewayClient(gateway.url, rotating) as http:
        with pytest.raises(GatewayRefused, match="not accepted") as refused:
            http.issue_ticket(req)
        assert refused.value.status == 401
        rotating.write_text(mint_token(setup.cluster, OPTIMIZER_SA))
        assert http.issue_ticket(req)
    assert node_absent(setup.cluster, req.node_name)
    assert "refused POST /v1/tickets from system:serviceaccount" in gateway.log


def delete_slots(cluster: Cluster) -> None:
    for cm in cluster.admin.core.list_namespaced_config_map(
            OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items:
        with contextlib.suppress(client.ApiException):
            cluster.admin.core.delete_namespaced_config_map(str(cm.metadata.name), OPTIMIZER_NAMESPACE)


def test_tickets_reserve_address_slots_and_capacity_says_how_many_are_free(setup: Setup, nodes: list[str]) -> None:
    """A gateway with 4 slots (pod CIDR /28 in /30s): 4 tickets hold them all, GET /v1/capacity says so, the
    fifth ticket is refused (503 addresses_exhausted, AddressesExhausted in the client), a removal frees one."""
    delete_slots(setup.cluster)  # other tests' reservations in the same namespace: this gateway starts empty
    small = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_POD_CIDR": "10.245.0.0/28", "KUBEON_GATEWAY_NODE_CIDR_MASK": "30",
    }, name="gateway-4-slots").start()
    try:
        with HttpGatewayClient(small.url, setup.optimizer_token_file) as http:
            assert (http.capacity().total, http.capacity().held) == (4, 0)
            reqs = [ticket_request(nodes) for _ in range(4)]
            for req in reqs:
                http.issue_ticket(req)
            room = http.capacity()
            assert (room.total, room.held, room.free) == (4, 4, 0)
            assert room.nodes == sorted(r.node_name for r in reqs)
            extra = ticket_request(nodes)
            with pytest.raises(AddressesExhausted, match="all 4 address slots") as refused:
                http.issue_ticket(extra)
            assert "10.245.0.0/28" in str(refused.value) and "KUBEON_GATEWAY_NODE_CIDR_MASK" in str(refused.value)
            raw = httpx.post(f"{small.url}/v1/tickets", json=extra.model_dump(mode="json"), timeout=10,
                             headers={"Authorization": f"Bearer {setup.optimizer_token_file.read_text()}"})
            assert raw.status_code == 503 and raw.json()["error"] == "addresses_exhausted"
            assert http.remove_node(reqs[0].node_name, operation=reqs[0].operation) is False  # never joined
            assert http.capacity().held == 3
            assert http.issue_ticket(extra).ticket
            assert http.capacity().free == 0
        # Capacity is the optimizer's to ask, as tickets are.
        assert httpx.get(f"{small.url}/v1/capacity", timeout=10).status_code == 401
    finally:
        small.stop()
        delete_slots(setup.cluster)
    assert "Traceback" not in small.log


# ----- failures the client must name ---------------------------------------------------------------------------


def test_client_errors_name_the_gateway(setup: Setup, nodes: list[str]) -> None:
    req = ticket_request(nodes)
    nothing = f"http://127.0.0.1:{free_port()}"
    with HttpGatewayClient(nothing, setup.optimizer_token_file, timeout=5) as http, \
            pytest.raises(GatewayUnavailable, match=f"burst gateway {nothing}: .*cannot connect"):
        http.issue_ticket(req)
    with pytest.raises(JoinUnavailable, match=nothing):
        join_over_http(nothing, "t", CAPACITY, KWOK_ANNOTATIONS, "")
    with HttpGatewayClient(nothing, setup.workdir / "no-such-token") as http, \
            pytest.raises(Exception, match="cannot read the ServiceAccount token"):
        http.remove_node("n", operation="op-x")

    # A gateway whose Kubernetes API is unreachable answers 503 (the client: retryable), not 500.
    dead_api = write_kubeconfig(setup.workdir / "dead.kubeconfig", f"https://127.0.0.1:{free_port()}",
                                setup.cluster.plane.ca_file, token="x", user="gateway")
    cut_off = GatewayProcess(setup.workdir, {"KUBEON_GATEWAY_KUBECONFIG": str(dead_api),
                                             "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file)},
                             name="gateway-no-api").start()
    try:
        with HttpGatewayClient(cut_off.url, setup.optimizer_token_file) as http:
            with pytest.raises(GatewayUnavailable, match=f"burst gateway {cut_off.url}: .*HTTP 503.*unreachable"):
                http.issue_ticket(req)
            with pytest.raises(GatewayUnavailable, match="HTTP 503"):
                http.remove_node(req.node_name, operation=req.operation)
    finally:
        cut_off.stop()
    assert "Traceback" not in cut_off.log


def test_tls_and_a_gateway_only_token_audience(setup: Setup, nodes: list[str]) -> None:
    """HTTPS with the chart's cert/key files, and tokens projected for the gateway's audience only: a token
    for the API server is refused, so the gateway never holds one it could replay as the optimizer."""
    pki = setup.workdir / "pki"
    pki.mkdir(exist_ok=True)
    ca = _issue(_name("kubeon-gateway-ca"), None, is_ca=True)
    ca_file, _ = ca.write(pki, "ca")
    cert, key = _issue(_name("kubeon-gpu-optimizer-gateway"), ca, server_names=("localhost",),
                       server_ips=("127.0.0.1",)).write(pki, "gateway")
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_TLS_CERT_FILE": str(cert), "KUBEON_GATEWAY_TLS_KEY_FILE": str(key),
        "KUBEON_GATEWAY_TOKEN_AUDIENCES": GATEWAY_AUDIENCE,
    }, name="gateway-tls").start()
    try:
        assert proc.url.startswith("https://")
        audience_token = setup.workdir / "audience.token"
        audience_token.write_text(mint_token(setup.cluster, OPTIMIZER_SA, [GATEWAY_AUDIENCE]))
        req = ticket_request(nodes)
        with HttpGatewayClient(proc.url, audience_token, ca_file=ca_file) as http:
            ticket = http.issue_ticket(req).ticket
        assert join_over_http(proc.url, ticket, CAPACITY, KWOK_ANNOTATIONS, "", ca_file=ca_file) == req.node_name
        # The API server's audience (the default token): refused.
        with HttpGatewayClient(proc.url, setup.optimizer_token_file, ca_file=ca_file) as http, \
                pytest.raises(GatewayRefused, match="not accepted") as refused:
            http.issue_ticket(req)
        assert refused.value.status == 401
        # A client that does not trust the gateway's certificate does not talk to it.
        with HttpGatewayClient(proc.url, audience_token) as http, \
                pytest.raises(GatewayUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            http.issue_ticket(req)
        with HttpGatewayClient(proc.url, audience_token, ca_file=ca_file) as http:
            assert http.remove_node(req.node_name, operation=req.operation) is True
    finally:
        assert proc.stop() in (0, -signal.SIGTERM), proc.log


# ----- the chart's generated certificate, for real --------------------------------------------------------------

CHART_GATEWAY = "kubeon-gpu-optimizer-gateway"
SERVICE_HOST = f"{CHART_GATEWAY}.{CHART_NAMESPACE}.svc"  # the worker's KUBEON_GATEWAY_URL host
PUBLIC_HOST = "burst-gw.example.com"  # burst.gateway.publicUrl in values-burst.yaml


class _FixedAddresses(httpcore.NetworkBackend):
    """Name resolution as the cluster's DNS (or the public DNS name) would answer, to the loopback gateway. Only
    the TCP connection goes to the address: TLS still sends the name (SNI) and checks the certificate against it."""

    def __init__(self, hosts: Mapping[str, str]) -> None:
        self._hosts = dict(hosts)
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        if host not in self._hosts:
            raise httpcore.ConnectError(f"{host}: no such host here")
        return self._backend.connect_tcp(self._hosts[host], port, timeout, local_address, socket_options)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("no unix sockets here")

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _ResolvingTransport(httpx.BaseTransport):
    """httpx over httpcore's public API with ``_FixedAddresses``, verifying TLS as the client decided."""

    def __init__(self, verify: ssl.SSLContext | bool, hosts: Mapping[str, str]) -> None:
        context = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
        assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
        self._pool = httpcore.ConnectionPool(ssl_context=context, network_backend=_FixedAddresses(hosts))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        core = httpcore.Request(method=request.method, url=httpcore.URL(
            scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
            target=request.url.raw_path), headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        try:
            response = self._pool.handle_request(core)
            try:
                content = response.read()
            finally:
                response.close()
        except httpcore.TimeoutException as exc:
            raise httpx.ReadTimeout(str(exc), request=request) from exc
        except httpcore.NetworkError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return httpx.Response(response.status, headers=response.headers, content=content,
                              extensions=response.extensions)

    def close(self) -> None:
        self._pool.close()


def chart_url(port: int) -> str:
    return f"https://{SERVICE_HOST}:{port}"


def resolving(*hosts: str) -> TransportFactory:
    return lambda verify: _ResolvingTransport(verify, dict.fromkeys(hosts, "127.0.0.1"))


@dataclass
class ChartTLS:
    gateway: GatewayProcess
    port: int
    ca_file: Path  # the worker's KUBEON_GATEWAY_CA_FILE: ca.crt of the ConfigMap

    def url(self, host: str) -> str:
        return f"https://{host}:{self.port}"


@pytest.fixture(scope="module")
def chart_tls(setup: Setup) -> Iterator[ChartTLS]:
    """`kubeon-gpu gateway` with the certificate and key `helm template` generates, as the chart mounts them."""
    rendered = helm_template(values=[BURST_VALUES])
    pki = setup.workdir / "chart-tls"
    pki.mkdir()
    secret = rendered.get("Secret", f"{CHART_GATEWAY}-tls", CHART_NAMESPACE)["data"]
    for key in ("tls.crt", "tls.key"):
        (pki / key).write_bytes(base64.b64decode(secret[key]))
    ca_file = pki / "ca.crt"
    ca_file.write_text(rendered.get("ConfigMap", f"{CHART_GATEWAY}-ca", CHART_NAMESPACE)["data"]["ca.crt"])
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_TLS_CERT_FILE": str(pki / "tls.crt"), "KUBEON_GATEWAY_TLS_KEY_FILE": str(pki / "tls.key"),
    }, name="gateway-chart-tls").start()
    try:
        yield ChartTLS(proc, int(proc.url.rsplit(":", 1)[1]), ca_file)
    finally:
        assert proc.stop() in (0, -signal.SIGTERM), proc.log


def test_worker_reaches_the_chart_gateway_by_its_service_name(chart_tls: ChartTLS, setup: Setup,
                                                              nodes: list[str]) -> None:
    with HttpGatewayClient(chart_tls.url(SERVICE_HOST), setup.optimizer_token_file, ca_file=chart_tls.ca_file,
                           transport=resolving(SERVICE_HOST)) as http:
        ticket = http.issue_ticket(ticket_request(nodes)).ticket
    assert ticket.count(".") == 1


def test_a_client_without_the_chart_ca_is_refused(chart_tls: ChartTLS, setup: Setup, nodes: list[str]) -> None:
    untrusted = r"CERTIFICATE_VERIFY_FAILED.*unable to get local issuer certificate"
    with HttpGatewayClient(chart_tls.url(SERVICE_HOST), setup.optimizer_token_file,
                           transport=resolving(SERVICE_HOST)) as http, \
            pytest.raises(GatewayUnavailable, match=untrusted):
        http.issue_ticket(ticket_request(nodes))


def test_a_name_the_chart_certificate_does_not_carry_is_refused(chart_tls: ChartTLS, setup: Setup,
                                                                nodes: list[str]) -> None:
    other = "gateway.elsewhere.example"
    mismatch = re.escape(f"Hostname mismatch, certificate is not valid for '{other}'")
    with HttpGatewayClient(chart_tls.url(other), setup.optimizer_token_file, ca_file=chart_tls.ca_file,
                           transport=resolving(other)) as http, pytest.raises(GatewayUnavailable, match=mismatch):
        http.issue_ticket(ticket_request(nodes))


def test_a_burst_node_joins_at_the_public_url_with_the_ca_from_its_user_data(chart_tls: ChartTLS, setup: Setup,
                                                                             nodes: list[str]) -> None:
    settings = load_settings({
        "KUBEON_CLUSTER": "test", "KUBEON_GATEWAY_URL": chart_tls.url(SERVICE_HOST),
        "KUBEON_GATEWAY_PUBLIC_URL": chart_tls.url(PUBLIC_HOST), "KUBEON_GATEWAY_CA_FILE": str(chart_tls.ca_file),
    })
    burst = settings.burst_config()
    req = ticket_request(nodes)
    with HttpGatewayClient(settings.gateway_url, setup.optimizer_token_file, ca_file=settings.gateway_ca_file,
                           transport=resolving(SERVICE_HOST)) as http:
        ticket = http.issue_ticket(req).ticket
    user_data = render_user_data(gateway_url=burst.gateway_url, ticket=ticket, node_name=req.node_name,
                                 labels=req.labels, taints=req.taints, ca_bundle=burst.gateway_ca_bundle)
    # The node knows only its user data: the public name (no Service name resolves there) and the CA in it.
    assert join_with_user_data(user_data, CAPACITY, KWOK_ANNOTATIONS, "",
                               transport=resolving(PUBLIC_HOST)) == req.node_name
    assert setup.cluster.admin.core.read_node(req.node_name).metadata.labels[LABEL_OPERATION] == req.operation


# ----- no publicUrl: the gateway's LoadBalancer address, verified as the Service name -------------------------


@dataclass
class LoadBalanced:
    gateway: GatewayProcess
    port: int
    ca_file: Path
    as_gateway: Kube  # the gateway's ServiceAccount


@pytest.fixture(scope="module")
def load_balanced(setup: Setup, chart_tls: ChartTLS) -> Iterator[LoadBalanced]:
    """`kubeon-gpu gateway` as the chart runs it without burst.gateway.publicUrl (R4.2's values): the chart's
    certificate, its own Service to read (KUBEON_GATEWAY_SERVICE), and the chart's namespaced Role for that; no
    Service exists yet (each test makes it)."""
    rendered = helm_template(values=[BURST_VALUES])
    admin = setup.cluster.admin
    role, binding = (rendered.get(kind, CHART_GATEWAY, CHART_NAMESPACE) for kind in ("Role", "RoleBinding"))
    assert role["rules"] == GATEWAY_SERVICE_RULES
    api = client.ApiClient()
    deserialize = api._ApiClient__deserialize  # type: ignore[attr-defined]
    for obj in (role, binding):
        obj["metadata"].pop("labels", None)
    # The chart's own Role and binding, not the setup's copy of the same rules.
    for delete in (admin.rbac.delete_namespaced_role_binding, admin.rbac.delete_namespaced_role):
        with contextlib.suppress(client.ApiException):
            delete(CHART_GATEWAY, CHART_NAMESPACE)
    admin.rbac.create_namespaced_role(CHART_NAMESPACE, deserialize(role, "V1Role"))
    admin.rbac.create_namespaced_role_binding(CHART_NAMESPACE, deserialize(binding, "V1RoleBinding"))
    pki = setup.workdir / "chart-tls"  # chart_tls wrote the chart's certificate, key and CA there
    env = {"KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
           "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
           "KUBEON_GATEWAY_TLS_CERT_FILE": str(pki / "tls.crt"), "KUBEON_GATEWAY_TLS_KEY_FILE": str(pki / "tls.key"),
           # What the chart's gateway Deployment sets with publicUrl empty.
           "KUBEON_GATEWAY_PUBLIC_URL": "", "KUBEON_GATEWAY_SERVICE": CHART_GATEWAY,
           "KUBEON_GATEWAY_SERVICE_NAMESPACE": CHART_NAMESPACE}
    proc = GatewayProcess(setup.workdir, env, name="gateway-load-balanced").start()
    try:
        yield LoadBalanced(proc, int(proc.url.rsplit(":", 1)[1]), chart_tls.ca_file,
                           setup.cluster.service_account_client(OPTIMIZER_NAMESPACE, GATEWAY_SA, create=False))
    finally:
        assert proc.stop() in (0, -signal.SIGTERM), proc.log


@pytest.fixture
def gateway_service(setup: Setup, load_balanced: LoadBalanced) -> Iterator[str]:
    """The gateway's LoadBalancer Service, its port the gateway's; no address until a test sets its status."""
    admin = setup.cluster.admin
    admin.core.create_namespaced_service(CHART_NAMESPACE, client.V1Service(
        metadata=client.V1ObjectMeta(name=CHART_GATEWAY),
        spec=client.V1ServiceSpec(type="LoadBalancer", selector={"app.kubernetes.io/component": "gateway"},
                                  ports=[client.V1ServicePort(name="tunnel", port=load_balanced.port,
                                                              target_port="tunnel")])))
    try:
        yield CHART_GATEWAY
    finally:
        admin.core.delete_namespaced_service(CHART_GATEWAY, CHART_NAMESPACE)
        wait_for(lambda: not admin.core.list_namespaced_service(
            CHART_NAMESPACE, field_selector=f"metadata.name={CHART_GATEWAY}").items, what="gateway Service gone")


def set_load_balancer_address(setup: Setup, ip: str) -> None:
    """What a cloud controller does once the load balancer exists (there is none here: admin patches the
    status subresource)."""
    setup.cluster.admin.core.patch_namespaced_service_status(
        CHART_GATEWAY, CHART_NAMESPACE, {"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}})


def test_the_gateways_role_gets_its_own_service_only(load_balanced: LoadBalanced, gateway_service: str,
                                                     setup: Setup) -> None:
    gw = load_balanced.as_gateway
    own = wait_for(lambda: gw.core.read_namespaced_service(gateway_service, CHART_NAMESPACE),
                   what="the gateway's Role in effect")
    assert own.spec.type == "LoadBalancer"
    other = f"other-{uuid.uuid4().hex[:6]}"
    setup.cluster.admin.core.create_namespaced_service(CHART_NAMESPACE, client.V1Service(
        metadata=client.V1ObjectMeta(name=other), spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)])))
    try:
        for call in (lambda: gw.core.read_namespaced_service(other, CHART_NAMESPACE),
                     lambda: gw.core.list_namespaced_service(CHART_NAMESPACE),
                     lambda: gw.core.patch_namespaced_service_status(gateway_service, CHART_NAMESPACE, {
                         "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}})):
            with pytest.raises(client.ApiException) as info:
                call()
            assert info.value.status == 403, info.value.body
    finally:
        setup.cluster.admin.core.delete_namespaced_service(other, CHART_NAMESPACE)
    assert not can(setup.cluster, OPTIMIZER_USER, "get", "services"), "the optimizer's rules (R5.1) are unchanged"


def test_no_ticket_until_the_load_balancer_has_an_address(load_balanced: LoadBalanced, setup: Setup,
                                                          nodes: list[str]) -> None:
    with HttpGatewayClient(chart_url(load_balanced.port), setup.optimizer_token_file, ca_file=load_balanced.ca_file,
                           transport=resolving(SERVICE_HOST)) as http:
        with pytest.raises(GatewayUnavailable, match=f"HTTP 503: reading the gateway's Service {CHART_GATEWAY} "
                                                     f"in {CHART_NAMESPACE}: it does not exist"):
            http.issue_ticket(ticket_request(nodes))
        setup.cluster.admin.core.create_namespaced_service(CHART_NAMESPACE, client.V1Service(
            metadata=client.V1ObjectMeta(name=CHART_GATEWAY),
            spec=client.V1ServiceSpec(type="LoadBalancer",
                                      ports=[client.V1ServicePort(name="tunnel", port=load_balanced.port)])))
        try:
            pending = f"gateway Service {CHART_GATEWAY} has no LoadBalancer address yet"
            with pytest.raises(GatewayUnavailable, match=f"HTTP 503: {pending}"):
                http.issue_ticket(ticket_request(nodes))
            context = ssl.create_default_context(cafile=str(load_balanced.ca_file))
            with httpx.Client(verify=context, transport=resolving(SERVICE_HOST)(context), timeout=10) as raw_client:
                raw = raw_client.post(f"{chart_url(load_balanced.port)}/v1/tickets",
                                      json=ticket_request(nodes).model_dump(mode="json"),
                                      headers={"Authorization": f"Bearer {setup.optimizer_token_file.read_text()}"})
            assert raw.status_code == 503 and raw.json()["error"] == "address_pending", raw.text
            assert raw.headers["Retry-After"] == "10"
            set_load_balancer_address(setup, "127.0.0.1")
            grant = http.issue_ticket(ticket_request(nodes))
            assert grant.endpoint == f"https://127.0.0.1:{load_balanced.port}"
        finally:
            setup.cluster.admin.core.delete_namespaced_service(CHART_GATEWAY, CHART_NAMESPACE)
    assert "Traceback" not in load_balanced.gateway.log


def test_a_node_joins_at_the_load_balancer_address_verifying_the_service_name(
        load_balanced: LoadBalanced, gateway_service: str, setup: Setup, nodes: list[str]) -> None:
    set_load_balancer_address(setup, "127.0.0.1")
    req = ticket_request(nodes)
    # The worker reaches the gateway by its Service name, as in the cluster.
    with HttpGatewayClient(chart_url(load_balanced.port), setup.optimizer_token_file, ca_file=load_balanced.ca_file,
                           transport=resolving(SERVICE_HOST)) as http:
        grant = http.issue_ticket(req)
    assert grant.endpoint == f"https://127.0.0.1:{load_balanced.port}"
    assert grant.server_name == SERVICE_HOST == f"{gateway_service}.{CHART_NAMESPACE}.svc"
    # The user data launch_instance renders from the grant (the CA from the worker's ConfigMap).
    ca_bundle = load_balanced.ca_file.read_text()
    user_data = render_user_data(gateway_url=grant.endpoint, server_name=grant.server_name, ticket=grant.ticket,
                                 node_name=req.node_name, labels=req.labels, taints=req.taints, ca_bundle=ca_bundle)
    doc = parse_user_data(user_data)
    assert (doc["gateway"], doc["serverName"]) == (grant.endpoint, SERVICE_HOST)

    # A wrong server name is refused: the certificate is checked against serverName, not skipped.
    wrong = user_data.replace(f'"serverName": "{SERVICE_HOST}"', '"serverName": "gateway.elsewhere.example"')
    with pytest.raises(JoinUnavailable,
                       match=re.escape("Hostname mismatch, certificate is not valid for 'gateway.elsewhere.example'")):
        join_with_user_data(wrong, CAPACITY, KWOK_ANNOTATIONS, "")
    # Nor is the address itself a name the certificate carries: without serverName the join is refused too.
    no_name = user_data.replace(f'"serverName": "{SERVICE_HOST}"', '"serverName": ""')
    with pytest.raises(JoinUnavailable, match=re.escape("IP address mismatch, certificate is not valid for "
                                                           "'127.0.0.1'")):
        join_with_user_data(no_name, CAPACITY, KWOK_ANNOTATIONS, "")
    # Nor another CA.
    other_ca = _issue(_name("another-ca"), None, is_ca=True)
    other_pem = other_ca.write(setup.workdir, "another-ca")[0].read_text()
    with pytest.raises(JoinUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        join_with_user_data(user_data.replace(json.dumps(doc["caBundle"])[1:-1], json.dumps(other_pem)[1:-1]),
                            CAPACITY, KWOK_ANNOTATIONS, "")
    assert node_absent(setup.cluster, req.node_name)

    # The node: a real TCP connection to 127.0.0.1 (the LoadBalancer address), TLS verified as the Service name.
    assert join_with_user_data(user_data, CAPACITY, KWOK_ANNOTATIONS, "") == req.node_name
    assert setup.cluster.admin.core.read_node(req.node_name).metadata.labels[LABEL_OPERATION] == req.operation
    assert (f"the node joins at https://127.0.0.1:{load_balanced.port} as {SERVICE_HOST}"
            in load_balanced.gateway.log)


def test_a_gateway_that_may_not_read_its_service_says_so(setup: Setup, nodes: list[str]) -> None:
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_SERVICE": "not-its-own", "KUBEON_GATEWAY_SERVICE_NAMESPACE": CHART_NAMESPACE,
    }, name="gateway-foreign-service").start()
    try:
        with HttpGatewayClient(proc.url, setup.optimizer_token_file) as http, \
                pytest.raises(GatewayUnavailable, match="forbidden; the gateway's ServiceAccount needs 'get' on "
                                                        "services/not-its-own"):
            http.issue_ticket(ticket_request(nodes))
    finally:
        assert proc.stop() in (0, -signal.SIGTERM), proc.log


# ----- the documented test (R4.10) with the gateway as its own process ---------------------------------------


@pytest.fixture(scope="module")
def stack(cluster: Cluster, setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> BurstStack:
    return build_stack(cluster, tmp_path_factory.mktemp("burst-http"))


@pytest.fixture
async def http_worker(stack: BurstStack, gateway: GatewayProcess, setup: Setup,
                      temporal_dev_server: WorkflowEnvironment) -> AsyncIterator[tuple[Client, str]]:
    """The worker as in a cluster: the optimizer's own credentials, no gateway kubeconfig, no ticket key; it
    reaches the gateway over HTTP, and simulated instances join through POST /v1/join."""
    queue = unique("q")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=SIM_LOCATIONS, cluster_name=queue,
                              gateway_url=gateway.url)
    http = HttpGatewayClient(settings.gateway_url, setup.optimizer_token_file)

    def boot(instance: Instance, user_data: str, capacity: dict[str, str], _health: GpuHealth) -> None:
        join_with_user_data(user_data, capacity, KWOK_ANNOTATIONS, f"sim://{instance.location}/{instance.instance_id}")

    async with worker_services(settings, stack.http_runtime(settings, http, boot)) as (temporal, _runtime, _watcher):
        yield temporal, settings.cluster


@pytest.mark.temporal
async def test_burst_end_to_end_through_the_gateway_process(stack: BurstStack, gateway: GatewayProcess,
                                                            http_worker: tuple[Client, str],
                                                            namespace: str) -> None:
    temporal, cluster_name = http_worker
    policy = unique("burst")
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west"], max_nodes=1)
    try:
        deploy = unique("infer")
        stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        _, handle = await approve_batch(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
        view = await wait_phase(handle, NodePhase.SERVING)
        node = stack.cluster.admin.core.read_node(str(view.node_name))
        assert node.metadata.labels[LABEL_OPERATION] == view.operation
        assert node.metadata.labels[LABEL_LOCATION] == "sim.eu-west"
        assert any(t.key == BURST_TAINT and t.effect == "NoSchedule" for t in node.spec.taints)
        pods = stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        assert [p.spec.node_name for p in pods] == [view.node_name]
        assert f"node {view.node_name} joined: pod CIDR" in gateway.log

        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        done = await result(handle)
        assert done.phase == NodePhase.COMPLETED, done.message
        wait_for(lambda: node_absent(stack.cluster, str(view.node_name)), what="burst node removed")
        assert f"node {view.node_name} of operation {view.operation}: removed (asked by {OPTIMIZER_USER})" \
            in gateway.log
    finally:
        stack.delete_policy(policy)


def test_gateway_log_carries_no_tokens_or_tickets(gateway: GatewayProcess, setup: Setup) -> None:
    log = gateway.log
    assert setup.ticket_key.decode() not in log
    assert setup.optimizer_token_file.read_text() not in log
    assert "Bearer" not in log
    assert not [line for line in log.splitlines() if "eyJ" in line]  # no JWT, no base64 JSON ticket body
    json.dumps(log)  # printable


# ----- configuration -------------------------------------------------------------------------------------------


def test_configuration_from_the_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 32)
    base = {"KUBEON_CLUSTER": "c", "KUBEON_GATEWAY_TICKET_KEY_FILE": str(key)}
    cfg = GatewayServerConfig.from_settings(load_gateway_settings(base))
    assert (cfg.host, cfg.port, cfg.health_port) == ("0.0.0.0", 8443, 8080)  # what the chart probes
    assert cfg.allowed_clients == {OPTIMIZER_USER}
    assert cfg.kubeconfig is None and not cfg.tls and cfg.token_audiences == ()

    env = {**base, "KUBEON_GATEWAY_LISTEN": "[::1]:9443", "KUBEON_GATEWAY_ALLOWED_CLIENTS": " a , b ,",
           "KUBEON_GATEWAY_TOKEN_AUDIENCES": "kubeon-gpu-gateway"}
    cfg = GatewayServerConfig.from_settings(load_gateway_settings(env))
    assert (cfg.host, cfg.port, cfg.allowed_clients, cfg.token_audiences) == ("::1", 9443, {"a", "b"},
                                                                               ("kubeon-gpu-gateway",))
    for extra, message in (({"KUBEON_GATEWAY_LISTEN": "8443"}, "KUBEON_GATEWAY_LISTEN"),
                           ({"KUBEON_GATEWAY_TLS_CERT_FILE": "/c.pem"}, "go together"),
                           ({"KUBEON_GATEWAY_ALLOWED_CLIENTS": " , "}, "KUBEON_GATEWAY_ALLOWED_CLIENTS is empty")):
        env = {**base, **extra}
        with pytest.raises(ConfigError, match=message):
            GatewayServerConfig.from_settings(load_gateway_settings(env))
    env = {"KUBEON_CLUSTER": "c"}
    with pytest.raises(ConfigError, match="KUBEON_GATEWAY_TICKET_KEY_FILE is required"):
        GatewayServerConfig.from_settings(load_gateway_settings(env))

    # The worker's client: KUBEON_GATEWAY_URL and the in-cluster token unless told otherwise.
    env = {"KUBEON_CLUSTER": "c", "KUBEON_GATEWAY_URL": "https://gw.example:8443/"}
    with build_gateway(load_settings(env)) as http:  # type: ignore[attr-defined]
        assert http.base_url == "https://gw.example:8443"
        assert http._token_file == IN_CLUSTER_TOKEN_FILE
    with pytest.raises(ValueError, match="must start with https://"):
        HttpGatewayClient("gw.example:8443", tmp_path / "t")


def test_a_misconfigured_gateway_exits_2_naming_the_problem(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEON_")}
    short = tmp_path / "short.key"
    short.write_text("too short")
    long = tmp_path / "long.key"
    long.write_text("k" * 64)
    for extra, message in (({}, "KUBEON_GATEWAY_TICKET_KEY_FILE is required"),
                           ({"KUBEON_GATEWAY_TICKET_KEY_FILE": str(tmp_path / "missing")}, "No such file"),
                           ({"KUBEON_GATEWAY_TICKET_KEY_FILE": str(short)}, "at least 16 bytes"),
                           ({"KUBEON_GATEWAY_TICKET_KEY_FILE": str(long)}, "no Kubernetes credentials")):
        proc = subprocess.run([sys.executable, "-m", "gateway.main"], env={**env, **extra}, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
        assert proc.stderr.startswith("kubeon-gpu gateway: ")


def test_a_gateway_whose_certificate_does_not_load_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBEON_")}
    key = tmp_path / "ticket.key"
    key.write_text("k" * 64)
    proc = subprocess.run([sys.executable, "-m", "gateway.main"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**env, "KUBEON_GATEWAY_TICKET_KEY_FILE": str(key),
                                           "KUBEON_GATEWAY_TLS_CERT_FILE": str(tmp_path / "tls.crt"),
                                           "KUBEON_GATEWAY_TLS_KEY_FILE": str(tmp_path / "tls.key")})
    assert proc.returncode == 2, proc.stderr
    assert f"KUBEON_GATEWAY_TLS_CERT_FILE {tmp_path / 'tls.crt'}" in proc.stderr
    assert "cannot load the certificate and key: No such file or directory" in proc.stderr
