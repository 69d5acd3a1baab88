"""Address slots against the real control plane: addresses never overlap and are freed with the node."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from kubernetes import client

from gateway.slots import AddressPlan
from models.errors import JoinRefused
from node.join import NodeFiles
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
