"""KubeGateway's join against the real control plane (Node,RBAC, NodeRestriction, the controller-manager's
signer), with the gateway's own ServiceAccount: signatures, expiry (injected clock), durable single use, the
kubelet CSR's shape, WireGuard keys, addresses, the node registering itself and confined to itself, the joining
check (capacity), removal only of the operation's own Node. And
the user data a burst node boots with: where the gateway says to join (its public URL or LoadBalancer address), the
name and the CA to verify it with, within EC2's limit."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes import client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.service import (
    GatewayAddressPending,
    GatewayAddressUnknown,
    KubeGateway,
    ServiceRef,
    endpoint_from_service,
)
from gateway.slots import AddressPlan
from gateway.tickets import _b64, _unb64
from models.errors import JoinRefused, TicketError
from models.join import USER_DATA_MAX_BYTES, JoinTicketRequest, UserDataTooLarge, parse_user_data, render_user_data
from models.labels import (
    JOIN_REFUSED_ANNOTATION,
    JOINING_TAINT,
    LABEL_GPU_PRODUCT,
    LABEL_INSTANCE_TYPE,
    LABEL_LOCATION,
    LABEL_OPERATION,
    LABEL_POLICY,
    Taint,
)
from models.locations import BurstConfig
from node.join import NodeFiles
from tests.charts.helm import BURST_VALUES, NAMESPACE, template
from tests.harness.joining import (
    FixedClock,
    csr,
    gateway_credentials,
    node_client,
    redeem_for,
    register_self,
    weak_rsa_csr,
)
from tests.harness.kube import Cluster, wait_for
from tests.harness.rbac import GATEWAY_RULES, GATEWAY_SA, GATEWAY_SERVICE_RULES, grant, grant_namespaced
from worker.config import load_settings

pytestmark = pytest.mark.cluster

BURST_TAINT = "gpu.kubeon.io/burst"
CAPACITY = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}


@pytest.fixture(scope="module")
def gateway_api(cluster: Cluster) -> client.ApiClient:
    return gateway_credentials(cluster)


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[list[str]]:
    """Names of Nodes a test may create; deleted afterwards so no tainted GPU node is left for other tests."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            cluster.admin.core.delete_node(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def ticket_request(nodes: list[str], *, operation: str | None = None, ttl: int = 900) -> JoinTicketRequest:
    op = operation or f"op-{uuid.uuid4().hex[:10]}"
    name = f"burst-{uuid.uuid4().hex[:8]}"
    nodes.append(name)
    return JoinTicketRequest(
        operation=op, policy="inference-burst", location="sim/eu-west", node_name=name,
        labels={LABEL_OPERATION: op, LABEL_POLICY: "inference-burst", LABEL_LOCATION: "sim.eu-west"},
        taints=[Taint(key=BURST_TAINT)], ttl_seconds=ttl,
    )


def node_absent(cluster: Cluster, name: str) -> bool:
    return not cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Callable[[], NodeFiles]]:
    """A fresh node state directory per call (a node's keys live there)."""
    count = iter(range(1000))
    yield lambda: NodeFiles(tmp_path / f"node-{next(count)}")


def gateway(api: client.ApiClient, key: bytes | None = None, **kwargs: Any) -> KubeGateway:
    return KubeGateway(api, key or secrets.token_bytes(32), namespace=NAMESPACE, **kwargs)


def records(cluster: Cluster, nonce: str) -> list[str]:
    """The gateway's records and CSR for a ticket: nothing may exist for a refused one."""
    names = [cm.metadata.name for cm in cluster.admin.core.list_namespaced_config_map(NAMESPACE).items
             if cm.metadata.name == f"kubeon-ticket-{nonce}" or (cm.data or {}).get("ticket") == nonce]
    csrs = client.CertificatesV1Api(cluster.admin.api).list_certificate_signing_request().items
    return [str(n) for n in names] + [str(c.metadata.name) for c in csrs if c.metadata.name == f"kubeon-join-{nonce}"]


def nonce_of(gw: KubeGateway, ticket: str) -> str:
    return gw.verify(ticket).nonce


