"""A burst node's admission: its ticket verified, its WireGuard key and kubelet client CSR checked, its
redemption recorded durably, its address slot held, its WireGuard peer added, and its CSR signed by the
cluster's kubelet-client signer (approved by the gateway only after the checks). The gateway creates no Node:
the node registers itself with that certificate, through the tunnel."""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Callable
from dataclasses import KW_ONLY
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from kubernetes import client

from common.kube import read_or_none
from gateway.attestation import AttestationVerifier
from gateway.settings import DEFAULT_CERT_SECONDS
from gateway.slots import MANAGED_BY
from gateway.slots import AddressPlan
from gateway.slots import RecordStore
from gateway.slots import SlotBook
from gateway.tickets import TicketSigner
from gateway.tunnel_end import GatewayTunnel
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import KUBELET_CLIENT_OPTIONAL_USAGES
from models.join import KUBELET_CLIENT_SIGNER
from models.join import KUBELET_CLIENT_USAGES
from models.join import NODE_USER_PREFIX
from models.join import NODES_GROUP
from models.join import CertRenewal
from models.join import CertRenewalAnswer
from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import url_host
from models.labels import JOINING_TAINT
from tunnel.keys import check_key
from tunnel.uapi import UapiError

# A node's kubelet client certificate lasts this long (the kubelet renews it with its own credentials).

API_SERVER_NAME = "kubernetes.default.svc"


def check_csr(pem: str, node_name: str, usages: list[str]) -> x509.CertificateSigningRequest:
    """The CSR, if it has exactly a kubelet client certificate's shape for ``node_name``: subject
    ``O=system:nodes, CN=system:node:<node>`` and nothing else, no extensions (no SANs), a valid self-signature,
    an RSA (>= 2048 bits) or EC P-256/P-384 key; ``usages`` digital signature + client auth (+ key
    encipherment)."""
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError:
        raise JoinRefused("csr_invalid", "csr: not a PEM CERTIFICATE REQUEST") from None
    if not csr.is_signature_valid:
        raise JoinRefused("csr_invalid", "csr: its signature does not verify with its own public key")
    want_cn = f"{NODE_USER_PREFIX}{node_name}"
    attrs = [(a.oid, a.value) for a in csr.subject]
    cns = [v for o, v in attrs if o == NameOID.COMMON_NAME]
    orgs = [v for o, v in attrs if o == NameOID.ORGANIZATION_NAME]
    others = [o._name for o, _ in attrs if o not in (NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME)]
    if cns != [want_cn]:
        raise JoinRefused("csr_invalid", f"csr: subject CN is {cns}, the ticket's node must use exactly "
                                         f"CN={want_cn}")
    if orgs != [NODES_GROUP]:
        raise JoinRefused("csr_invalid", f"csr: subject O is {orgs}, must be exactly O={NODES_GROUP}")
    if others:
        raise JoinRefused("csr_invalid", f"csr: subject has other attributes ({', '.join(others)}); only CN and O")
    for ext in csr.extensions:
        if isinstance(ext.value, x509.SubjectAlternativeName):
            raise JoinRefused("csr_invalid", "csr: has subject alternative names; a kubelet client certificate "
                                             "has none")
        raise JoinRefused("csr_invalid", f"csr: has the extension {ext.oid._name}; a kubelet client CSR has none")
    key = csr.public_key()
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise JoinRefused("csr_invalid", f"csr: RSA key of {key.key_size} bits, at least 2048")
    elif isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in ("secp256r1", "secp384r1"):
            raise JoinRefused("csr_invalid", f"csr: EC curve {key.curve.name}, use P-256 or P-384")
    else:
        raise JoinRefused("csr_invalid", f"csr: {type(key).__name__} keys are not signed; use EC P-256 or RSA")
    got = set(usages)
    required, allowed = set(KUBELET_CLIENT_USAGES), set(KUBELET_CLIENT_USAGES) | set(KUBELET_CLIENT_OPTIONAL_USAGES)
    if not required <= got or not got <= allowed or len(usages) != len(got):
        optional = ", ".join(KUBELET_CLIENT_OPTIONAL_USAGES)
        raise JoinRefused("csr_invalid", f"usages {sorted(usages)}: a kubelet client certificate has exactly "
                                         f"{sorted(required)} (and optionally {optional})")
    return csr

