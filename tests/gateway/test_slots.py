"""Address slots against the real control plane: addresses never overlap and are freed with the node."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from kubernetes import client

from gateway.slots import SLOT_NODE_LABEL
from gateway.slots import AddressPlan
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


def test_a_nodes_slot_is_found_by_its_label_and_one_written_without_it_still_is(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    labelled, older = ticket_request(nodes), ticket_request(nodes)
    for req in (labelled, older):
        gw.join(redeem_for(files(), gw.sign_ticket(req), req.node_name))
    (slot,) = gw.records.slots_of(labelled.node_name)
    cm = cluster.admin.core.read_namespaced_config_map(slot.name, NAMESPACE)
    assert cm.metadata.labels[SLOT_NODE_LABEL] == labelled.node_name
    # A record from before the label (a gateway upgraded while its nodes serve): found by reading them all, and
    # the optimizer's questions about its node are answered as before.
    (old,) = gw.records.slots_of(older.node_name)
    cluster.admin.core.patch_namespaced_config_map(old.name, NAMESPACE,
                                                   {"metadata": {"labels": {SLOT_NODE_LABEL: None}}})
    assert SLOT_NODE_LABEL not in (cluster.admin.core.read_namespaced_config_map(old.name, NAMESPACE).metadata.labels
                                   or {})
    assert [s.name for s in gw.records.slots_of(older.node_name)] == [old.name]
    assert gw.records.slots_of("burst-op-000000000000") == []
    # Ownership still holds through the label: another operation's question about this node is refused.
    with pytest.raises(TicketError, match="another operation"):
        gw.identity(labelled.node_name, operation="op-ffffffffffff")
    assert gw.identity(labelled.node_name, operation=labelled.operation).method == "none"
    assert gw.remove_node(older.node_name, operation=older.operation) is False  # never registered: slot freed
    assert gw.records.slots_of(older.node_name) == []
