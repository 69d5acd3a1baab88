"""launch_instance and the gateway's address slots on the real control plane (the gateway with its own
ServiceAccount, a pod CIDR /28 in /30s: 4 slots): a ticket reserves its node's slot before anything launches, the
fifth launch fails with AddressesExhausted and launches nothing, the compensation's removal and the reconciler (an
expired, unredeemed ticket) free a reservation, a retried launch holds one slot, and a node joins on the slot its
ticket reserved."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.burst import BurstActivities
from activities.clients.audit_log import AuditLog
from activities.clients.kube import KubeOps
from activities.providers.fake import FakeProvider
from gateway.attestation import AttestationVerifier
from gateway.service import KubeGateway
from gateway.slots import AddressPlan
from models.drain import NodeRemoval
from models.errors import ADDRESSES_EXHAUSTED_TYPE
from models.errors import JoinRefused
from models.join import JoinTicketRequest
from models.join import burst_node_name
from models.join import parse_user_data
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from models.locations import BurstConfig
from models.node import LaunchRequest
from models.provisioning import Offering
from node.join import NodeFiles
from tests.charts.helm import NAMESPACE
from tests.harness.identity import IdentityCA
from tests.harness.joining import FixedClock
from tests.harness.joining import gateway_credentials
from tests.harness.joining import redeem_for
from tests.harness.kube import Cluster

pytestmark = pytest.mark.cluster

# 4 slots: a /28 of pod addresses in /30s (the tunnel /29 would hold 5).
SMALL = AddressPlan(tunnel_cidr="10.250.0.0/29", pod_cidr="10.245.0.0/28", node_mask=30,
                    service_cidr="10.96.0.0/16")
OFFERING = Offering(location="fake/eu", instance_type="fake.l4.1", gpus=1, gpu_product="NVIDIA-L4",
                    instance_usd_per_hour=0.9, transfer_usd_per_gpu_hour=0.0)


@pytest.fixture(scope="module")
def gateway_api(cluster: Cluster) -> client.ApiClient:
    return gateway_credentials(cluster)


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture
def gateway(gateway_api: client.ApiClient, clock: FixedClock) -> Iterator[KubeGateway]:
    gw = KubeGateway(gateway_api, secrets.token_bytes(32), namespace=NAMESPACE, plan=SMALL, clock=clock)
    for slot in gw.records.slots():  # other tests' slots in the same namespace: this plan starts empty
        gw.records.delete(slot.name)
    yield gw
    for slot in gw.records.slots():
        gw.records.delete(slot.name)


class Launcher:
    """launch_instance as the worker runs it (an activity), with a provider that records every launch."""

    def __init__(self, cluster: Cluster, gateway: KubeGateway, tmp_path: Path, location: str = "fake/eu") -> None:
        self.provider = FakeProvider(name=location.split("/")[0])
        self.gateway = gateway
        self.offering = OFFERING.model_copy(update={"location": location})
        self.acts = BurstActivities(kube=KubeOps(cluster.admin.api), providers={self.provider.name: self.provider},
                                    gateway=gateway, config=BurstConfig(), audit=AuditLog(tmp_path / "audit.jsonl"))
        self.env = ActivityEnvironment()

    def request(self, operation: str | None = None) -> LaunchRequest:
        op = operation or f"op-{uuid.uuid4().hex[:12]}"
        return LaunchRequest(operation=op, cluster="test", policy="slots", allowed_locations=[self.offering.location],
                             offering=self.offering, node_name=burst_node_name(op),
                             labels={LABEL_OPERATION: op, LABEL_POLICY: "slots"},
                             taints=[Taint(key="gpu.kubeon.io/burst")])

    def launch(self, req: LaunchRequest) -> str:
        return str(self.env.run(self.acts.launch.launch_instance, req).instance_id)

    def launches(self) -> int:
        return sum(1 for method, _ in self.provider.calls if method == "launch")

    def ticket(self, instance_id: str) -> str:
        return str(self.join_document(instance_id)["ticket"])

    def join_document(self, instance_id: str) -> dict[str, Any]:
        return parse_user_data(self.provider.user_data[instance_id])


@pytest.fixture
def launcher(cluster: Cluster, gateway: KubeGateway, tmp_path: Path) -> Launcher:
    return Launcher(cluster, gateway, tmp_path)


@pytest.fixture
def files(tmp_path: Path) -> Callable[[], NodeFiles]:
    count = iter(range(100))
    return lambda: NodeFiles(tmp_path / f"node-{next(count)}")


def test_the_user_data_asks_for_the_signed_identity_the_gateway_verifies(
        cluster: Cluster, gateway: KubeGateway, gateway_api: client.ApiClient, tmp_path: Path) -> None:
    """Issue 27: where the gateway verifies a provider's instance identity (it has that provider's trust roots), its
    ticket grant says what the node must send and the launch's user data asks the node for it (the method, and the
    audience a GCP identity token is minted for); where it verifies none (here the sim-like fake provider), nothing
    is asked. The node program's reading of it and the gateway's verification: tests/harness/clouds/test_moto.py,
    tests/gateway/test_attestation.py."""
    verifying = KubeGateway(gateway_api, secrets.token_bytes(32), namespace=NAMESPACE, plan=SMALL, clock=FixedClock(),
                            attestation=AttestationVerifier(roots={"gcp": [IdentityCA().signer]},
                                                            audience="https://gateway.kubeon.test"))
    for location, asked in (("gcp/europe-west4", {"method": "gcp", "audience": "https://gateway.kubeon.test"}),
                            ("fake/eu", None)):
        launcher = Launcher(cluster, verifying, tmp_path, location=location)
        doc = launcher.join_document(launcher.launch(launcher.request()))
        assert doc.get("attestation") == asked, (location, doc)


def fill(launcher: Launcher) -> list[LaunchRequest]:
    reqs = [launcher.request() for _ in range(SMALL.slots)]
    for req in reqs:
        launcher.launch(req)
    return reqs


def test_the_fifth_launch_fails_with_addresses_exhausted_and_launches_nothing(launcher: Launcher) -> None:
    assert SMALL.slots == 4
    reqs = fill(launcher)
    room = launcher.gateway.capacity()
    assert (room.total, room.held, room.free) == (4, 4, 0)
    assert room.nodes == sorted(r.node_name for r in reqs)
    assert all(s.reserved for s in launcher.gateway.records.slots())  # no node has redeemed its ticket yet
    with pytest.raises(ApplicationError) as err:
        launcher.launch(launcher.request())
    assert err.value.type == ADDRESSES_EXHAUSTED_TYPE and err.value.non_retryable
    for part in ("all 4 address slots", "10.245.0.0/28", "/30", "KUBEON_GATEWAY_POD_CIDR",
                 "KUBEON_GATEWAY_NODE_CIDR_MASK"):
        assert part in err.value.message
    assert launcher.launches() == 4 and len(launcher.provider.instances) == 4


def test_removing_a_node_that_never_joined_frees_its_reservation(launcher: Launcher) -> None:
    reqs = fill(launcher)
    gone = reqs[1]
    freed = next(s.pod_cidr for s in launcher.gateway.records.slots() if s.node == gone.node_name)
    # The compensation of a failed launch: remove_node (cleanup_operation does the same).
    assert launcher.env.run(launcher.acts.drain.remove_node, NodeRemoval(node_name=gone.node_name,
                                                                   operation=gone.operation)) is False
    assert launcher.gateway.capacity().held == 3
    later = launcher.request()
    launcher.launch(later)
    assert next(s.pod_cidr for s in launcher.gateway.records.slots() if s.node == later.node_name) == freed
    assert launcher.launches() == 5


def test_an_expired_unredeemed_reservation_is_released_by_the_reconciler(launcher: Launcher, clock: FixedClock) -> None:
    reqs = fill(launcher)
    assert launcher.gateway.reconcile()["released"] == []
    assert launcher.gateway.capacity().held == 4
    clock.now += 15 * 60 + 1  # the tickets (900 s) expired, never redeemed
    assert sorted(launcher.gateway.reconcile()["released"]) == sorted(r.node_name for r in reqs)
    assert launcher.gateway.capacity().held == 0
    launcher.launch(launcher.request())  # room again
    assert launcher.launches() == 5


def test_a_retried_launch_holds_one_slot_and_its_node_joins_on_it(launcher: Launcher,
                                                                  files: Callable[[], NodeFiles]) -> None:
    req = launcher.request()
    first = launcher.launch(req)
    # The activity retried (the worker died after the launch): a new ticket, the same instance, one slot.
    assert launcher.launch(req) == first
    slots = launcher.gateway.records.slots()
    assert [s.node for s in slots] == [req.node_name] and slots[0].reserved
    reserved = slots[0]
    # The instance boots with the first attempt's user data: its ticket redeems the same reservation.
    node_files = files()
    answer = launcher.gateway.join(redeem_for(node_files, launcher.ticket(first), req.node_name))
    assert answer.pod_cidr == reserved.pod_cidr
    (joined,) = launcher.gateway.records.slots()
    assert joined.index == reserved.index and joined.wireguard_key and not joined.reserved
    # The same node retrying gets the same answer; the capacity still counts one slot.
    assert launcher.gateway.join(redeem_for(node_files, launcher.ticket(first), req.node_name)).pod_cidr == \
        reserved.pod_cidr
    assert launcher.gateway.capacity().held == 1
    # A further retry of the launch after the join: still one slot, and the new ticket cannot join again.
    launcher.launch(req)
    assert len(launcher.gateway.records.slots()) == 1


def test_a_launch_failed_over_to_another_location_joins_with_that_locations_labels(
        launcher: Launcher, files: Callable[[], NodeFiles]) -> None:
    """The first location had no capacity (no instance), the retry launched elsewhere with a new ticket: the one
    reservation now carries the new ticket's labels, and the node that joins is labelled where it runs."""
    req = launcher.request()
    first, second = (JoinTicketRequest(operation=req.operation, policy=req.policy, location=loc,
                                       node_name=req.node_name, labels={**req.labels, LABEL_LOCATION: label},
                                       taints=req.taints, gpus=gpus)
                     for loc, label, gpus in (("fake/eu", "fake.eu", 1), ("fake/us", "fake.us", 4)))
    launcher.gateway.issue_ticket(first)
    grant = launcher.gateway.issue_ticket(second)
    (slot,) = launcher.gateway.records.slots()
    assert slot.reserved and slot.labels[LABEL_LOCATION] == "fake.us" and slot.gpus == 4
    launcher.gateway.join(redeem_for(files(), grant.ticket, req.node_name))
    (joined,) = launcher.gateway.records.slots()
    assert joined.labels[LABEL_LOCATION] == "fake.us" and joined.gpus == 4 and not joined.reserved


