"""A node's admission against the real control plane (Node RBAC, NodeRestriction, the controller-manager's
signer), with the gateway's own ServiceAccount: the node registering itself with its own certificate and confined
to itself, a retry's same answer, the kubelet CSR's shape, WireGuard keys, and every rule of the gateway's needed."""

from __future__ import annotations

import base64
import re
import secrets
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes import client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.service import KubeGateway
from models.errors import JoinRefused
from models.errors import TicketError
from models.labels import JOINING_TAINT
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from node.join import NodeFiles
from tests.charts.helm import NAMESPACE
from tests.gateway.helpers import BURST_TAINT
from tests.gateway.helpers import gateway
from tests.gateway.helpers import join_and_register
from tests.gateway.helpers import node_absent
from tests.gateway.helpers import nonce_of
from tests.gateway.helpers import records
from tests.gateway.helpers import ticket_request
from tests.harness.joining import csr
from tests.harness.joining import node_client
from tests.harness.joining import redeem_for
from tests.harness.joining import register_self
from tests.harness.joining import weak_rsa_csr
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import GATEWAY_RULES
from tests.harness.rbac import GATEWAY_SA
from tests.harness.rbac import GATEWAY_SERVICE_RULES
from tests.harness.rbac import grant
from tests.harness.rbac import grant_namespaced

pytestmark = pytest.mark.cluster


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


def test_the_nodes_identity_is_confined_to_itself(cluster: Cluster, gateway_api: client.ApiClient,
                                                  nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    _, api = join_and_register(gw, req, files())
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
