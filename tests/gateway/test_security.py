"""The gateway's credentials and state against an attacker (issue 21): a ticket never outlives its reservation,
never names a node that exists, removal decides ownership from the gateway's slot record (never a label), a
refusal the node cannot lift, a removed node's certificate never serves again, a CSR under the join's name is
only approved if the gateway made it, and the gateway's record writes are conditional. On the real control plane
(Node,RBAC authorization, NodeRestriction, the node admission policy, the CSR signer)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections.abc import Callable

import pytest
from cryptography import x509
from fastapi.testclient import TestClient
from kubernetes import client
from kubernetes import watch

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.app import TokenReviewer
from gateway.app import create_app
from gateway.service import KubeGateway
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import KUBELET_CLIENT_SIGNER
from models.join import KUBELET_CLIENT_USAGES
from models.join import CertRenewal
from models.join import GpuHealth
from models.join import JoinTicketRequest
from models.labels import GPU_HEALTH_CONDITION
from models.labels import JOIN_REFUSED_ANNOTATION
from models.labels import JOIN_REFUSED_TAINT
from models.labels import JOINING_TAINT
from models.labels import LABEL_OPERATION
from node.health import HealthNotPosted
from node.health import post_gpu_health
from node.join import NodeFiles
from node.join import kubelet_csr
from node.join import kubelet_key
from node.join import renew
from node.register import node_api
from tests.gateway.helpers import gateway
from tests.gateway.helpers import join_and_register
from tests.gateway.helpers import node_absent
from tests.gateway.helpers import ticket_request
from tests.harness.joining import node_client
from tests.harness.joining import redeem_for
from tests.harness.joining import register_self
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


def http_join(gw: KubeGateway, body: dict[str, object]) -> tuple[int, str]:
    """``POST /v1/join`` through the gateway's HTTP app (status, error code)."""
    app = create_app(gw, TokenReviewer(client.ApiClient()), frozenset())
    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.post("/v1/join", json=body)
    return response.status_code, str(response.json().get("error", ""))


def redeem_body(files: NodeFiles, ticket: str, node: str) -> dict[str, object]:
    return redeem_for(files, ticket, node).model_dump(mode="json", by_alias=True)


# -- High 1: a ticket never outlives its reservation ------------------------------------------------------------


def test_a_compensated_launchs_ticket_never_redeems(gateway_api: client.ApiClient, nodes: list[str],
                                                    files: Callable[[], NodeFiles]) -> None:
    """Issue (reserving a slot), compensate (remove_node on the reservation), then redeem: refused, nothing
    allocated."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    grant = gw.issue_ticket(req)
    assert gw.remove_node(req.node_name, operation=req.operation) is False  # never joined: the reservation goes
    assert http_join(gw, redeem_body(files(), grant.ticket, req.node_name)) == (403, "ticket_replayed")
    with pytest.raises(TicketError) as refused:
        gw.join(redeem_for(files(), grant.ticket, req.node_name))
    assert refused.value.code == "ticket_replayed"
    assert all(s.node != req.node_name for s in gw.records.slots())


def test_the_older_ticket_of_a_retried_launch_never_redeems_after_removal(
        gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """T1 and T2 for one node (a retried launch), T2 joins, the node is removed: T1 is refused."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    first, second = gw.issue_ticket(req), gw.issue_ticket(req)
    gw.join(redeem_for(files(), second.ticket, req.node_name))
    gw.remove_node(req.node_name, operation=req.operation)
    assert http_join(gw, redeem_body(files(), first.ticket, req.node_name)) == (403, "ticket_replayed")
    assert all(s.node != req.node_name for s in gw.records.slots())