def test_a_joined_node_registers_itself_with_its_own_certificate(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    node_files = files()
    ticket = gw.sign_ticket(req)
    answer = gw.join(redeem_for(node_files, ticket, req.node_name))
    # The gateway created no Node; it got the node's own CSR signed for the kubelet client signer, approved by it.
    assert node_absent(cluster, req.node_name)
    cert = x509.load_pem_x509_certificate(answer.certificate.encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"system:node:{req.node_name}"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    ours = client.CertificatesV1Api(cluster.admin.api).read_certificate_signing_request(
        f"kubeon-join-{nonce_of(gw, ticket)}")
    assert base64.b64decode(str(ours.status.certificate)).decode() == answer.certificate
    assert ours.spec.signer_name == "kubernetes.io/kube-apiserver-client-kubelet"
    assert ours.spec.username == f"system:serviceaccount:{NAMESPACE}:{GATEWAY_SA}"
    assert [(c.type, c.reason) for c in ours.status.conditions] == [("Approved", "KubeonGatewayValidated")]
    # The node registers itself with that certificate: the API server knows it as system:node:<name>.
    api = node_client(node_files, answer)
    who = client.AuthenticationV1Api(api).create_self_subject_review(client.V1SelfSubjectReview())
    assert who.status.user_info.username == f"system:node:{req.node_name}"
    assert "system:nodes" in who.status.user_info.groups
    register_self(api, answer, annotations=KWOK_ANNOTATIONS)
    got = cluster.admin.core.read_node(req.node_name)
    assert got.metadata.labels[LABEL_OPERATION] == req.operation
    assert got.metadata.labels[LABEL_LOCATION] == "sim.eu-west"
    taints = {(t.key, t.effect) for t in got.spec.taints}
    assert (BURST_TAINT, "NoSchedule") in taints and (JOINING_TAINT.key, "NoSchedule") in taints
    # The gateway checks it against its ticket, sets its pod CIDR and lifts the joining taint.
    report = gw.reconcile()
    assert req.node_name in report["labelled"]
    got = cluster.admin.core.read_node(req.node_name)
    assert got.spec.pod_cidr == answer.pod_cidr
    assert {t.key for t in got.spec.taints} == {BURST_TAINT}
    wait_for(lambda: cluster.node_ready(req.node_name), what=f"{req.node_name} Ready", timeout=60)


def test_forged_tickets_are_refused_and_admit_nothing(cluster: Cluster, gateway_api: client.ApiClient,
                                                     nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    key = secrets.token_bytes(32)
    gw = gateway(gateway_api, key)
    req = ticket_request(nodes)
    good = gw.sign_ticket(req)
    node_files = files()
    # Same signature, a body naming another node: the signature no longer matches.
    body, _, sig = good.partition(".")
    doc = json.loads(_unb64(body))
    doc["node_name"] = "control-plane-1"
    tampered = f"{_b64(json.dumps(doc).encode())}.{sig}"
    other = gateway(gateway_api).sign_ticket(req)  # signed with another key
    for forged in (tampered, other, "not-a-ticket", f"{body}.", f".{sig}"):
        with pytest.raises(TicketError, match="signature is invalid") as err:
            gw.join(redeem_for(node_files, forged, req.node_name))
        assert err.value.code == "ticket_invalid"
    junk = _b64(b'{"operation": 1}')
    signed_junk = f"{junk}.{_b64(hmac.new(key, junk.encode(), hashlib.sha256).digest())}"
    with pytest.raises(TicketError, match="malformed"):
        gw.join(redeem_for(node_files, signed_junk, req.node_name))
    assert records(cluster, nonce_of(gw, good)) == []


def test_expired_ticket_is_refused(cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str],
                                   files: Callable[[], NodeFiles]) -> None:
    clock = FixedClock()
    gw = gateway(gateway_api, clock=clock)
    req = ticket_request(nodes, ttl=60)
    ticket = gw.sign_ticket(req)
    clock.now += 59
    assert gw.verify(ticket).node_name == req.node_name  # still good a second before expiry
    clock.now += 2
    with pytest.raises(TicketError, match=f"ticket for {req.node_name} expired") as err:
        gw.join(redeem_for(files(), ticket, req.node_name))
    assert err.value.code == "ticket_expired"
    assert records(cluster, json.loads(_unb64(ticket.split(".")[0]))["nonce"]) == []


def test_a_ticket_is_single_use_for_its_whole_lifetime(cluster: Cluster, gateway_api: client.ApiClient,
                                                       nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """The bug this replaces: the old gateway kept the mark only on the Node, so once the Node was deleted the
    same ticket (readable in the finished instance's user data) was accepted again and the Node resurrected."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    ticket = gw.sign_ticket(req)
    node_files = files()
    answer = gw.join(redeem_for(node_files, ticket, req.node_name))
    register_self(node_client(node_files, answer), answer, annotations=KWOK_ANNOTATIONS)
    gw.reconcile()
    cluster.admin.core.delete_node(req.node_name)  # the Node goes (here not even through the gateway)
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    assert req.node_name in gw.reconcile()["released"]
    for attempt in (node_files, files()):  # the original node's keys, and an attacker's
        with pytest.raises(TicketError, match="already used and its node removed") as err:
            gw.join(redeem_for(attempt, ticket, req.node_name))
        assert err.value.code == "ticket_replayed"
    assert node_absent(cluster, req.node_name)
    assert all(s.node != req.node_name for s in gw.records.slots())


def test_a_retry_by_the_same_node_gets_the_same_answer_and_nothing_else_does(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    ticket = gw.sign_ticket(req)
    node_files = files()
    first = gw.join(redeem_for(node_files, ticket, req.node_name))
    again = gw.join(redeem_for(node_files, ticket, req.node_name))  # lost answer: same keys, a new CSR
    assert (again.pod_cidr, again.certificate) == (first.pod_cidr, first.certificate)
    with pytest.raises(TicketError, match="already redeemed with other keys") as err:
        gw.join(redeem_for(files(), ticket, req.node_name))  # the ticket copied by someone else
    assert err.value.code == "ticket_replayed"
    with pytest.raises(TicketError, match="already joined with another ticket"):
        gw.join(redeem_for(files(), gw.sign_ticket(req), req.node_name))  # a second ticket for that name
    assert len([s for s in gw.records.slots() if s.node == req.node_name]) == 1


@pytest.mark.parametrize("case", ["other name", "no org", "other org", "dns san", "ip san", "extension",
                                  "weak rsa", "not pem", "usages", "server auth"])
def test_a_csr_not_of_the_kubelet_client_shape_is_refused(cluster: Cluster, gateway_api: client.ApiClient,
                                                          nodes: list[str], files: Callable[[], NodeFiles],
                                                          case: str) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    ticket = gw.sign_ticket(req)
    good = redeem_for(files(), ticket, req.node_name)
    name = req.node_name
    bad, usages, why = {
        "other name": (csr("control-plane-1"), None, "CN=system:node:" + name),
        "no org": (csr(name, org=""), None, "must be exactly O=system:nodes"),
        "other org": (csr(name, org="system:masters"), None, "must be exactly O=system:nodes"),
        "dns san": (csr(name, dns=("kubernetes.default.svc",)), None, "subject alternative names"),
        "ip san": (csr(name, ips=("10.96.0.1",)), None, "subject alternative names"),
        "extension": (csr(name, extra=x509.BasicConstraints(ca=True, path_length=None)), None, "extension"),
        "weak rsa": (weak_rsa_csr(name), None, "RSA key of 1024 bits"),
        "not pem": ("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", None,
                    "not a PEM"),
        "usages": (good.csr, ["digital signature"], "usages"),
        "server auth": (good.csr, ["digital signature", "client auth", "server auth"], "usages"),
    }[case]
    request = good.model_copy(update={"csr": bad, **({"usages": usages} if usages else {})})
    with pytest.raises(JoinRefused, match=re.escape(why)) as err:
        gw.join(request)
    assert err.value.code == "csr_invalid"
    assert records(cluster, gw.verify(ticket).nonce) == []


def test_malformed_or_reused_wireguard_keys_are_refused(cluster: Cluster, gateway_api: client.ApiClient,
                                                        nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    first = ticket_request(nodes)
    taken = redeem_for(files(), gw.sign_ticket(first), first.node_name)
    gw.join(taken)
    req = ticket_request(nodes)
    ticket = gw.sign_ticket(req)
    good = redeem_for(files(), ticket, req.node_name)
    for key, why in (("not-a-key", "not a WireGuard key"), ("A" * 43 + "=", "all-zero"),
                     ("!" * 43 + "=", "not valid base64"), (base64.b64encode(b"x" * 31).decode(), "31 bytes")):
        with pytest.raises(JoinRefused, match=why) as err:
            gw.join(good.model_copy(update={"wireguard_public_key": key}))
        assert err.value.code == "wireguard_key_invalid"
    with pytest.raises(JoinRefused, match=f"already the key of node {first.node_name}") as err:
        gw.join(good.model_copy(update={"wireguard_public_key": taken.wireguard_public_key}))
    assert err.value.code == "wireguard_key_in_use"
    assert records(cluster, gw.verify(ticket).nonce) == []
    assert gw.join(good).node_name == req.node_name  # its own key: joins


def test_addresses_never_overlap_and_are_freed_with_the_node(cluster: Cluster, gateway_api: client.ApiClient,
                                                             nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api, plan=AddressPlan(tunnel_cidr="10.250.0.0/29", pod_cidr="10.245.0.0/22",
                                                node_mask=24, service_cidr="10.96.0.0/16"))
    for slot in gw.records.slots():  # other tests' slots in the same namespace
        gw.records.delete(slot.name)
    reqs = [ticket_request(nodes) for _ in range(4)]
    answers = [gw.join(redeem_for(files(), gw.sign_ticket(r), r.node_name)) for r in reqs]
    cidrs = [ipaddress.ip_network(a.pod_cidr) for a in answers]
    assert all(not a.overlaps(b) for i, a in enumerate(cidrs) for b in cidrs[i + 1:])
    assert len({s.tunnel_ip for s in gw.records.slots()}) == 4
    # The plan holds 4 (a /29 less network, gateway, broadcast is 5; 4 pod /24s): the fifth is refused.
    extra = ticket_request(nodes)
    with pytest.raises(JoinRefused, match="no free address slot") as err:
        gw.join(redeem_for(files(), gw.sign_ticket(extra), extra.node_name))
    assert err.value.status == 503
    freed = answers[1].pod_cidr
    assert gw.remove_node(reqs[1].node_name, operation=reqs[1].operation) is False  # never registered
    later = ticket_request(nodes)
    assert gw.join(redeem_for(files(), gw.sign_ticket(later), later.node_name)).pod_cidr == freed


def test_a_node_reporting_more_gpus_than_its_offering_is_cordoned(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes).model_copy(update={"gpus": 1})
    node_files = files()
    answer = gw.join(redeem_for(node_files, gw.sign_ticket(req), req.node_name))
    register_self(node_client(node_files, answer), answer, gpus=100000, annotations=KWOK_ANNOTATIONS)
    assert req.node_name in gw.reconcile()["cordoned"]
    got = cluster.admin.core.read_node(req.node_name)
    assert got.spec.unschedulable is True
    assert "100000 GPUs" in got.metadata.annotations[JOIN_REFUSED_ANNOTATION]
    assert JOINING_TAINT.key in {t.key for t in got.spec.taints}  # never lifted: no pod lands


def test_the_nodes_identity_is_confined_to_itself(cluster: Cluster, gateway_api: client.ApiClient,
                                                  nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    node_files = files()
    answer = gw.join(redeem_for(node_files, gw.sign_ticket(req), req.node_name))
    api = node_client(node_files, answer)
    register_self(api, answer, annotations=KWOK_ANNOTATIONS)
    other = f"home-{uuid.uuid4().hex[:6]}"
    nodes.append(other)
    cluster.create_kwok_node(other)
    core = client.CoreV1Api(api)
    cluster.admin.core.create_namespaced_secret(NAMESPACE, client.V1Secret(
        metadata=client.V1ObjectMeta(name=f"s-{req.node_name}"), string_data={"k": "v"}))
    forbidden = {
        "list nodes": lambda: core.list_node(),
        "list pods": lambda: core.list_pod_for_all_namespaces(),
        "modify another node": lambda: core.patch_node(other, {"metadata": {"labels": {"x": "y"}}}),
        "read a secret": lambda: core.read_namespaced_secret(f"s-{req.node_name}", NAMESPACE),
        "list secrets": lambda: core.list_secret_for_all_namespaces(),
        "csr for another node": lambda: client.CertificatesV1Api(api).create_certificate_signing_request(
            client.V1CertificateSigningRequest(
                metadata=client.V1ObjectMeta(generate_name="x-"),
                spec=client.V1CertificateSigningRequestSpec(
                    request=base64.b64encode(csr(other).encode()).decode(),
                    signer_name="kubernetes.io/kube-apiserver-client-kubelet",
                    usages=["digital signature", "client auth"]))),
        "lift its own taint": lambda: core.patch_node(req.node_name, {"spec": {"taints": []}}),
    }
    for what, call in forbidden.items():
        with pytest.raises(client.ApiException) as err:
            call()
        assert err.value.status == 403, what
    assert core.read_node(req.node_name).metadata.name == req.node_name  # its own: allowed


def test_remove_refuses_another_operations_node(cluster: Cluster, gateway_api: client.ApiClient,
                                                nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    node_files = files()
    answer = gw.join(redeem_for(node_files, gw.sign_ticket(req), req.node_name))
    register_self(node_client(node_files, answer), answer, annotations=KWOK_ANNOTATIONS)

    with pytest.raises(TicketError, match=f"belongs to operation '{req.operation}', not op-other"):
        gw.remove_node(req.node_name, operation="op-other")
    assert cluster.admin.core.read_node(req.node_name).metadata.name == req.node_name

    # A node the gateway never admitted (no operation label) is never removed either.
    home = f"home-{uuid.uuid4().hex[:6]}"
    nodes.append(home)
    cluster.create_kwok_node(home)
    with pytest.raises(TicketError, match="belongs to operation None"):
        gw.remove_node(home, operation=req.operation)

    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    assert all(s.node != req.node_name for s in gw.records.slots())  # its addresses are free
    assert gw.remove_node(req.node_name, operation=req.operation) is False  # already gone: idempotent


# ----- user data -------------------------------------------------------------------------------------------------

PUBLIC_URL = "https://burst-gw.example.com:8443"
SERVICE_URL = f"https://kubeon-gpu-optimizer-gateway.{NAMESPACE}.svc:8443"


@pytest.fixture(scope="module")
def chart_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CA certificate the chart generates for the gateway, as the worker mounts it from its ConfigMap."""
    configmap = template(values=[BURST_VALUES]).get("ConfigMap", "kubeon-gpu-optimizer-gateway-ca", NAMESPACE)
    path = tmp_path_factory.mktemp("gateway-ca") / "ca.crt"
    path.write_text(configmap["data"]["ca.crt"])
    return path


def worker_burst_config(**env: str) -> BurstConfig:
    """The worker's burst configuration from the variables the chart sets."""
    return load_settings({"KUBEON_CLUSTER": "prod-use1-a", "KUBEON_GATEWAY_URL": SERVICE_URL, **env}).burst_config()


def launch_user_data(config: BurstConfig, gateway: KubeGateway | None = None) -> str:
    """User data as launch_instance renders it, for a node with every label a launch sets and a real ticket:
    where the gateway's grant says to join, else the worker's configured URL."""
    op = f"op-{uuid.uuid4().hex}"
    node = f"kubeon-burst-{uuid.uuid4().hex}"
    labels = {LABEL_OPERATION: op, LABEL_POLICY: "inference-burst-" + "x" * 40, LABEL_LOCATION: "aws.eu-central-1",
              LABEL_GPU_PRODUCT: "NVIDIA-H100-80GB-HBM3", LABEL_INSTANCE_TYPE: "p5.48xlarge"}
    taints = [Taint(key=BURST_TAINT)]
    gw = gateway or KubeGateway(client.ApiClient(), secrets.token_bytes(32))
    # The grant issue_ticket answers, without its address slot reservation (no API server here).
    endpoint, server_name = gw.endpoint()
    ticket = gw.sign_ticket(JoinTicketRequest(
        operation=op, policy=labels[LABEL_POLICY], location="aws/eu-central-1", node_name=node, labels=labels,
        taints=taints))
    return render_user_data(gateway_url=endpoint or config.gateway_url,
                            server_name=server_name if endpoint else "", ticket=ticket,
                            node_name=node, labels=labels, taints=taints, ca_bundle=config.gateway_ca_bundle)


def test_user_data_names_the_gateways_public_url() -> None:
    doc = parse_user_data(launch_user_data(worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL + "/")))
    assert doc["gateway"] == PUBLIC_URL
    assert doc["serverName"] == "burst-gw.example.com"


def test_user_data_falls_back_to_the_gateway_url_without_a_public_one() -> None:
    doc = parse_user_data(launch_user_data(worker_burst_config()))
    assert doc["gateway"] == SERVICE_URL
    assert doc["serverName"] == f"kubeon-gpu-optimizer-gateway.{NAMESPACE}.svc"
    assert "caBundle" not in doc, "no CA file: the node uses its system trust store"


def test_user_data_names_where_the_gateway_says_nodes_join() -> None:
    """The gateway's grant wins over the worker's configured URL: its public URL (verified as its host), or its
    LoadBalancer address verified as the Service name."""
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL="https://stale.example.com:8443")
    public = KubeGateway(client.ApiClient(), secrets.token_bytes(32), public_url=PUBLIC_URL + "/")
    assert public.endpoint() == (PUBLIC_URL, "burst-gw.example.com")
    doc = parse_user_data(launch_user_data(config, public))
    assert (doc["gateway"], doc["serverName"]) == (PUBLIC_URL, "burst-gw.example.com")
    ip = KubeGateway(client.ApiClient(), secrets.token_bytes(32), public_url="https://[2001:db8::10]:8443")
    assert ip.endpoint() == ("https://[2001:db8::10]:8443", "2001:db8::10")
    # In-process (dev, tests): no public URL and no Service, so the worker's configured URL stands.
    assert KubeGateway(client.ApiClient(), secrets.token_bytes(32)).endpoint() == ("", "")


def lb_service(kind: str = "LoadBalancer", ingress: list[client.V1LoadBalancerIngress] | None = None,
               ports: list[client.V1ServicePort] | None = None) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=GATEWAY_SA, namespace=NAMESPACE),
        spec=client.V1ServiceSpec(type=kind, ports=ports or [client.V1ServicePort(name="tunnel", port=8443)]),
        status=client.V1ServiceStatus(load_balancer=client.V1LoadBalancerStatus(ingress=ingress)))


