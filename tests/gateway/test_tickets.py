"""Join tickets against the real control plane, redeemed with the gateway's own ServiceAccount: signatures,
expiry (injected clock), durable single use; a refused ticket leaves no record and no CSR."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable

import pytest
from kubernetes import client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.tickets import _b64
from gateway.tickets import _unb64
from models.errors import TicketError
from node.join import NodeFiles
from tests.gateway.helpers import gateway
from tests.gateway.helpers import node_absent
from tests.gateway.helpers import nonce_of
from tests.gateway.helpers import records
from tests.gateway.helpers import ticket_request
from tests.harness.joining import FixedClock
from tests.harness.joining import node_client
from tests.harness.joining import redeem_for
from tests.harness.joining import register_self
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


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