def test_the_older_ticket_of_a_retried_launch_still_redeems_its_reservation(
        gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """The first instance of a retried launch may be the one that boots: T1 redeems the one reservation (then
    T2 cannot), and both are tombstoned with it."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    first, second = gw.issue_ticket(req), gw.issue_ticket(req)
    gw.join(redeem_for(files(), first.ticket, req.node_name))
    (slot,) = [s for s in gw.records.slots() if s.node == req.node_name]
    assert not slot.reserved and gw.verify(second.ticket).nonce in slot.previous
    with pytest.raises(TicketError):
        gw.join(redeem_for(files(), second.ticket, req.node_name))
    gw.remove_node(req.node_name, operation=req.operation)
    for ticket in (first.ticket, second.ticket):
        assert http_join(gw, redeem_body(files(), ticket, req.node_name)) == (403, "ticket_replayed")


# -- Medium 6: no ticket for an existing node, no removal of a node without a slot -------------------------------


def test_no_ticket_names_an_existing_node(cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str],
                                          files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    cluster.create_kwok_node(req.node_name)  # a Node of that name that the gateway never admitted
    with pytest.raises(JoinRefused) as refused:
        gw.issue_ticket(req)
    assert (refused.value.status, refused.value.code) == (409, "node_exists")
    # A ticket signed without a reservation (or before the Node existed) does not join as it either.
    assert http_join(gw, redeem_body(files(), gw.sign_ticket(req), req.node_name)) == (409, "node_exists")
    # Names outside the burst scheme (a control-plane or home node's) are never ticketed at all.
    for name in ("kube-cp-1", "home-gpu-3", "burst-", "burst-UPPER", "burst-" + "a" * 64, "burst-eu-1",
                 "burst-op-0123456789a", "burst-op-0123456789abc"):
        with pytest.raises(JoinRefused, match="not a burst node's name"):
            gw.sign_ticket(req.model_copy(update={"node_name": name}))
    # Nor another operation's node: a ticket names the node of its own operation only.
    other = ticket_request(nodes)
    with pytest.raises(JoinRefused, match="a ticket names its own operation's node only"):
        gw.sign_ticket(req.model_copy(update={"node_name": other.node_name}))


def test_removal_refuses_a_node_without_a_slot_of_the_operation(cluster: Cluster, gateway_api: client.ApiClient,
                                                                nodes: list[str]) -> None:
    """The optimizer may patch labels onto any Node (R5.1): an operation label does not make it removable."""
    gw = gateway(gateway_api)
    name, op = f"burst-{uuid.uuid4().hex[:8]}", f"op-{uuid.uuid4().hex[:12]}"
    nodes.append(name)
    cluster.create_kwok_node(name, labels={LABEL_OPERATION: op})
    with pytest.raises(TicketError, match=f"has no address slot of operation {op}") as refused:
        gw.remove_node(name, operation=op)
    assert refused.value.code == "not_owned"  # 409 over HTTP
    assert not node_absent(cluster, name)


# -- Medium 5: ownership from the slot; labels the node set itself are removed ---------------------------------


def test_removal_succeeds_whatever_the_node_labelled_itself_and_its_own_labels_go(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    join_and_register(gw, req, files(), issued=True,
                      labels={LABEL_OPERATION: "op-someone-else", "gpu.kubeon.io/tier": "trusted"})
    gw.reconcile()
    labels = cluster.admin.core.read_node(req.node_name).metadata.labels
    assert labels[LABEL_OPERATION] == req.operation
    assert "gpu.kubeon.io/tier" not in labels
    # Removal before or after the labels are put right: the slot decides, never the label.
    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")


def test_removal_is_not_refused_by_an_operation_label_the_node_registered_with(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    join_and_register(gw, req, files(), issued=True, labels={LABEL_OPERATION: "op-someone-else"})
    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    assert all(s.node != req.node_name for s in gw.records.slots())


# -- High 4: a refusal the node cannot lift --------------------------------------------------------------------


def test_a_refused_node_is_tainted_no_execute_and_the_refusal_is_the_gateways(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes).model_copy(update={"gpus": 1})
    _, api = join_and_register(gw, req, files(), issued=True, gpus=8)
    assert req.node_name in gw.reconcile()["cordoned"]
    (slot,) = [s for s in gw.records.slots() if s.node == req.node_name]
    assert "8 GPUs" in slot.refused  # recorded where the node cannot write

    def refused() -> bool:
        node = cluster.admin.core.read_node(req.node_name)
        taints = {(t.key, t.effect) for t in node.spec.taints or []}
        return bool((JOIN_REFUSED_TAINT.key, "NoExecute") in taints and JOINING_TAINT.key in {k for k, _ in taints}
                    and node.spec.unschedulable and JOIN_REFUSED_ANNOTATION in node.metadata.annotations)

    assert refused()
    # The node drops the taint with its own credentials (if the API lets it): the next pass puts it back.
    taints = [t for t in cluster.admin.core.read_node(req.node_name).spec.taints if t.key != JOIN_REFUSED_TAINT.key]
    try:
        client.CoreV1Api(api).patch_node(req.node_name, {"spec": {"taints": [
            {"key": t.key, "value": t.value, "effect": t.effect} for t in taints]}})
    except client.ApiException as exc:
        assert exc.status in (403, 422), exc
    gw.reconcile()
    assert refused()


# -- Medium 7: removal revokes the node ------------------------------------------------------------------------


def test_a_node_recreated_with_a_removed_nodes_certificate_is_revoked(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    answer, api = join_and_register(gw, req, files(), issued=True)
    gw.reconcile()
    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    # The removed node's certificate is still valid: it registers its Node again.
    again = register_self(api, answer, annotations=KWOK_ANNOTATIONS)
    rv = cluster.admin.core.list_node(field_selector=f"metadata.name={req.node_name}").metadata.resource_version
    assert req.node_name in gw.reconcile()["revoked"]
    assert node_absent(cluster, req.node_name)
    seen = []
    for event in watch.Watch().stream(cluster.admin.core.list_node, field_selector=f"metadata.name={req.node_name}",
                                      resource_version=rv, timeout_seconds=3):
        node = event["object"]
        seen.append((event["type"], {(t.key, t.effect) for t in node.spec.taints or []}))
        if event["type"] == "DELETED":
            break
    assert ("MODIFIED", True) in [(kind, (JOIN_REFUSED_TAINT.key, "NoExecute") in taints) for kind, taints in seen]
    assert seen[-1][0] == "DELETED" and again.metadata.uid
    assert all(s.node != req.node_name for s in gw.records.slots())
    # Nor is a new node ever ticketed under that name while the tombstone stands (it would share the identity).
    with pytest.raises(JoinRefused) as refused:
        gw.issue_ticket(req)
    assert (refused.value.status, refused.value.code) == (409, "node_removed")
    assert http_join(gw, redeem_body(files(), gw.sign_ticket(req), req.node_name)) == (409, "node_exists")


# 900 s asked for, plus the 5 minutes the controller-manager's signer backdates notBefore by (clock skew).
LIFETIME = dt.timedelta(seconds=900 + 300)


def _certificate(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def http_renew(gw: KubeGateway, renewal: CertRenewal) -> tuple[int, str]:
    """``POST /v1/renew`` through the gateway's HTTP app (status, error code)."""
    app = create_app(gw, TokenReviewer(client.ApiClient()), frozenset(), auth_failures_per_minute=2)
    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.post("/v1/renew", json=renewal.model_dump(mode="json", by_alias=True))
    return response.status_code, str(response.json().get("error", ""))


def test_a_joined_node_renews_its_certificate_with_its_kubelet_key_and_it_serves(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """Medium 7: certificates are short (the gateway's cert_seconds) and burst nodes cannot renew through the
    API server; the gateway re-issues to a node that holds its slot and proves its kubelet key. The node's own
    renewal code writes the new certificate, which the API server accepts."""
    gw = gateway(gateway_api, cert_seconds=900)
    req = ticket_request(nodes)
    node_files = files()
    answer = gw.join(redeem_for(node_files, gw.issue_ticket(req).ticket, req.node_name))
    register_self(node_client(node_files, answer), answer, annotations=KWOK_ANNOTATIONS)
    first = _certificate(answer.certificate)
    assert first.not_valid_after_utc - first.not_valid_before_utc <= LIFETIME
    # What `node join` keeps (the renewal here goes to the gateway in-process, not to the document's URL).
    node_files.answer.write_text(answer.model_dump_json(by_alias=True))
    node_files.document.write_text(json.dumps({"gateway": "https://unused.invalid", "nodeName": req.node_name}))
    assert renew(node_files, renewer=gw.renew) is None  # not due: a third of its life has not passed
    renewed = renew(node_files, renewer=gw.renew, force=True)
    assert renewed is not None and renewed.certificate != answer.certificate
    second = _certificate(node_files.kubelet_cert.read_text())
    assert second.serial_number != first.serial_number
    assert second.public_key().public_numbers() == first.public_key().public_numbers()  # the same kubelet key
    assert second.subject == first.subject
    assert second.not_valid_after_utc - second.not_valid_before_utc <= LIFETIME
    # The kubeconfig the kubelet uses now carries the new certificate, and the API server takes it.
    as_renewed = client.CoreV1Api(node_api(node_files.kubeconfig))
    assert as_renewed.read_node(req.node_name).metadata.name == req.node_name
    # A retry in the same quarter of the lifetime gets the same certificate (one CSR object).
    again = gw.renew(CertRenewal(node_name=req.node_name, csr=kubelet_csr(kubelet_key(node_files), req.node_name)))
    assert again.certificate == renewed.certificate
    gw.remove_node(req.node_name, operation=req.operation)


def test_no_certificate_is_renewed_for_a_removed_node_another_key_or_an_unredeemed_slot(
        gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    node_files = files()
    gw.join(redeem_for(node_files, gw.issue_ticket(req).ticket, req.node_name))
    other_key = files()  # a thief of the node's name, without its kubelet key
    assert http_renew(gw, CertRenewal(node_name=req.node_name, csr=kubelet_csr(
        kubelet_key(other_key), req.node_name))) == (403, "key_mismatch")
    own = CertRenewal(node_name=req.node_name, csr=kubelet_csr(kubelet_key(node_files), req.node_name))
    gw.remove_node(req.node_name, operation=req.operation)
    # Removed: its last certificate ends with its lifetime (its tombstone outlives it); nothing new.
    assert http_renew(gw, own) == (403, "node_not_joined")
    # A reservation whose ticket was never redeemed holds no joined node.
    pending = ticket_request(nodes)
    gw.issue_ticket(pending)
    assert http_renew(gw, CertRenewal(node_name=pending.node_name, csr=kubelet_csr(
        kubelet_key(files()), pending.node_name))) == (403, "node_not_joined")
    gw.remove_node(pending.node_name, operation=pending.operation)


def test_refused_renewals_are_throttled_per_source(gateway_api: client.ApiClient, nodes: list[str],
                                                   files: Callable[[], NodeFiles]) -> None:
    """No one probes node names and keys at speed: refusals count like failed authentications (429 after the
    limit, without reading the gateway's records)."""
    gw = gateway(gateway_api)
    app = create_app(gw, TokenReviewer(client.ApiClient()), frozenset(), auth_failures_per_minute=2)
    probe = CertRenewal(node_name="burst-op-nothere00001", csr=kubelet_csr(kubelet_key(files()),
                                                                          "burst-op-nothere00001"))
    with TestClient(app, raise_server_exceptions=False) as http:
        codes = [http.post("/v1/renew", json=probe.model_dump(mode="json", by_alias=True)).status_code
                 for _ in range(3)]
    assert codes == [403, 403, 429]


def test_a_drain_removes_a_node_recreated_under_its_tombstone(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """The drain's removal of a node that re-registered before the reconciler revoked it is no 409 (the drain
    would retry for ever): its tombstone makes it the operation's, so it is deleted."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    answer, api = join_and_register(gw, req, files(), issued=True)
    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    register_self(api, answer, annotations=KWOK_ANNOTATIONS)
    with pytest.raises(TicketError, match="has no address slot"):
        gw.remove_node(req.node_name, operation="op-someone-else")
    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted again")


# -- Lows ------------------------------------------------------------------------------------------------------


def test_a_csr_precreated_under_the_joins_name_is_never_approved(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """Someone who knows a ticket's nonce creates ``kubeon-join-<nonce>`` first with the join's CSR and no expiry
    (the signer's maximum): never approved. A burst node (a removed node's certificate of that name) cannot even
    create it (the node admission policy; a home kubelet may ask only for its own name); any other identity with
    CSR create (here an administrator) is refused by the gateway."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    ticket = gw.issue_ticket(req).ticket
    redeem = redeem_for(files(), ticket, req.node_name)
    name = f"kubeon-join-{gw.verify(ticket).nonce}"
    body = client.V1CertificateSigningRequest(
        metadata=client.V1ObjectMeta(name=name), spec=client.V1CertificateSigningRequestSpec(
            request=base64.b64encode(redeem.csr.encode()).decode(), signer_name=KUBELET_CLIENT_SIGNER,
            usages=list(KUBELET_CLIENT_USAGES)))
    node_itself = client.CertificatesV1Api(Kube.from_kubeconfig(cluster.plane.node_kubeconfig(req.node_name)).api)
    with pytest.raises(client.ApiException) as denied:
        node_itself.create_certificate_signing_request(body)
    assert denied.value.status == 403
    client.CertificatesV1Api(cluster.admin.api).create_certificate_signing_request(body)
    try:
        with pytest.raises(JoinRefused, match="was not created by the gateway") as refused:
            gw.join(redeem)
        assert refused.value.status == 409
        obj = client.CertificatesV1Api(cluster.admin.api).read_certificate_signing_request(name)
        # (An administrator's kubelet CSR is auto-approved by the controller-manager: the gateway added nothing.)
        assert "KubeonGatewayValidated" not in [c.reason for c in obj.status.conditions or []]
    finally:
        client.CertificatesV1Api(cluster.admin.api).delete_certificate_signing_request(name)


def test_record_writes_of_a_pass_are_conditional(gateway_api: client.ApiClient, nodes: list[str]) -> None:
    """A slot read by a slow pass and changed meanwhile (re-pointed, released and re-issued) is neither marked
    registered nor deleted by that pass."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    gw.issue_ticket(req)
    (stale,) = [s for s in gw.records.slots() if s.node == req.node_name]
    gw.issue_ticket(req)  # the reservation changes (a retried launch)
    assert gw.records.mark_registered(stale, "uid-of-another-node") is False
    assert gw._reconciler.release(stale) is False  # the same conditional delete
    (fresh,) = [s for s in gw.records.slots() if s.node == req.node_name]
    assert fresh.registered_uid == "" and fresh.nonce != stale.nonce
    gw.remove_node(req.node_name, operation=req.operation)


def test_tickets_issued_over_the_wire_still_need_their_name_checked(gateway_api: client.ApiClient) -> None:
    gw = gateway(gateway_api)
    with pytest.raises(JoinRefused, match="not a burst node's name"):
        gw.issue_ticket(JoinTicketRequest(operation="op-0123456789ab", policy="p", location="sim/x",
                                          node_name="kube-control-plane", labels={LABEL_OPERATION: "op-x"},
                                          taints=[]))



# -- issue 27: the GPU health result is the node's word about itself only -----------------------------------------


def test_a_node_posts_its_gpu_health_on_its_own_node_and_never_on_another(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """The burn-in trusts the condition only as the word of the node it is on: the node's certificate may post it
    there (a strategic merge: the kubelet's Ready stays), and the Node authorizer with NodeRestriction refuses it on
    any other Node, so a node cannot pass (or fail) another's burn-in."""
    gw = gateway(gateway_api)
    mine, api = join_and_register(gw, ticket_request(nodes), files())
    other, _ = join_and_register(gw, ticket_request(nodes), files())
    healthy = GpuHealth(healthy=True, reason="DcgmDiagPassed", message="`dcgmi diag -r 1`: 9 test(s) passed")
    post_gpu_health(api, mine.node_name, healthy, wait_seconds=10)
    conditions = {c.type: c for c in cluster.admin.core.read_node(mine.node_name).status.conditions}
    assert (conditions[GPU_HEALTH_CONDITION].status, conditions[GPU_HEALTH_CONDITION].reason) == (
        "True", "DcgmDiagPassed")
    assert conditions["Ready"].status == "True"
    with pytest.raises(HealthNotPosted, match="403"):
        post_gpu_health(api, other.node_name, healthy.model_copy(update={"healthy": False}), wait_seconds=10)
    assert GPU_HEALTH_CONDITION not in {c.type for c in cluster.admin.core.read_node(other.node_name).status.conditions}


def test_the_kubelet_stand_ins_ready_heartbeats_keep_the_gpu_health_condition(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet stand-in (tests/harness/kubelet.py) with only the node's certificate registers the Node of its
    registration and heartbeats Ready with strategic merge patches of that condition alone: the GpuHealthy the node
    posted (node/health.py) survives every heartbeat, as under a real kubelet."""
    import threading

    from node.join import write_kubeconfig
    from node.join import write_registration
    from node.register import node_manifest
    from tests.harness import kubelet as stand_in

    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    node_files = files()
    answer = gw.join(redeem_for(node_files, gw.sign_ticket(req), req.node_name))
    write_kubeconfig(node_files, answer)
    capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}
    write_registration(node_files, answer, provider_id=f"sim://test/{answer.node_name}", capacity=capacity)
    monkeypatch.setattr(stand_in, "STATUS_SECONDS", 0.3)
    kubelet = stand_in.Kubelet(node_files.state_dir)
    runner = threading.Thread(target=kubelet.run, daemon=True)
    runner.start()
    try:
        node = wait_for(lambda: cluster.admin.core.read_node(answer.node_name), what="the stand-in's Node")
        wanted = node_manifest(json.loads(node_files.registration.read_text()))
        assert wanted["metadata"]["labels"].items() <= node.metadata.labels.items()  # + the API's beta.* os label
        # The node lifecycle controller adds node.kubernetes.io/not-ready until the first Ready heartbeat (on a loaded
        # machine it gets there first): its taints are not the registration's.
        assert [(t.key, t.value, t.effect) for t in node.spec.taints or []
                if not t.key.startswith("node.kubernetes.io/")] == [
            (t["key"], t.get("value"), t["effect"]) for t in wanted["spec"]["taints"]]
        assert node.spec.provider_id == wanted["spec"]["providerID"]
        assert [(a.type, a.address) for a in node.status.addresses] == [
            (a["type"], a["address"]) for a in wanted["status"]["addresses"]]
        assert (node.status.capacity, node.status.allocatable) == (capacity, capacity)

        api = node_api(node_files.kubeconfig)
        healthy = GpuHealth(healthy=True, reason="DcgmDiagPassed", message="`dcgmi diag -r 1`: 9 test(s) passed")
        post_gpu_health(api, answer.node_name, healthy, wait_seconds=10)
        api.close()
        posted = dt.datetime.now(dt.UTC)

        def conditions() -> dict[str, client.V1NodeCondition]:
            return {c.type: c for c in cluster.admin.core.read_node(answer.node_name).status.conditions}

        # Two heartbeats after the post (metav1.Time has whole seconds): each a patch of Ready only.
        wait_for(lambda: conditions()["Ready"].last_heartbeat_time >= posted + dt.timedelta(seconds=2),
                 what="two Ready heartbeats after the GPU health post", timeout=30)
        after = conditions()
        assert after["Ready"].status == "True" and after["Ready"].message == "kubelet stand-in is ready"
        assert (after[GPU_HEALTH_CONDITION].status, after[GPU_HEALTH_CONDITION].reason) == ("True", "DcgmDiagPassed")
    finally:
        kubelet.stopping.set()
        runner.join(timeout=10)