def test_endpoint_from_the_services_load_balancer() -> None:
    ref = ServiceRef(GATEWAY_SA, NAMESPACE)
    assert ref.dns_name == f"{GATEWAY_SA}.{NAMESPACE}.svc"
    for ingress in (None, [], [client.V1LoadBalancerIngress()]):
        with pytest.raises(GatewayAddressPending,
                           match=f"^gateway Service {GATEWAY_SA} has no LoadBalancer address yet"):
            endpoint_from_service(lb_service(ingress=ingress), ref)
    host = [client.V1LoadBalancerIngress(hostname="internal-gw-1.elb.eu-central-1.amazonaws.com", ip="10.0.0.9")]
    assert endpoint_from_service(lb_service(ingress=host), ref) == (
        "https://internal-gw-1.elb.eu-central-1.amazonaws.com:8443", ref.dns_name)
    v4 = [client.V1LoadBalancerIngress(ip="10.1.2.3")]
    ports = [client.V1ServicePort(name="other", port=1), client.V1ServicePort(name="tunnel", port=443)]
    assert endpoint_from_service(lb_service(ingress=v4, ports=ports), ref) == ("https://10.1.2.3:443", ref.dns_name)
    v6 = [client.V1LoadBalancerIngress(ip="2001:db8::7")]
    assert endpoint_from_service(lb_service(ingress=v6), ref)[0] == "https://[2001:db8::7]:8443"
    for kind in ("NodePort", "ClusterIP"):
        with pytest.raises(GatewayAddressUnknown, match=f"is of type {kind}, not LoadBalancer.*publicUrl"):
            endpoint_from_service(lb_service(kind, ingress=v4), ref)


