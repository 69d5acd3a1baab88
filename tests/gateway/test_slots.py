"""Address slots against the real control plane: addresses never overlap and are freed with the node."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable

import pytest
from kubernetes import client

from gateway.slots import SLOT_KEY_LABEL
from gateway.slots import SLOT_NODE_LABEL
from gateway.slots import TICKET_NODE_LABEL
from gateway.slots import AddressPlan
from gateway.slots import key_digest
from models.errors import JoinRefused
from models.errors import TicketError
from node.join import NodeFiles
from tests.charts.helm import NAMESPACE
from tests.gateway.helpers import gateway
from tests.gateway.helpers import ticket_request
from tests.harness.joining import redeem_for
from tests.harness.kube import Cluster

pytestmark = pytest.mark.cluster


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


def unlabel(cluster: Cluster, name: str, *labels: str) -> None:
    """Take lookup labels off a record, as a gateway from before them wrote it."""
    cluster.admin.core.patch_namespaced_config_map(name, NAMESPACE,
                                                   {"metadata": {"labels": dict.fromkeys(labels)}})
    held = cluster.admin.core.read_namespaced_config_map(name, NAMESPACE).metadata.labels or {}
    assert not set(labels) & set(held)


def test_a_nodes_slot_is_found_by_its_labels_and_one_written_before_them_still_is(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    key = secrets.token_bytes(32)
    gw = gateway(gateway_api, key)
    labelled, older = ticket_request(nodes), ticket_request(nodes)
    for req in (labelled, older):
        gw.join(redeem_for(files(), gw.sign_ticket(req), req.node_name))
    (slot,) = gw.records.slots_of(labelled.node_name)
    labels = cluster.admin.core.read_namespaced_config_map(slot.name, NAMESPACE).metadata.labels
    assert labels[SLOT_NODE_LABEL] == labelled.node_name and labels[SLOT_KEY_LABEL] == key_digest(slot.wireguard_key)
    assert [s.name for s in gw.records.slots_with_key(slot.wireguard_key)] == [slot.name]
    # A record from before the labels (a gateway upgraded while its nodes serve): the restarted gateway finds it by
    # reading them all until a full read has labelled it, then by its labels.
    (old,) = gw.records.slots_of(older.node_name)
    unlabel(cluster, old.name, SLOT_NODE_LABEL, SLOT_KEY_LABEL)
    restarted = gateway(gateway_api, key)
    assert [s.name for s in restarted.records.slots_of(older.node_name)] == [old.name]
    labels = cluster.admin.core.read_namespaced_config_map(old.name, NAMESPACE).metadata.labels
    assert labels[SLOT_NODE_LABEL] == older.node_name and labels[SLOT_KEY_LABEL] == key_digest(old.wireguard_key)
    unlabel(cluster, old.name, SLOT_KEY_LABEL)
    again = gateway(gateway_api, key)
    with pytest.raises(JoinRefused, match=f"already the key of node {older.node_name}") as err:  # its key still
        again.join(redeem_for(files(), again.sign_ticket(req := ticket_request(nodes)), req.node_name)
                   .model_copy(update={"wireguard_public_key": old.wireguard_key}))
    assert err.value.code == "wireguard_key_in_use"
    assert restarted.records.slots_of("burst-op-000000000000") == []
    # Ownership still holds through the label: another operation's question about this node is refused.
    with pytest.raises(TicketError, match="another operation"):
        restarted.identity(labelled.node_name, operation="op-ffffffffffff")
    assert restarted.identity(labelled.node_name, operation=labelled.operation).method == "none"
    assert restarted.remove_node(older.node_name, operation=older.operation) is False  # never registered: freed
    assert restarted.records.slots_of(older.node_name) == []


def test_a_removed_nodes_tombstone_written_before_its_label_still_refuses_its_name(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    key = secrets.token_bytes(32)
    gw = gateway(gateway_api, key)
    req = ticket_request(nodes)
    gw.join(redeem_for(files(), gw.sign_ticket(req), req.node_name))
    assert gw.remove_node(req.node_name, operation=req.operation) is False  # never registered: slot freed
    (tombstone,) = gw.records.tickets_of(req.node_name)
    assert tombstone.data["state"] == "released"
    unlabel(cluster, tombstone.name, TICKET_NODE_LABEL)
    restarted = gateway(gateway_api, key)
    with pytest.raises(JoinRefused, match="was removed") as err:
        restarted.issue_ticket(req)
    assert err.value.code == "node_removed"
    held = cluster.admin.core.read_namespaced_config_map(tombstone.name, NAMESPACE).metadata.labels
    assert held[TICKET_NODE_LABEL] == req.node_name  # labelled by that read: found by label from then on
    with pytest.raises(JoinRefused, match="was removed"):
        restarted.issue_ticket(req)


def test_a_slot_is_never_shared_nor_refused_from_a_stale_view_of_the_held_ones(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    plan = AddressPlan(tunnel_cidr="10.250.0.0/29", pod_cidr="10.245.0.0/22", node_mask=24,
                       service_cidr="10.96.0.0/16")
    gw, other = gateway(gateway_api, plan=plan), gateway(gateway_api, plan=plan)
    for slot in gw.records.slots():  # other tests' slots in the same namespace
        gw.records.delete(slot.name)
    assert gw.records.slots() == [] and gw.records.taken() == set()
    # Another gateway replica takes all four: gw, knowing none of it, tries each, then reads them all again.
    reqs = [ticket_request(nodes) for _ in range(4)]
    for r in reqs:
        other.join(redeem_for(files(), other.sign_ticket(r), r.node_name))
    extra = ticket_request(nodes)
    with pytest.raises(JoinRefused, match="no free address slot"):
        gw.join(redeem_for(files(), gw.sign_ticket(extra), extra.node_name))
    assert gw.records.taken() == {0, 1, 2, 3}
    # The other replica frees one: gw still holds all four as held, and finds the free one by reading again.
    assert other.remove_node(reqs[2].node_name, operation=reqs[2].operation) is False
    (freed,) = {0, 1, 2, 3} - {s.index for s in gw.records.slots() if s.node != reqs[2].node_name}
    gw.records._taken = {0, 1, 2, 3}  # the view before that removal
    later = ticket_request(nodes)
    answer = gw.join(redeem_for(files(), gw.sign_ticket(later), later.node_name))
    (slot,) = gw.records.slots_of(later.node_name)
    assert slot.index == freed and answer.pod_cidr == plan.slot(freed)[1]
    assert sorted(s.index for s in gw.records.slots()) == [0, 1, 2, 3]
