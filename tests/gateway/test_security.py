"""The gateway's credentials and state against an attacker (issue 21): a ticket never outlives its reservation,
never names a node that exists, removal decides ownership from the gateway's slot record (never a label), a
refusal the node cannot lift, a removed node's certificate never serves again, a CSR under the join's name is
only approved if the gateway made it, and the gateway's record writes are conditional. On the real control plane
(Node,RBAC authorization, NodeRestriction, the node admission policy, the CSR signer)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from kubernetes import client, watch

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.app import TokenReviewer, create_app
from gateway.service import KubeGateway
from models.errors import JoinRefused, TicketError
from models.join import KUBELET_CLIENT_SIGNER, KUBELET_CLIENT_USAGES, JoinTicketRequest
from models.labels import JOIN_REFUSED_ANNOTATION, JOIN_REFUSED_TAINT, JOINING_TAINT, LABEL_OPERATION
from node.join import NodeFiles
from tests.gateway.helpers import gateway, join_and_register, node_absent, ticket_request
from tests.harness.joining import redeem_for, register_self
from tests.harness.kube import Cluster, Kube, wait_for

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
    for name in ("kube-cp-1", "home-gpu-3", "burst-", "burst-UPPER", "burst-" + "a" * 64):
        with pytest.raises(JoinRefused, match="not a burst node's name"):
            gw.sign_ticket(req.model_copy(update={"node_name": name}))


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
    """A node that knows its ticket's nonce (and holds a certificate of its name: a removed node's) creates
    ``kubeon-join-<nonce>`` itself with the join's CSR and no expiry (the signer's maximum): never approved."""
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    ticket = gw.issue_ticket(req).ticket
    redeem = redeem_for(files(), ticket, req.node_name)
    name = f"kubeon-join-{gw.verify(ticket).nonce}"
    # The node itself (NodeRestriction lets a node ask only for its own name), before it redeems.
    intruder = client.CertificatesV1Api(Kube.from_kubeconfig(cluster.plane.node_kubeconfig(req.node_name)).api)
    intruder.create_certificate_signing_request(client.V1CertificateSigningRequest(
        metadata=client.V1ObjectMeta(name=name), spec=client.V1CertificateSigningRequestSpec(
            request=base64.b64encode(redeem.csr.encode()).decode(), signer_name=KUBELET_CLIENT_SIGNER,
            usages=list(KUBELET_CLIENT_USAGES))))
    try:
        with pytest.raises(JoinRefused, match="was not created by the gateway") as refused:
            gw.join(redeem)
        assert refused.value.status == 409
        obj = client.CertificatesV1Api(cluster.admin.api).read_certificate_signing_request(name)
        assert not obj.status.conditions and not obj.status.certificate
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