def test_user_data_carries_the_gateways_ca(chart_ca: Path) -> None:
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL, KUBEON_GATEWAY_CA_FILE=str(chart_ca))
    doc = parse_user_data(launch_user_data(config))
    assert doc["caBundle"] == chart_ca.read_text().strip() + "\n"
    assert doc["caBundle"].startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY" not in doc["caBundle"]


def test_user_data_with_the_ca_fits_ec2s_limit(chart_ca: Path) -> None:
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL, KUBEON_GATEWAY_CA_FILE=str(chart_ca))
    size = len(launch_user_data(config).encode())
    assert USER_DATA_MAX_BYTES == 16 * 1024, "EC2: 16 KB before base64"
    # Room to spare for a CA chain: the chart's CA and a ticket take well under half the limit.
    assert size < USER_DATA_MAX_BYTES // 2, size


def test_user_data_over_the_limit_is_refused(chart_ca: Path) -> None:
    chain = chart_ca.read_text() * 16  # an absurd bundle: 16 copies of the CA
    config = BurstConfig(gateway_url=PUBLIC_URL, gateway_ca_bundle=chain)
    with pytest.raises(UserDataTooLarge, match=f"over the {USER_DATA_MAX_BYTES}-byte limit of EC2"):
        launch_user_data(config)