def key_fingerprint(csr: x509.CertificateSigningRequest) -> str:
    """sha256 of the CSR's public key (SubjectPublicKeyInfo): the same key, whatever the CSR's bytes."""
    der = csr.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


@dataclass(eq=False)
class Admission:
    """Joins nodes with the gateway's credentials: ``tickets`` verifies, ``slots`` holds the addresses,
    ``tunnel`` (None: no tunnel, sim nodes) gets the peer; ``endpoint`` says where nodes join (for the UDP
    endpoint when none is configured), ``on_join`` is told of every admitted node (the reconciler hurries)."""

    api: client.ApiClient
    tickets: TicketSigner
    slots: SlotBook
    records: RecordStore
    plan: AddressPlan
    tunnel: GatewayTunnel | None
    _: KW_ONLY
    endpoint: Callable[[], tuple[str, str]]
    on_join: Callable[[], None]
    cert_seconds: int = DEFAULT_CERT_SECONDS
    sign_timeout: float = 30.0
    tombstoned: Callable[[str], bool] = lambda _: False
    attestation: AttestationVerifier = field(default_factory=AttestationVerifier)
    _ca_bundle: str | None = field(default=None, init=False)
    _username: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._certs = client.CertificatesV1Api(self.api)

    def join(self, redeem: JoinRedeem) -> JoinAnswer:
        """Redeem a ticket: check it, the node's WireGuard key and its kubelet CSR; record the redemption
        durably; hold an address slot; add the WireGuard peer; get the CSR signed. The node registers its own
        Node afterwards, with the certificate, through the tunnel. A retry by the same node (the same keys: the
        CSR proves possession of the kubelet key) gets the same answer; anything else with a used ticket is
        refused."""
        ticket = self.tickets.verify(redeem.ticket)
        attested = self.attestation.verify(redeem.attestation, ticket.location, ticket=redeem.ticket)
        try:
            wg_key = check_key(redeem.wireguard_public_key, "wireguardPublicKey")
        except ValueError as exc:
            raise JoinRefused("wireguard_key_invalid", str(exc)) from None
        if self.tunnel is not None and wg_key == self.tunnel.public_key:
            raise JoinRefused("wireguard_key_in_use", "wireguardPublicKey is the gateway's own key")
        csr = check_csr(redeem.csr, ticket.node_name, redeem.usages)
        fingerprint = key_fingerprint(csr)
        # The records of this node and of this key, not every record: a join's cost does not grow with the nodes.
        for other in self.records.slots_with_key(wg_key):
            if other.nonce != ticket.nonce:
                raise JoinRefused("wireguard_key_in_use", f"wireguardPublicKey is already the key of node "
                                  f"{other.node}; every node needs its own key", status=409)
        slots = self.records.slots_of(ticket.node_name)
        for other in slots:
            if other.nonce != ticket.nonce and not (
                    other.reserved and other.operation == ticket.operation):  # a retried launch's reservation
                raise TicketError(f"node {ticket.node_name} already joined with another ticket", code="node_exists")
        held = next((s for s in slots if s.nonce == ticket.nonce), None) or next(
            (s for s in slots if s.reserved and ticket.nonce in s.nonces), None)
        if held is None and ticket.reserved:
            raise TicketError(f"join ticket for {ticket.node_name} was issued with an address slot reservation "
                              "that was released (its launch was compensated or its node removed); tickets are "
                              "single use", code="ticket_replayed")
        if held is None and self.tombstoned(ticket.node_name):
            if (self.records.ticket(ticket.nonce) or {}).get("state") == "released":
                raise TicketError(f"join ticket for {ticket.node_name} was already used and its node removed; "
                                  "tickets are single use", code="ticket_replayed")
            raise TicketError(f"node {ticket.node_name} was removed and its certificate may still be valid: no new "
                              "node joins under that name", code="node_exists")
        if (held is None or held.reserved) and self._node_exists(ticket.node_name):
            raise TicketError(f"node {ticket.node_name} exists and was not admitted by this ticket: no join "
                              "hands out an existing node's identity", code="node_exists")
        seen = self.records.create_ticket(ticket.nonce, {
            "node": ticket.node_name, "operation": ticket.operation, "expiresAt": repr(ticket.expires_at),
            "wireguardPublicKey": wg_key, "csrKey": fingerprint, "state": "redeemed",
            "attestation": attested.model_dump_json(by_alias=True)})
        if seen is not None:
            if seen.get("state") == "released":
                raise TicketError(f"join ticket for {ticket.node_name} was already used and its node removed; "
                                  "tickets are single use", code="ticket_replayed")
            if seen.get("csrKey") != fingerprint or seen.get("wireguardPublicKey") != wg_key:
                raise TicketError(f"join ticket for {ticket.node_name} was already redeemed with other keys; "
                                  "tickets are single use", code="ticket_replayed")
        # The slot its ticket reserved (found by nonce: the reservation may have been pointed at a newer ticket
        # of a retried launch, which remembers the older), completed with the node's key; a ticket issued
        # without one gets a free slot now.
        slot = next((s for s in slots if s.nonce == ticket.nonce), None) or next(
            (s for s in slots if s.reserved and ticket.nonce in s.nonces), None)
        if slot is None:
            slot = self.slots.allocate(ticket, ticket.node_name, ticket.operation, wg_key)
        elif slot.reserved:
            slot = self.slots.claim(slot, ticket, ticket.node_name, wg_key)
        if self.tunnel is not None:
            try:
                self.tunnel.uapi.set_peer(wg_key, [f"{slot.tunnel_ip}/32", slot.pod_cidr])
            except UapiError as exc:
                raise JoinRefused("tunnel_unavailable", str(exc), status=503) from None
        self.on_join()
        certificate = self._sign(f"kubeon-join-{ticket.nonce}", redeem.csr, csr, list(redeem.usages), ticket.node_name,
                                 f"its join ticket (operation {ticket.operation})")
        tunnel = self.tunnel.answer(slot, self._udp_endpoint()) if self.tunnel is not None else None
        api_server, api_server_name = self._node_api_server()
        return JoinAnswer(
            node_name=ticket.node_name, certificate=certificate, ca_bundle=self._cluster_ca(),
            api_server=api_server, api_server_name=api_server_name, pod_cidr=slot.pod_cidr,
            labels=dict(ticket.labels), taints=[*ticket.taints, JOINING_TAINT], tunnel=tunnel)

    def _node_exists(self, name: str) -> bool:
        return read_or_none(lambda: client.CoreV1Api(self.api).read_node(name)) is not None

    def _own_username(self) -> str:
        """The gateway's own user (SelfSubjectReview): the only requester of a join CSR it approves."""
        if self._username is None:
            review = client.AuthenticationV1Api(self.api).create_self_subject_review(client.V1SelfSubjectReview())
            info = review.status.user_info if review.status is not None else None
            self._username = str(info.username) if info is not None and info.username else ""
        return self._username

    def renew(self, renewal: CertRenewal) -> CertRenewalAnswer:
        """A new kubelet certificate for a node that still holds its address slot (joined, not removed, not
        refused) and proves, by the CSR's signature, the kubelet key it joined with (recorded at redemption). A
        removed node gets none: its last certificate ends with its lifetime, within its tombstone. One CSR object
        per node and quarter of a certificate's lifetime: a retry gets the same certificate."""
        csr = check_csr(renewal.csr, renewal.node_name, renewal.usages)
        node = renewal.node_name
        slot = next((s for s in self.records.slots_of(node) if not s.reserved), None)
        if slot is None or self.tombstoned(node):
            raise JoinRefused("node_not_joined", f"node {node} holds no address slot (it was removed, or never "
                              "joined): no certificate is renewed for it", status=403)
        if slot.refused:
            raise JoinRefused("node_refused", f"node {node} was refused by the gateway ({slot.refused}): no "
                              "certificate is renewed for it", status=403)
        record = self.records.ticket(slot.nonce) or {}
        if record.get("state") != "redeemed" or record.get("csrKey") != key_fingerprint(csr):
            raise JoinRefused("key_mismatch", f"the CSR's key is not the kubelet key node {node} joined with",
                              status=403)
        bucket = int(time.time() // max(self.cert_seconds // 4, 60))
        certificate = self._sign(f"kubeon-renew-{slot.nonce}-{bucket}", renewal.csr, csr, renewal.usages, node,
                                 f"renewal for {node} (operation {slot.operation}), which holds its address slot "
                                 "and proved its kubelet key")
        return CertRenewalAnswer(certificate=certificate)

    def _sign(self, name: str, pem: str, csr: x509.CertificateSigningRequest, usages: list[str], node_name: str,
              why: str) -> str:
        """Create the CSR object ``name`` for the kubelet-client signer, approve it (only this one, which was
        just checked, read back and checked again), and wait for the certificate."""
        body = client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=name, labels={**MANAGED_BY}),
            spec=client.V1CertificateSigningRequestSpec(
                request=base64.b64encode(pem.encode()).decode(), signer_name=KUBELET_CLIENT_SIGNER,
                usages=list(usages), expiration_seconds=self.cert_seconds))
        try:
            obj = self._certs.create_certificate_signing_request(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            obj = self._certs.read_certificate_signing_request(name)
            # Found, not created: someone else's object under the join's name (a node that knows the nonce) is
            # never approved, nor one asking for a longer certificate than the gateway's.
            requester, seconds = obj.spec.username, obj.spec.expiration_seconds
            if requester != self._own_username() or seconds is None or seconds > self.cert_seconds:
                raise JoinRefused("csr_mismatch", f"CSR {name} in the API was not created by the gateway for this "
                                  f"node (requester {requester!r}, expirationSeconds {seconds})", status=409) from None
        # What the API holds is what was checked: the same key, the same shape, our signer.
        held = base64.b64decode(obj.spec.request).decode()
        if obj.spec.signer_name != KUBELET_CLIENT_SIGNER or key_fingerprint(
                check_csr(held, node_name, list(obj.spec.usages or []))) != key_fingerprint(csr):
            raise JoinRefused("csr_mismatch", f"CSR {name} in the API is not the one this node sent", status=409)
        conditions = {c.type for c in (obj.status.conditions if obj.status else None) or []}
        if "Denied" in conditions or "Failed" in conditions:
            raise JoinRefused("csr_denied", f"CSR {name} was denied or failed", status=409)
        if "Approved" not in conditions:
            obj.status = client.V1CertificateSigningRequestStatus(conditions=[
                client.V1CertificateSigningRequestCondition(
                    type="Approved", status="True", reason="KubeonGatewayValidated",
                    message=f"kubelet client CSR for {node_name}, checked by the burst gateway: {why}")])
            self._certs.replace_certificate_signing_request_approval(name, obj)
        deadline = time.monotonic() + self.sign_timeout
        while True:
            obj = self._certs.read_certificate_signing_request(name)
            if obj.status is not None and obj.status.certificate:
                return base64.b64decode(obj.status.certificate).decode()
            if time.monotonic() > deadline:
                raise JoinRefused("csr_not_signed", f"CSR {name} approved but not signed within "
                                  f"{self.sign_timeout:.0f}s: is the controller-manager's csrsigning controller "
                                  "running with --cluster-signing-cert-file?", status=503)
            time.sleep(0.1)

    def _udp_endpoint(self) -> str:
        assert self.tunnel is not None
        if self.tunnel.endpoint:
            return self.tunnel.endpoint
        url, _ = self.endpoint()
        host = url_host(url)
        if not host:
            raise JoinRefused("no_tunnel_endpoint", "the gateway knows no address for its UDP endpoint: set "
                              "KUBEON_GATEWAY_TUNNEL_ENDPOINT or KUBEON_GATEWAY_PUBLIC_URL", status=503)
        return f"[{host}]:{self.tunnel.listen_port}" if ":" in host else f"{host}:{self.tunnel.listen_port}"

    def _cluster_ca(self) -> str:
        if self._ca_bundle is None:
            ca_file = self.api.configuration.ssl_ca_cert
            self._ca_bundle = Path(ca_file).read_text() if ca_file else ""
        return self._ca_bundle

    def _node_api_server(self) -> tuple[str, str]:
        """Where a node reaches the API server: through the tunnel, the gateway's proxy on its tunnel address,
        verified as kubernetes.default.svc; without one (sim), the gateway's own API server URL."""
        if self.tunnel is not None:
            return (f"https://{self.plan.gateway_ip}:{self.tunnel.api_proxy_port}", API_SERVER_NAME)
        return str(self.api.configuration.host), ""
