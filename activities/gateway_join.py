"""The gateway's side of a burst node's join, beyond the ticket: the kubelet client CSR's checks, the address
plan (tunnel IP and pod CIDR per node), the durable records the gateway keeps in the API, and its WireGuard
interface.

Records (ConfigMaps in the gateway's namespace, labelled ``app.kubernetes.io/managed-by=kubeon-gateway``), never
state held only in memory:

- ``kubeon-ticket-<nonce>``: a redeemed ticket, created at redemption (an atomic create: a second redemption
  finds it), kept until the ticket has expired, ``state=released`` once its node is gone. A ticket is single use
  for its whole lifetime.
- ``kubeon-slot-<i>``: address slot ``i`` (tunnel IP, pod CIDR) held by one node, with its WireGuard key and what
  its ticket says it must carry (labels, taints, GPUs). Reserved when the ticket is issued (no WireGuard key yet:
  nothing launches without a slot), completed with the key at redemption. Created atomically (409: taken, next
  slot), deleted when the node is removed or its ticket expired unredeemed. A restarted gateway rebuilds its
  WireGuard peers from these."""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from kubernetes import client

from models.errors import JoinRefused
from models.join import (
    KUBELET_CLIENT_OPTIONAL_USAGES,
    KUBELET_CLIENT_USAGES,
    NODE_USER_PREFIX,
    NODES_GROUP,
    TunnelAnswer,
)
from models.labels import Taint
from tunnel.uapi import Uapi

MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "kubeon-gateway"}

RECORD_LABEL: Final = "gpu.kubeon.io/gateway-record"

TICKET_PREFIX: Final = "kubeon-ticket-"

SLOT_PREFIX: Final = "kubeon-slot-"

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

@dataclass(frozen=True)
class AddressPlan:
    """Tunnel addresses (the gateway takes the first host, node slot ``i`` the ``i+2``-th) and per-node pod CIDRs
    (the ``i``-th ``/node_mask`` of ``pod_cidr``); ``service_cidr`` is routed through the tunnel too."""

    tunnel_cidr: str = "10.250.0.0/16"
    pod_cidr: str = "10.245.0.0/16"
    node_mask: int = 24
    service_cidr: str = "10.96.0.0/12"

    def __post_init__(self) -> None:
        nets = {}
        for name in ("tunnel_cidr", "pod_cidr", "service_cidr"):
            try:
                net = ipaddress.ip_network(getattr(self, name), strict=True)
            except ValueError as exc:
                raise ValueError(f"{name} {getattr(self, name)!r}: {exc}") from None
            if net.version != 4:
                raise ValueError(f"{name} {net}: only IPv4 is supported")
            nets[name] = net
        names = list(nets)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if nets[a].overlaps(nets[b]):
                    raise ValueError(f"{a} {nets[a]} overlaps {b} {nets[b]}")
        if not nets["pod_cidr"].prefixlen <= self.node_mask <= 30:
            raise ValueError(f"node_mask /{self.node_mask} must be between the pod CIDR's /"
                             f"{nets['pod_cidr'].prefixlen} and /30")
        if nets["tunnel_cidr"].prefixlen > 29:
            raise ValueError(f"tunnel_cidr {nets['tunnel_cidr']}: at least a /29")

    @property
    def gateway_ip(self) -> str:
        return str(ipaddress.ip_network(self.tunnel_cidr).network_address + 1)

    @property
    def slots(self) -> int:
        tunnel = ipaddress.ip_network(self.tunnel_cidr).num_addresses - 3  # network, gateway, broadcast
        pods = 2 ** (self.node_mask - ipaddress.ip_network(self.pod_cidr).prefixlen)
        return min(tunnel, pods)

    def exhausted(self) -> str:
        """Why no slot is free, naming the slot count, the CIDRs and the settings that size them."""
        return (f"no free address slot: all {self.slots} address slots of the gateway are held (tunnel "
                f"{self.tunnel_cidr}, pod CIDR {self.pod_cidr} in /{self.node_mask}s; sized by "
                "KUBEON_GATEWAY_TUNNEL_CIDR, KUBEON_GATEWAY_POD_CIDR and KUBEON_GATEWAY_NODE_CIDR_MASK): a new "
                "burst node waits until one goes home or an unredeemed ticket's reservation expires")

    def slot(self, index: int) -> tuple[str, str]:
        """``(tunnel IP, pod CIDR)`` of slot ``index``."""
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index} outside 0..{self.slots - 1}")
        tunnel = ipaddress.ip_network(self.tunnel_cidr).network_address + 2 + index
        pods = ipaddress.ip_network(self.pod_cidr)
        size = 2 ** (32 - self.node_mask)
        sub = ipaddress.ip_network(f"{pods.network_address + index * size}/{self.node_mask}")
        return str(tunnel), str(sub)