def test_a_ca_file_without_a_certificate_is_a_configuration_error(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("MIIDBTCCAe2gAwIBAgIQ\n")
    with pytest.raises(ValueError, match=f"KUBEON_GATEWAY_CA_FILE {not_pem}: no PEM certificate"):
        worker_burst_config(KUBEON_GATEWAY_CA_FILE=str(not_pem))


# ----- least privilege: every rule of the gateway's is needed ---------------------------------------------------

JOIN_RULES = [r for r in GATEWAY_RULES if r["resources"] != ["tokenreviews"]] + [
    r for r in GATEWAY_SERVICE_RULES if r["resources"] == ["configmaps"]]


@pytest.mark.parametrize("missing", range(len(JOIN_RULES)),
                         ids=[f"{'/'.join(r['resources'])}:{','.join(r['verbs'])}" for r in JOIN_RULES])
def test_each_join_rule_is_needed(cluster: Cluster, nodes: list[str], tmp_path: Path, missing: int) -> None:
    """Without any one of its rules, the gateway's join, labelling or removal is refused by the API server (the
    chart's ServiceAccount doing all of it with all of them: tests/charts/test_install.py)."""
    name = f"gw-minus-{missing}"
    rules = [r for i, r in enumerate(JOIN_RULES) if i != missing]
    api = grant(cluster, name, [r for r in rules if r["resources"] != ["configmaps"]]).api
    grant_namespaced(cluster, name, [r for r in rules if r["resources"] == ["configmaps"]])
    gw = KubeGateway(api, secrets.token_bytes(32), namespace=NAMESPACE, sign_timeout=5)
    req = ticket_request(nodes)
    files = NodeFiles(tmp_path / "node")
    with pytest.raises(client.ApiException) as err:
        answer = gw.join(redeem_for(files, gw.sign_ticket(req), req.node_name))
        register_self(node_client(files, answer), answer)
        gw.reconcile()
        gw.remove_node(req.node_name, operation=req.operation)
    assert err.value.status == 403, err.value
