"""The burst gateway seam: join tickets, the join itself, and Node removal.

The optimizer's ClusterRole (R5.1) cannot delete Nodes and reads no Secret. Joining a burst node (its kubelet
client certificate, its tunnel peer and addresses) and removing its Node belong to the gateway, which runs with
its own ServiceAccount and alone holds the ticket signing key. The gateway creates no Node: the node registers
itself with its own certificate (``system:node:<name>``, confined by the Node authorizer and NodeRestriction);
the gateway then applies what its ticket names. The optimizer talks to it through
``activities.clients.gateway.GatewayClient``; ``KubeGateway`` is the gateway's side, constructed with the
gateway's credentials, never the optimizer's. It composes one collaborator per job: ``TicketSigner``
(tickets), ``SlotBook`` (address slots), ``Admission`` (the join), ``Reconciler`` (after registration)."""

from __future__ import annotations

import logging
import time
from typing import Any

from kubernetes import client

from common.kube import RecentRead
from common.kube import read_or_none
from gateway.admission import Admission
from gateway.attestation import AttestationVerifier
from gateway.probe import probe_mtu
from gateway.reconciler import Reconciler
from gateway.settings import DEFAULT_CERT_SECONDS
from gateway.settings import ServiceRef
from gateway.slots import AddressPlan
from gateway.slots import RecordStore
from gateway.slots import Slot
from gateway.slots import SlotBook
from gateway.tickets import JoinTicket
from gateway.tickets import TicketSigner
from gateway.transfer import Transfer
from gateway.transfer import accumulate
from gateway.tunnel_end import GatewayTunnel
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import CertRenewal
from models.join import CertRenewalAnswer
from models.join import GatewayCapacity
from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import JoinTicketRequest
from models.join import NodeIdentity
from models.join import NodeProbe
from models.join import NodeTransfer
from models.join import TicketGrant
from models.join import url_host
from tunnel.uapi import UapiError

log = logging.getLogger("kubeon.gateway")

# How old the slot list a transfer reading is computed from may be (see KubeGateway.__init__).
TRANSFER_VIEW_SECONDS = 1.0


class GatewayAddressPending(Exception):
    """The gateway has no address burst nodes can reach yet (its LoadBalancer is being provisioned): retry."""


class GatewayAddressUnknown(Exception):
    """The gateway cannot tell burst nodes where it is: no public URL and its Service is no LoadBalancer."""


def endpoint_from_service(service: client.V1Service, ref: ServiceRef) -> tuple[str, str]:
    """``(https://<lb-host>:<port>, <name>.<ns>.svc)`` from a LoadBalancer Service's status and its port."""
    kind = service.spec.type if service.spec is not None else None
    if kind != "LoadBalancer":
        raise GatewayAddressUnknown(
            f"gateway Service {ref.name} is of type {kind}, not LoadBalancer, so it has no address burst nodes "
            f"can reach: set burst.gateway.publicUrl (e.g. https://<node address>:<nodePort>)")
    lb = service.status.load_balancer if service.status is not None else None
    ingress = [i for i in ((lb.ingress if lb is not None else None) or []) if i.hostname or i.ip]
    if not ingress:
        raise GatewayAddressPending(f"gateway Service {ref.name} has no LoadBalancer address yet (namespace "
                                    f"{ref.namespace}); retry once `kubectl -n {ref.namespace} get svc {ref.name}` "
                                    f"shows an EXTERNAL-IP, or set burst.gateway.publicUrl")
    host = str(ingress[0].hostname or ingress[0].ip)
    ports = (service.spec.ports if service.spec is not None else None) or []
    port = next((p for p in ports if p.name == "tunnel"), ports[0] if ports else None)
    if port is None:
        raise GatewayAddressUnknown(f"gateway Service {ref.name} has no port")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"https://{host}:{port.port}", ref.dns_name