def test_a_node_joins_on_the_slot_its_ticket_reserved_and_its_key_is_checked(
        launcher: Launcher, files: Callable[[], NodeFiles]) -> None:
    a, b = launcher.request(), launcher.request()
    ia, ib = launcher.launch(a), launcher.launch(b)
    by_node = {s.node: s for s in launcher.gateway.records.slots()}
    node_a = files()
    answer = launcher.gateway.join(redeem_for(node_a, launcher.ticket(ia), a.node_name))
    assert answer.pod_cidr == by_node[a.node_name].pod_cidr
    claimed = {s.node: s for s in launcher.gateway.records.slots()}
    assert claimed[a.node_name].wireguard_key and claimed[b.node_name].reserved
    # B's ticket with A's WireGuard key: refused, B's reservation untouched.
    stolen = redeem_for(files(), launcher.ticket(ib), b.node_name).model_copy(
        update={"wireguard_public_key": claimed[a.node_name].wireguard_key})
    with pytest.raises(JoinRefused, match="already the key of node") as err:
        launcher.gateway.join(stolen)
    assert err.value.code == "wireguard_key_in_use"
    assert {s.node: s for s in launcher.gateway.records.slots()}[b.node_name].reserved
    assert launcher.gateway.join(redeem_for(files(), launcher.ticket(ib), b.node_name)).pod_cidr == \
        by_node[b.node_name].pod_cidr