class Ticketed(Protocol):
    """What a slot records of the ticket it is for (``JoinTicket`` of activities.gateway, or a ``Slot``)."""

    nonce: str
    expires_at: float
    labels: dict[str, str]
    taints: list[Taint]
    gpus: int

def _ticket_data(ticket: Ticketed) -> dict[str, str]:
    return {"ticket": ticket.nonce, "expiresAt": repr(ticket.expires_at),
            "labels": json.dumps(dict(ticket.labels), sort_keys=True),
            "taints": json.dumps([t.model_dump() for t in ticket.taints]), "gpus": str(ticket.gpus)}

@dataclass
class Slot:
    index: int
    node: str
    wireguard_key: str
    tunnel_ip: str
    pod_cidr: str
    nonce: str
    operation: str
    labels: dict[str, str]
    taints: list[Taint]
    gpus: int
    expires_at: float
    registered_uid: str = ""
    resource_version: str = ""  # of the ConfigMap read; not part of its data

    @property
    def name(self) -> str:
        return f"{SLOT_PREFIX}{self.index}"

    @property
    def reserved(self) -> bool:
        """Reserved for a ticket not redeemed yet: no WireGuard key, no peer."""
        return not self.wireguard_key

    def data(self) -> dict[str, str]:
        return {
            "node": self.node, "wireguardPublicKey": self.wireguard_key, "tunnelIP": self.tunnel_ip,
            "podCIDR": self.pod_cidr, "operation": self.operation, "registeredUID": self.registered_uid,
            **_ticket_data(self),
        }

    @classmethod
    def from_configmap(cls, cm: client.V1ConfigMap) -> Slot:
        d = cm.data or {}
        return cls(
            index=int(cm.metadata.name.removeprefix(SLOT_PREFIX)), node=d["node"],
            wireguard_key=d["wireguardPublicKey"], tunnel_ip=d["tunnelIP"], pod_cidr=d["podCIDR"],
            nonce=d["ticket"], operation=d.get("operation", ""), labels=json.loads(d.get("labels", "{}")),
            taints=[Taint.model_validate(t) for t in json.loads(d.get("taints", "[]"))],
            gpus=int(d.get("gpus", "0")), expires_at=float(d.get("expiresAt", "0")),
            registered_uid=d.get("registeredUID", ""), resource_version=str(cm.metadata.resource_version or ""),
        )

