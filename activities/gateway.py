"""The burst gateway seam: join tickets, the join itself, and Node removal.

The optimizer's ClusterRole (R5.1) cannot delete Nodes and reads no Secret. Joining a burst node (its kubelet
client certificate, its tunnel peer and addresses) and removing its Node belong to the gateway, which runs with
its own ServiceAccount and alone holds the ticket signing key. The gateway creates no Node: the node registers
itself with its own certificate (``system:node:<name>``, confined by the Node authorizer and NodeRestriction);
the gateway then applies what its ticket names. Activities talk to it through ``GatewayClient``;
``KubeGateway`` is the gateway's side, constructed with the gateway's credentials, never the optimizer's."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from kubernetes import client
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, Field

from activities.gateway_join import (
    MANAGED_BY,
    AddressPlan,
    GatewayTunnel,
    RecordStore,
    Slot,
    check_csr,
    key_fingerprint,
)
from models.errors import AddressesExhausted, JoinRefused, TicketError
from models.join import (
    KUBELET_CLIENT_SIGNER,
    GatewayCapacity,
    JoinAnswer,
    JoinRedeem,
    JoinTicketRequest,
    TicketGrant,
    url_host,
)
from models.labels import GPU_RESOURCE, JOIN_REFUSED_ANNOTATION, JOINING_TAINT, LABEL_OPERATION, Taint
from tunnel.keys import check_key
from tunnel.uapi import UapiError

log = logging.getLogger("kubeon.gateway")

# A node's kubelet client certificate lasts this long (the kubelet renews it with its own credentials).
DEFAULT_CERT_SECONDS = 24 * 3600

# Ticket records outlive their ticket by this much (clock skew between gateway replicas).
TICKET_RECORD_GRACE_SECONDS = 300

API_SERVER_NAME = "kubernetes.default.svc"

class _SlotChanged(Exception):
    """A reservation changed between read and update: read again."""

class JoinTicket(BaseModel):
    operation: str
    policy: str
    location: str
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]
    expires_at: float
    gpus: int = 0
    nonce: str = Field(default_factory=lambda: secrets.token_hex(8))

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))

class GatewayAddressPending(Exception):
    """The gateway has no address burst nodes can reach yet (its LoadBalancer is being provisioned): retry."""

class GatewayAddressUnknown(Exception):
    """The gateway cannot tell burst nodes where it is: no public URL and its Service is no LoadBalancer."""

@dataclass(frozen=True)
class ServiceRef:
    """The gateway's own Service, whose LoadBalancer address burst nodes connect to."""

    name: str
    namespace: str

    @property
    def dns_name(self) -> str:
        """The name the chart's certificate carries and burst nodes verify it against (tls-server-name)."""
        return f"{self.name}.{self.namespace}.svc"

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
                 cert_seconds: int = DEFAULT_CERT_SECONDS, sign_timeout: float = 30.0) -> None:
        if len(signing_key) < 16:
            raise ValueError("gateway ticket signing key must be at least 16 bytes")
        self._api = api
        self._core = client.CoreV1Api(api)
        self._certs = client.CertificatesV1Api(api)
        self._key = signing_key
        self._clock = clock
        self._public_url = public_url.rstrip("/")
        self._service = service
        self._tunnel = tunnel
        self._plan = tunnel.plan if tunnel is not None else (plan or AddressPlan())
        self._records = RecordStore(self._core, namespace)
        self._cert_seconds = cert_seconds
        self._sign_timeout = sign_timeout
        self._ca_bundle: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._joining = False  # a slot whose node has not registered yet, or is still under its joining taint

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
        any instance is launched for a node that could never join."""
        endpoint, server_name = self.endpoint()
        ticket = self._new_ticket(request)
        self._reserve(ticket)
        return TicketGrant(ticket=self._encode(ticket), endpoint=endpoint, server_name=server_name)

    def sign_ticket(self, request: JoinTicketRequest) -> str:
        """A signed ticket without a reservation (its join allocates a slot if one is free)."""
        return self._encode(self._new_ticket(request))

    def _new_ticket(self, request: JoinTicketRequest) -> JoinTicket:
        return JoinTicket(
            operation=request.operation, policy=request.policy, location=request.location,
            node_name=request.node_name, labels=request.labels, taints=request.taints,
            expires_at=self._clock() + request.ttl_seconds, gpus=request.gpus,
        )

    def _encode(self, ticket: JoinTicket) -> str:
        body = _b64(ticket.model_dump_json().encode())
        return f"{body}.{_b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())}"

    def _reserve(self, ticket: JoinTicket) -> None:
        """Hold an address slot for the ticket's node. A retried launch (a new ticket for the same node and
        operation) keeps the one slot: an unredeemed reservation is pointed at the newer ticket (the node may
        still redeem the older one: ``join`` finds the reservation by node and operation), a redeemed one is
        already the node's."""
        for _ in range(5):  # bounded: each round lost a race against a join or a release of that slot
            try:
                self._reserve_once(ticket)
                return
            except _SlotChanged:
                continue
            except client.ApiException as exc:  # retryable: a 5xx answer, an exception the caller retries
                raise JoinRefused("kubernetes_api_error", f"reserving an address slot for {ticket.node_name}: "
                                  f"Kubernetes API error {exc.status}: {exc.reason}", status=502) from None
        raise JoinRefused("slot_conflict", f"the address slot of {ticket.node_name} kept changing while the "
                          "ticket was issued; retry", status=503)

    def _reserve_once(self, ticket: JoinTicket) -> None:
        slots = self._records.slots()
        mine = [s for s in slots if s.node == ticket.node_name and s.operation == ticket.operation]
        if not mine:
            self._allocate(ticket, "", slots)
            return
        held = mine[0]  # a redeemed slot is already the node's: nothing to reserve
        if held.reserved and not self._records.update_reservation(held, ticket):
            raise _SlotChanged

    def capacity(self) -> GatewayCapacity:
        """The address slots and the nodes holding them (reservations included)."""
        return GatewayCapacity(total=self._plan.slots, nodes=sorted(s.node for s in self._records.slots()))

    def verify(self, token: str) -> JoinTicket:
        body, _, sig = token.partition(".")
        expected = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        if not sig or not hmac.compare_digest(sig, expected):
            raise TicketError("join ticket signature is invalid", code="ticket_invalid")
        try:
            ticket = JoinTicket.model_validate_json(_unb64(body))
        except ValueError as exc:
            raise TicketError(f"join ticket is malformed: {exc}", code="ticket_invalid") from None
        if ticket.expires_at < self._clock():
            raise TicketError(f"join ticket for {ticket.node_name} expired", code="ticket_expired")
        return ticket

    # -- the join ---------------------------------------------------------------------------------------------
    def join(self, redeem: JoinRedeem) -> JoinAnswer:
        """Redeem a ticket: check it, the node's WireGuard key and its kubelet CSR; record the redemption
        durably; hold an address slot; add the WireGuard peer; get the CSR signed. The node registers its own
        Node afterwards, with the certificate, through the tunnel. A retry by the same node (the same keys: the
        CSR proves possession of the kubelet key) gets the same answer; anything else with a used ticket is
        refused."""
        ticket = self.verify(redeem.ticket)
        try:
            wg_key = check_key(redeem.wireguard_public_key, "wireguardPublicKey")
        except ValueError as exc:
            raise JoinRefused("wireguard_key_invalid", str(exc)) from None
        if self._tunnel is not None and wg_key == self._tunnel.public_key:
            raise JoinRefused("wireguard_key_in_use", "wireguardPublicKey is the gateway's own key")
        csr = check_csr(redeem.csr, ticket.node_name, redeem.usages)
        fingerprint = key_fingerprint(csr)
        slots = self._records.slots()
        for other in slots:
            if other.wireguard_key == wg_key and other.nonce != ticket.nonce:
                raise JoinRefused("wireguard_key_in_use", f"wireguardPublicKey is already the key of node "
                                  f"{other.node}; every node needs its own key", status=409)
            if other.node == ticket.node_name and other.nonce != ticket.nonce and not (
                    other.reserved and other.operation == ticket.operation):  # a retried launch's reservation
                raise TicketError(f"node {ticket.node_name} already joined with another ticket", code="node_exists")
        seen = self._records.create_ticket(ticket.nonce, {
            "node": ticket.node_name, "operation": ticket.operation, "expiresAt": repr(ticket.expires_at),
            "wireguardPublicKey": wg_key, "csrKey": fingerprint, "state": "redeemed"})
        if seen is not None:
            if seen.get("state") == "released":
                raise TicketError(f"join ticket for {ticket.node_name} was already used and its node removed; "
                                  "tickets are single use", code="ticket_replayed")
            if seen.get("csrKey") != fingerprint or seen.get("wireguardPublicKey") != wg_key:
                raise TicketError(f"join ticket for {ticket.node_name} was already redeemed with other keys; "
                                  "tickets are single use", code="ticket_replayed")
        # The slot its ticket reserved (found by nonce, or by node and operation: a retried launch pointed it at a
        # newer ticket), completed with the node's key; a ticket issued without one gets a free slot now.
        slot = next((s for s in slots if s.nonce == ticket.nonce), None) or next(
            (s for s in slots if s.reserved and s.node == ticket.node_name and s.operation == ticket.operation), None)
        if slot is None:
            slot = self._allocate(ticket, wg_key, slots)
        elif slot.reserved:
            slot = self._claim(slot, ticket, wg_key)
        if self._tunnel is not None:
            try:
                self._tunnel.uapi.set_peer(wg_key, [f"{slot.tunnel_ip}/32", slot.pod_cidr])
            except UapiError as exc:
                raise JoinRefused("tunnel_unavailable", str(exc), status=503) from None
        self._joining = True
        certificate = self._sign(csr, redeem, ticket)
        tunnel = self._tunnel.answer(slot, self._udp_endpoint()) if self._tunnel is not None else None
        api_server, api_server_name = self._node_api_server()
        return JoinAnswer(
            node_name=ticket.node_name, certificate=certificate, ca_bundle=self._cluster_ca(),
            api_server=api_server, api_server_name=api_server_name, pod_cidr=slot.pod_cidr,
            labels=dict(ticket.labels), taints=[*ticket.taints, JOINING_TAINT], tunnel=tunnel)

    def _allocate(self, ticket: JoinTicket, wg_key: str, slots: list[Slot]) -> Slot:
        taken = {s.index for s in slots}
        for index in range(self._plan.slots):
            if index in taken:
                continue
            tunnel_ip, pod_cidr = self._plan.slot(index)
            slot = Slot(index=index, node=ticket.node_name, wireguard_key=wg_key, tunnel_ip=tunnel_ip,
                        pod_cidr=pod_cidr, nonce=ticket.nonce, operation=ticket.operation,
                        labels=dict(ticket.labels), taints=list(ticket.taints), gpus=ticket.gpus,
                        expires_at=ticket.expires_at)
            if self._records.create_slot(slot):  # 409: a concurrent ticket or join took it; the next one
                return slot
        raise AddressesExhausted(self._plan.exhausted())

    def _claim(self, slot: Slot, ticket: JoinTicket, wg_key: str) -> Slot:
        claimed = self._records.claim(slot, ticket, wireguard_key=wg_key)
        if claimed is not None:
            return claimed
        # Changed since read: a concurrent retry of this same join (same key) claimed it, or it was released.
        again = next((s for s in self._records.slots() if s.nonce == ticket.nonce), None)
        if again is not None and again.wireguard_key == wg_key:
            return again
        raise JoinRefused("slot_conflict", f"the address slot reserved for {ticket.node_name} changed while it "
                          "joined; retry", status=503)

    def _sign(self, csr: x509.CertificateSigningRequest, redeem: JoinRedeem, ticket: JoinTicket) -> str:
        """Create the CSR object for the kubelet-client signer, approve it (only this one, which was just
        checked, read back and checked again), and wait for the certificate."""
        name = f"kubeon-join-{ticket.nonce}"
        body = client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=name, labels={**MANAGED_BY}),
            spec=client.V1CertificateSigningRequestSpec(
                request=base64.b64encode(redeem.csr.encode()).decode(), signer_name=KUBELET_CLIENT_SIGNER,
                usages=list(redeem.usages), expiration_seconds=self._cert_seconds))
        try:
            obj = self._certs.create_certificate_signing_request(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            obj = self._certs.read_certificate_signing_request(name)
        # What the API holds is what was checked: the same key, the same shape, our signer.
        held = base64.b64decode(obj.spec.request).decode()
        if obj.spec.signer_name != KUBELET_CLIENT_SIGNER or key_fingerprint(
                check_csr(held, ticket.node_name, list(obj.spec.usages or []))) != key_fingerprint(csr):
            raise JoinRefused("csr_mismatch", f"CSR {name} in the API is not the one this join sent", status=409)
        conditions = {c.type for c in (obj.status.conditions if obj.status else None) or []}
        if "Denied" in conditions or "Failed" in conditions:
            raise JoinRefused("csr_denied", f"CSR {name} was denied or failed", status=409)
        if "Approved" not in conditions:
            obj.status = client.V1CertificateSigningRequestStatus(conditions=[
                client.V1CertificateSigningRequestCondition(
                    type="Approved", status="True", reason="KubeonGatewayValidated",
                    message=f"kubelet client CSR for {ticket.node_name}, checked by the burst gateway against "
                            f"its join ticket (operation {ticket.operation})")])
            self._certs.replace_certificate_signing_request_approval(name, obj)
        deadline = time.monotonic() + self._sign_timeout
        while True:
            obj = self._certs.read_certificate_signing_request(name)
            if obj.status is not None and obj.status.certificate:
                return base64.b64decode(obj.status.certificate).decode()
            if time.monotonic() > deadline:
                raise JoinRefused("csr_not_signed", f"CSR {name} approved but not signed within "
                                  f"{self._sign_timeout:.0f}s: is the controller-manager's csrsigning controller "
                                  "running with --cluster-signing-cert-file?", status=503)
            time.sleep(0.1)

    def _udp_endpoint(self) -> str:
        assert self._tunnel is not None
        if self._tunnel.endpoint:
            return self._tunnel.endpoint
        url, _ = self.endpoint()
        host = url_host(url)
        if not host:
            raise JoinRefused("no_tunnel_endpoint", "the gateway knows no address for its UDP endpoint: set "
                              "KUBEON_GATEWAY_TUNNEL_ENDPOINT or KUBEON_GATEWAY_PUBLIC_URL", status=503)
        return f"[{host}]:{self._tunnel.listen_port}" if ":" in host else f"{host}:{self._tunnel.listen_port}"

    def _cluster_ca(self) -> str:
        if self._ca_bundle is None:
            ca_file = self._api.configuration.ssl_ca_cert
            self._ca_bundle = Path(ca_file).read_text() if ca_file else ""
        return self._ca_bundle

    def _node_api_server(self) -> tuple[str, str]:
        """Where a node reaches the API server: through the tunnel, the gateway's proxy on its tunnel address,
        verified as kubernetes.default.svc; without one (sim), the gateway's own API server URL."""
        if self._tunnel is not None:
            return (f"https://{self._plan.gateway_ip}:{self._tunnel.api_proxy_port}", API_SERVER_NAME)
        return str(self._api.configuration.host), ""

    # -- after registration, and node removal ----------------------------------------------------------------
    def reconcile(self) -> dict[str, list[str]]:
        """One pass: label and taint registered nodes as their tickets say (only those), cordon a node whose
        capacity exceeds its ticket's offering, release the slots of removed nodes and of tickets that expired
        unregistered, resync the WireGuard peers with the slots, drop ticket records past their expiry."""
        report: dict[str, list[str]] = {"labelled": [], "cordoned": [], "released": []}
        # Slots first, then nodes: a slot marked registered names a node that existed before this list.
        slots = self._records.slots()
        nodes = {n.metadata.name: n for n in self._core.list_node().items}
        now = self._clock()
        live = []
        for slot in slots:
            if slot.reserved:  # a ticket not redeemed: no peer, no node; released once the ticket expired
                if slot.expires_at < now and self._records.delete_unchanged(slot):
                    report["released"].append(slot.node)
                continue
            node = nodes.get(slot.node)
            if node is None:
                if (slot.registered_uid or slot.expires_at < now) and self._node_gone(slot.node):
                    self._release(slot)
                    report["released"].append(slot.node)
                else:
                    live.append(slot)
                continue
            if slot.registered_uid and node.metadata.uid != slot.registered_uid:
                # The Node was deleted and registered again (with a still valid certificate): not the node the
                # ticket admitted. Its slot goes; the new object is cordoned and never served.
                self._cordon(node, "re-registered after its node was removed")
                self._release(slot)
                report["released"].append(slot.node)
                report["cordoned"].append(slot.node)
                continue
            live.append(slot)
            if not slot.registered_uid:
                self._records.mark_registered(slot, str(node.metadata.uid))
            gpus = parse_quantity((node.status.capacity or {}).get(GPU_RESOURCE, "0") if node.status else "0")
            refused = (node.metadata.annotations or {}).get(JOIN_REFUSED_ANNOTATION)
            if slot.gpus and gpus > slot.gpus and not refused:
                refused = f"reports {gpus} GPUs, its ticket's offering has {slot.gpus}"
                self._cordon(node, refused)
                report["cordoned"].append(slot.node)
            if self._apply_ticket(node, slot, lift_joining=not refused):
                report["labelled"].append(slot.node)
        self._joining = any(not s.registered_uid or s.node in report["labelled"] for s in live)
        if self._tunnel is not None:
            self._tunnel.sync(live)
        for record in self._records.tickets():
            if float((record.data or {}).get("expiresAt", "0")) + TICKET_RECORD_GRACE_SECONDS < now:
                self._records.delete(str(record.metadata.name))
        return report

    def _node_gone(self, name: str) -> bool:
        try:
            self._core.read_node(name)
        except client.ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    def _apply_ticket(self, node: client.V1Node, slot: Slot, *, lift_joining: bool) -> bool:
        """The ticket's labels and taints (only those), the pod CIDR; the joining taint lifted when checked."""
        labels = node.metadata.labels or {}
        patch: dict[str, Any] = {}
        wrong = {k: v for k, v in slot.labels.items() if labels.get(k) != v}
        if wrong:
            patch["metadata"] = {"labels": wrong}
        taints = node.spec.taints or []
        have = {(t.key, t.effect) for t in taints}
        missing = [t for t in slot.taints if (t.key, t.effect) not in have]
        keep = [t for t in taints if not (lift_joining and t.key == JOINING_TAINT.key)]
        spec: dict[str, Any] = {}
        if missing or len(keep) != len(taints):
            spec["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in keep] + [
                t.model_dump() for t in missing]
        if not node.spec.pod_cidr:
            spec["podCIDR"] = slot.pod_cidr
        if spec:
            patch["spec"] = spec
        if patch:
            self._core.patch_node(slot.node, patch)
        return bool(patch)

    def _cordon(self, node: client.V1Node, reason: str) -> None:
        self._core.patch_node(str(node.metadata.name), {
            "metadata": {"annotations": {JOIN_REFUSED_ANNOTATION: reason}}, "spec": {"unschedulable": True}})

    def _release(self, slot: Slot) -> None:
        if self._tunnel is not None and slot.wireguard_key:
            with contextlib.suppress(UapiError):
                self._tunnel.uapi.remove_peer(slot.wireguard_key)
        self._records.release_ticket(slot.nonce)
        self._records.delete(slot.name)

    def start_reconciler(self, interval: float = 1.0, joining_interval: float = 0.25) -> None:
        """Reconcile every ``interval`` seconds in a daemon thread, until ``stop()``; every ``joining_interval``
        while a node that joined has not registered yet (its joining taint is lifted that much sooner)."""
        def loop() -> None:
            wait = interval
            while not self._stop.wait(wait):
                try:
                    self.reconcile()
                except Exception as exc:  # the API may be briefly away; the next pass retries
                    log.warning("gateway reconcile failed: %s: %s", type(exc).__name__, exc)
                wait = joining_interval if self._joining else interval

        if self._thread is None:
            self._thread = threading.Thread(target=loop, name="gateway-reconcile", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def remove_node(self, node_name: str, *, operation: str) -> bool:
        """Delete a burst Node of ``operation``, remove its WireGuard peer and free its addresses (also a slot
        reserved by a ticket never redeemed: the compensation of a failed launch). False if it is already gone;
        refuses any other node."""
        try:
            node = self._core.read_node(node_name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            node = None
        if node is not None:
            owner = (node.metadata.labels or {}).get(LABEL_OPERATION)
            if owner != operation:
                raise TicketError(f"node {node_name} belongs to operation {owner!r}, not {operation}; not removing",
                                  code="not_owned")
            try:
                self._core.delete_node(node_name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        for slot in self._records.slots():
            if slot.node == node_name and slot.operation == operation:
                self._release(slot)
        return node is not None