class KubeGateway:
    """The gateway's own logic, with the gateway's Kubernetes credentials and signing key.

    Where burst nodes join: ``public_url`` when set (verified against its own host); else the LoadBalancer
    address of ``service`` (read at every ticket, verified against the Service's DNS name, which the chart's
    certificate carries); neither (dev, tests, in-process): the worker's configured URL."""

    def __init__(self, api: client.ApiClient, signing_key: bytes, *, clock: Any = time.time,
                 public_url: str = "", service: ServiceRef | None = None, namespace: str = "kubeon-gpu",
                 plan: AddressPlan | None = None, tunnel: GatewayTunnel | None = None,
                 cert_seconds: int = DEFAULT_CERT_SECONDS, sign_timeout: float = 30.0,
                 transfer_seconds: float = 10.0, attestation: AttestationVerifier | None = None) -> None:
        self._tickets = TicketSigner(signing_key, clock)
        self._attestation = attestation or AttestationVerifier()
        self._clock = clock
        self._core = client.CoreV1Api(api)
        self._public_url = public_url.rstrip("/")
        self._service = service
        self._tunnel = tunnel
        self._plan = tunnel.plan if tunnel is not None else (plan or AddressPlan())
        self._records = RecordStore(self._core, namespace)
        self._slots = SlotBook(self._records, self._plan)
        # Transfer readings are counters with their time: a slot list a second old gives the same totals (the
        # accounted part and the baseline move together), and it saves every serving node's first reading from
        # listing every slot (200 nodes starting to serve at once listed 200 slots each).
        self._recent_slots = RecentRead(self._records.slots, TRANSFER_VIEW_SECONDS)
        self._reconciler = Reconciler(self._core, self._records, tunnel, clock, tombstone_seconds=cert_seconds,
                                      transfer_seconds=transfer_seconds)
        self._admission = Admission(api, self._tickets, self._slots, self._records, self._plan, tunnel,
                                    endpoint=self.endpoint, on_join=self._joined, cert_seconds=cert_seconds,
                                    sign_timeout=sign_timeout, tombstoned=self._tombstoned,
                                    attestation=self._attestation)

    @property
    def tunnel(self) -> GatewayTunnel | None:
        return self._tunnel

    @property
    def records(self) -> RecordStore:
        return self._records

    # -- where nodes join ------------------------------------------------------------------------------------
    @property
    def public_url(self) -> str:
        return self._public_url

    @property
    def service(self) -> ServiceRef | None:
        return self._service

    def endpoint(self) -> tuple[str, str]:
        """``(endpoint URL, TLS server name)`` burst nodes use; ``("", "")`` when the worker's URL stands.
        Raises ``GatewayAddressPending`` until the LoadBalancer has an address, ``GatewayAddressUnknown`` when
        there can be none, ``ApiException`` when the Service cannot be read."""
        if self._public_url:
            return self._public_url, url_host(self._public_url)
        if self._service is None:
            return "", ""
        ref = self._service
        return endpoint_from_service(self._core.read_namespaced_service(ref.name, ref.namespace), ref)

    # -- tickets ---------------------------------------------------------------------------------------------
    def issue_ticket(self, request: JoinTicketRequest) -> TicketGrant:
        """A ticket and where to use it (the address first: no ticket while nodes could not reach us), with the
        node's address slot reserved until the ticket expires: ``AddressesExhausted`` when none is free, before
        any instance is launched for a node that could never join. The grant says which signed identity the node
        must send (the attestation its join is verified with), so the launch asks the node for it."""
        endpoint, server_name = self.endpoint()
        ticket = self._tickets.new(request, reserved=True)
        self._refuse_unowned_node(ticket.node_name, ticket.operation)
        self._slots.reserve(ticket, ticket.node_name, ticket.operation)
        return TicketGrant(ticket=self._tickets.encode(ticket), endpoint=endpoint, server_name=server_name,
                           attestation=self._attestation.request(ticket.location))

    def sign_ticket(self, request: JoinTicketRequest) -> str:
        """A signed ticket without a reservation (its join allocates a slot if one is free)."""
        return self._tickets.encode(self._tickets.new(request))

    def _tombstoned(self, node_name: str, operation: str | None = None) -> bool:
        """A released ticket of ``node_name`` (of ``operation``, if given) still names it: the node was removed
        and its certificate may still be valid."""
        now = self._clock()
        for record in self._records.tickets_of(node_name):
            data = record.data
            keep_until = max(float(data.get("expiresAt", "0")), float(data.get("keepUntil", "0")))
            if data.get("state") == "released" and keep_until >= now and operation in (None, data.get("operation")):
                return True
        return False

    def _refuse_unowned_node(self, node_name: str, operation: str) -> None:
        """No ticket for a Node that exists without a slot of this operation (a home or control-plane node, or
        another operation's): its join would hand out that node's identity. Nor for a removed node's name while
        its tombstone stands (its certificate may still be valid: a new node would share its identity)."""
        if self._tombstoned(node_name):
            raise JoinRefused("node_removed", f"node {node_name} was removed and its certificate may still be "
                              "valid: no new ticket for that name", status=409)
        try:
            self._core.read_node(node_name)
        except client.ApiException as exc:
            if exc.status == 404:
                return
            raise
        if not any(s.operation == operation for s in self._records.slots_of(node_name)):
            raise JoinRefused("node_exists", f"node {node_name} exists and the gateway holds no slot of operation "
                              f"{operation} for it: no ticket names an existing node", status=409)

    def capacity(self) -> GatewayCapacity:
        """The address slots and the nodes holding them (reservations included)."""
        return GatewayCapacity(total=self._plan.slots, nodes=sorted(s.node for s in self._records.slots()))

    def verify(self, token: str) -> JoinTicket:
        return self._tickets.verify(token)

    # -- the join, and after it ------------------------------------------------------------------------------
    def join(self, redeem: JoinRedeem) -> JoinAnswer:
        """See ``Admission.join``."""
        return self._admission.join(redeem)

    def renew(self, renewal: CertRenewal) -> CertRenewalAnswer:
        """See ``Admission.renew``."""
        return self._admission.renew(renewal)

    def _joined(self) -> None:
        self._reconciler.wake()

    def reconcile(self) -> dict[str, list[str]]:
        """One pass of ``Reconciler.reconcile``."""
        return self._reconciler.reconcile()

    def start_reconciler(self, interval: float = 1.0) -> None:
        self._reconciler.start(interval)

    def stop(self) -> None:
        """Stop the reconciler, then write every node's transfer counters (the interface goes with the gateway)."""
        self._reconciler.stop()
        try:
            self._reconciler.flush_transfer()
        except (client.ApiException, UapiError, OSError) as exc:
            log.warning("cannot write the tunnel transfer counters at shutdown (%s): up to %s lost",
                        type(exc).__name__, "what moved since the last write")

    # -- what the optimizer asks about one node of an operation ---------------------------------------------
    def _slots_of(self, node_name: str, operation: str, *, recent: bool = False) -> tuple[list[Slot], Slot | None]:
        """The address slots held for ``node_name``, and the one of ``operation`` among them (None: none is); when
        ``recent``, from a list at most TRANSFER_VIEW_SECONDS old if that holds the operation's slot (a miss is
        read again, so a slot made within that second is never taken for one that does not exist)."""
        if recent:
            slots = [s for s in self._recent_slots.get() if s.node == node_name]
            slot = next((s for s in slots if s.operation == operation), None)
            if slot is not None:
                return slots, slot
        slots = self._records.slots_of(node_name)
        return slots, next((s for s in slots if s.operation == operation), None)

    def _owned_slot(self, node_name: str, operation: str) -> Slot:
        """The address slot ``operation`` holds for ``node_name``: ``TicketError`` (``not_owned``) when the gateway
        holds that name for another operation only, ``JoinRefused`` 404 when it holds no slot of that name."""
        slots, slot = self._slots_of(node_name, operation)
        if slot is None:
            if slots:
                raise self._not_owned(node_name, operation)
            raise JoinRefused("unknown_node", f"the gateway holds no address slot for node {node_name}", status=404)
        return slot

    @staticmethod
    def _not_owned(node_name: str, operation: str) -> TicketError:
        return TicketError(f"node {node_name} has no address slot of operation {operation} at the gateway (it "
                           "belongs to another operation)", code="not_owned")

    # -- transfer --------------------------------------------------------------------------------------------
    def transfer(self, node_name: str, *, operation: str) -> NodeTransfer:
        """The bytes ``node_name`` of ``operation`` moved through the tunnel so far: its slot's accounted totals
        plus what its peer's counters moved since (read now, nothing written); once removed, its final counters
        (kept in its ticket's tombstone, as long as that stands). ``measured_at`` 0: never measured (no tunnel at
        this gateway, or the node never joined). ``TicketError`` (``not_owned``) when the gateway holds that name
        for another operation only, ``JoinRefused`` 404 when it holds nothing of that name."""
        slots, slot = self._slots_of(node_name, operation, recent=True)
        counters = self._tunnel.counters() if self._tunnel is not None else {}
        if slot is not None and self._tunnel is not None and not slot.reserved and slot.wireguard_key not in counters:
            # No peer for a joined slot of that list: the node may have been removed since; its final counters are
            # then in the tombstone, so the slots are read again rather than the list's older totals returned.
            slots, slot = self._slots_of(node_name, operation)
        if slot is not None:
            counted = slot.transfer
            if self._tunnel is not None and not slot.reserved:
                raw = counters.get(slot.wireguard_key)
                if raw is not None:
                    counted = accumulate(counted, raw[0], raw[1], self._clock())
        else:
            # Removed: its final counters are in the tombstone of the ticket it joined with (while it stands).
            released = [r.data for r in self._records.tickets_of(node_name) if r.data.get("transfer")]
            owned = [d for d in released if d.get("operation") == operation]
            if not owned:
                if slots or released:
                    raise self._not_owned(node_name, operation)
                raise JoinRefused("unknown_node", f"the gateway holds no address slot nor a removed node's record "
                                  f"for node {node_name}", status=404)
            counted = Transfer.loads(owned[0]["transfer"])
        return NodeTransfer(rx_bytes=counted.rx_bytes, tx_bytes=counted.tx_bytes, measured_at=counted.measured_at)

    # -- the attested identity ------------------------------------------------------------------------------
    def identity(self, node_name: str, *, operation: str) -> NodeIdentity:
        """What the gateway verified of the instance identity ``node_name`` of ``operation`` joined with (its
        ticket's redemption record); method ``none`` when nothing was attested (a sim node, a provider without trust
        roots). ``TicketError`` (``not_owned``) for another operation's node, ``JoinRefused`` 404 for one the gateway
        holds no slot for or whose ticket was not redeemed yet: the optimizer reads only its own joined nodes."""
        slot = self._owned_slot(node_name, operation)
        record = None if slot.reserved else self._records.ticket(slot.nonce)
        if record is None or record.get("state") != "redeemed":
            raise JoinRefused("not_joined", f"node {node_name} has not joined: its ticket is not redeemed",
                              status=404)
        stored = record.get("attestation")
        return NodeIdentity.model_validate_json(stored) if stored else NodeIdentity(method="none", verified=False)

    # -- the burn-in's tunnel probe ---------------------------------------------------------------------------
    def probe(self, node_name: str, *, operation: str) -> NodeProbe:
        """Whether ``node_name`` of ``operation``'s tunnel carries a full-MTU packet (gateway.probe); a node
        without a tunnel here (a sim node, a gateway without one) has nothing to probe. ``TicketError``
        (``not_owned``) for another operation's node, ``JoinRefused`` 404 for one the gateway holds no slot for:
        the optimizer probes only the node of the operation it names."""
        slot = self._owned_slot(node_name, operation)
        if self._tunnel is None or slot.reserved:
            return NodeProbe(tunnel=False, detail=f"node {node_name} has no tunnel at this gateway")
        found = probe_mtu(slot.tunnel_ip, self._tunnel.mtu)
        return NodeProbe(tunnel=True, mtu=self._tunnel.mtu, answered=found.answered, rtt_ms=found.rtt_ms,
                         detail=found.detail)

    # -- node removal ----------------------------------------------------------------------------------------
    def remove_node(self, node_name: str, *, operation: str) -> bool:
        """Delete a burst Node of ``operation``, remove its WireGuard peer and free its addresses (also a slot
        reserved by a ticket never redeemed: the compensation of a failed launch), its tickets tombstoned for
        good. Ownership is the gateway's slot record, never a label the node could write: a Node without a slot
        of ``operation`` (or a tombstone of it: a removed node that registered again) is refused (``not_owned``).
        False if it is already gone."""
        removed = False
        for _ in range(5):  # each round lost a race against a reconcile pass writing the slot
            slots = [s for s in self._records.slots_of(node_name) if s.operation == operation]
            node = read_or_none(lambda: self._core.read_node(node_name))
            if node is not None:
                if not slots and not self._tombstoned(node_name, operation):
                    raise TicketError(f"node {node_name} has no address slot of operation {operation} at the "
                                      "gateway: not a node it admitted for it; not removing", code="not_owned")
                try:
                    self._core.delete_node(node_name)
                    removed = True
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise
            if all([self._reconciler.release(slot) for slot in slots]):
                return removed
        raise JoinRefused("slot_conflict", f"the address slot of node {node_name} kept changing while it was "
                          "removed; retry", status=503)


__all__ = ["GatewayAddressPending", "GatewayAddressUnknown", "KubeGateway", "ServiceRef", "endpoint_from_service"]