@dataclass
class RecordStore:
    """The gateway's records as ConfigMaps in ``namespace``."""

    core: client.CoreV1Api
    namespace: str

    def _meta(self, name: str, kind: str) -> client.V1ObjectMeta:
        return client.V1ObjectMeta(name=name, namespace=self.namespace, labels={**MANAGED_BY, RECORD_LABEL: kind})

    def create_ticket(self, nonce: str, data: dict[str, str]) -> dict[str, str] | None:
        """Record a redemption; ``None`` if it is new, else the existing record's data."""
        try:
            self.core.create_namespaced_config_map(self.namespace, client.V1ConfigMap(
                metadata=self._meta(f"{TICKET_PREFIX}{nonce}", "ticket"), data=data))
            return None
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        existing = self.core.read_namespaced_config_map(f"{TICKET_PREFIX}{nonce}", self.namespace)
        return dict(existing.data or {})

    def release_ticket(self, nonce: str) -> None:
        try:
            self.core.patch_namespaced_config_map(f"{TICKET_PREFIX}{nonce}", self.namespace,
                                                  {"data": {"state": "released"}})
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def tickets(self) -> list[client.V1ConfigMap]:
        return list(self.core.list_namespaced_config_map(
            self.namespace, label_selector=f"{RECORD_LABEL}=ticket").items)

    def delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, self.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def slots(self) -> list[Slot]:
        items = self.core.list_namespaced_config_map(self.namespace, label_selector=f"{RECORD_LABEL}=slot").items
        return [Slot.from_configmap(cm) for cm in items]

    def create_slot(self, slot: Slot) -> bool:
        try:
            self.core.create_namespaced_config_map(self.namespace, client.V1ConfigMap(
                metadata=self._meta(slot.name, "slot"), data=slot.data()))
            return True
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise

    def claim(self, slot: Slot, ticket: Ticketed, *, wireguard_key: str) -> Slot | None:
        """Complete a reservation at redemption (the node's WireGuard key; the redeemed ticket, whose labels,
        taints and GPUs are those of the instance that exists), only if it is unchanged since read; ``None`` if it
        changed (another redemption claimed it, or it was released)."""
        cm = self._patch_unchanged(slot, {"wireguardPublicKey": wireguard_key, **_ticket_data(ticket)})
        return Slot.from_configmap(cm) if cm is not None else None

    def update_reservation(self, slot: Slot, ticket: Ticketed) -> bool:
        """Point an unredeemed reservation at a newer ticket of the same node (a retried launch, perhaps failed
        over to another location: its labels change with it); False if it changed since read."""
        return self._patch_unchanged(slot, _ticket_data(ticket)) is not None

    def _patch_unchanged(self, slot: Slot, data: dict[str, str]) -> client.V1ConfigMap | None:
        """Patch the slot's data only if it is as read (its resourceVersion); None if it changed or is gone."""
        try:
            return self.core.patch_namespaced_config_map(slot.name, self.namespace, {
                "metadata": {"resourceVersion": slot.resource_version}, "data": data})
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return None
            raise

    def delete_unchanged(self, slot: Slot) -> bool:
        """Delete a slot only if it is as read (a reservation being claimed meanwhile stays); False if not."""
        try:
            self.core.delete_namespaced_config_map(slot.name, self.namespace, body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(resource_version=slot.resource_version)))
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def mark_registered(self, slot: Slot, uid: str) -> None:
        self.core.patch_namespaced_config_map(slot.name, self.namespace, {"data": {"registeredUID": uid}})
        slot.registered_uid = uid

@dataclass
class GatewayTunnel:
    """The gateway's WireGuard interface (driven through UAPI; ``wireguard-go`` and the link are set up by the
    gateway process or the test bed) and what nodes are told about it."""

    interface: str
    private_key: str
    endpoint: str  # host:port nodes send UDP to; empty: the host nodes join at, and listen_port
    listen_port: int
    plan: AddressPlan = field(default_factory=AddressPlan)
    mtu: int = 1380
    persistent_keepalive: int = 25
    api_proxy_port: int = 443

    @property
    def uapi(self) -> Uapi:
        return Uapi(self.interface)

    @property
    def public_key(self) -> str:
        from tunnel.keys import public_key

        return public_key(self.private_key)

    def configure(self) -> None:
        self.uapi.configure(self.private_key, self.listen_port)

    def answer(self, slot: Slot, endpoint: str) -> TunnelAnswer:
        gw = self.plan.gateway_ip
        return TunnelAnswer(
            gateway_public_key=self.public_key, endpoint=endpoint, address=f"{slot.tunnel_ip}/32",
            gateway_address=gw, allowed_ips=[f"{gw}/32", self.plan.service_cidr, self.plan.pod_cidr],
            mtu=self.mtu, persistent_keepalive=self.persistent_keepalive)

    def sync(self, slots: list[Slot]) -> dict[str, Any]:
        """Make the interface's peers exactly ``slots`` (missing added, differing fixed, stale removed), touching
        only what differs: a set interrupts nothing that is already right."""
        uapi = self.uapi
        device = uapi.get()
        if not device.has_private_key or device.listen_port != self.listen_port:
            self.configure()
        # Reservations (tickets not redeemed yet) have no key and no peer.
        want = {s.wireguard_key: sorted([f"{s.tunnel_ip}/32", s.pod_cidr]) for s in slots if not s.reserved}
        added, removed = [], []
        for key, ips in want.items():
            peer = device.peers.get(key)
            if peer is None or sorted(peer.allowed_ips) != ips:
                uapi.set_peer(key, ips)
                added.append(key)
        for key in device.peers:
            if key not in want:
                uapi.remove_peer(key)
                removed.append(key)
        return {"added": added, "removed": removed}
