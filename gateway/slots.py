"""Address slots: the address plan (tunnel IP and pod CIDR per node), the durable records the gateway keeps in
the API, and holding a slot for a ticket (reserved when it is issued, claimed when it is redeemed).

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
import itertools
import json
import threading
import zlib
from dataclasses import dataclass
from dataclasses import field
from typing import Final
from typing import Protocol

from kubernetes import client

from common.kube import raw_items
from gateway.transfer import Transfer
from models.errors import AddressesExhausted
from models.errors import JoinRefused
from models.labels import Taint

MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "kubeon-gateway"}

RECORD_LABEL: Final = "gpu.kubeon.io/gateway-record"

# Records name what they are looked up by in labels too, so a ticket issued or redeemed reads the records of its own
# node (and key), never every record: reading them all made each node's cost grow with the number of nodes (issue
# 26). A slot names its node and, once joined, its WireGuard key (a digest: a key is not a label value); a ticket
# names its node. What decides is always the record's data, read fresh: the label only finds it. Records written
# before a label existed are labelled by the first full read of their kind (RecordStore.slots, .tickets: a
# gateway's first reconcile pass); until one has, every lookup reads them all.
SLOT_NODE_LABEL: Final = "gpu.kubeon.io/gateway-slot-node"
SLOT_KEY_LABEL: Final = "gpu.kubeon.io/gateway-slot-key"
TICKET_NODE_LABEL: Final = "gpu.kubeon.io/gateway-ticket-node"
LABEL_VALUE_MAX: Final = 63

TICKET_PREFIX: Final = "kubeon-ticket-"

SLOT_PREFIX: Final = "kubeon-slot-"

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
    """What a slot records of the ticket it is for (``JoinTicket`` of gateway.tickets, or a ``Slot``)."""

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
    # Older tickets this reservation was issued for (a retried launch re-pointed it at a newer one): each may still
    # redeem it while it is unredeemed, and each is tombstoned with it when it is released.
    previous: list[str] = field(default_factory=list)
    # Why the gateway refused the node that registered on this slot (kept here, where the node cannot write).
    refused: str = ""
    # The node's tunnel traffic as accounted so far (gateway.transfer): survives the gateway's restarts.
    transfer: Transfer = field(default_factory=Transfer)

    @property
    def nonces(self) -> list[str]:
        """Every ticket this slot was issued for."""
        return [self.nonce, *(n for n in self.previous if n != self.nonce)]

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
            "previousTickets": json.dumps(self.previous), "refused": self.refused, **_ticket_data(self),
            "transfer": self.transfer.dumps(),
        }

    @classmethod
    def from_configmap(cls, cm: client.V1ConfigMap) -> Slot:
        return cls.from_record(str(cm.metadata.name), str(cm.metadata.resource_version or ""), cm.data or {})

    @classmethod
    def from_record(cls, name: str, resource_version: str, d: dict[str, str]) -> Slot:
        return cls(
            index=int(name.removeprefix(SLOT_PREFIX)), node=d["node"],
            wireguard_key=d["wireguardPublicKey"], tunnel_ip=d["tunnelIP"], pod_cidr=d["podCIDR"],
            nonce=d["ticket"], operation=d.get("operation", ""), labels=json.loads(d.get("labels", "{}")),
            taints=[Taint.model_validate(t) for t in json.loads(d.get("taints", "[]"))],
            gpus=int(d.get("gpus", "0")), expires_at=float(d.get("expiresAt", "0")),
            registered_uid=d.get("registeredUID", ""), resource_version=resource_version,
            previous=list(json.loads(d.get("previousTickets", "[]"))), refused=d.get("refused", ""),
            transfer=Transfer.loads(d.get("transfer", "")),
        )

@dataclass(frozen=True)
class TicketRecord:
    """A ticket's record: redeemed (its node), or a tombstone (released)."""

    name: str
    data: dict[str, str]


def key_digest(wireguard_key: str) -> str:
    """A WireGuard public key as a label value (base64 is not one): the first 160 bits of its SHA-256, in hex."""
    return hashlib.sha256(wireguard_key.encode()).hexdigest()[:40]


def record_labels(kind: str, data: dict[str, str]) -> dict[str, str]:
    """The lookup labels a record of ``kind`` with ``data`` carries (a node name longer than a label value has
    none: its node's records are found by reading them all)."""
    node = data.get("node", "")
    labels = {}
    if 0 < len(node) <= LABEL_VALUE_MAX:
        labels[SLOT_NODE_LABEL if kind == "slot" else TICKET_NODE_LABEL] = node
    if kind == "slot" and data.get("wireguardPublicKey"):
        labels[SLOT_KEY_LABEL] = key_digest(data["wireguardPublicKey"])
    return labels


@dataclass
class RecordStore:
    """The gateway's records as ConfigMaps in ``namespace``."""

    core: client.CoreV1Api
    namespace: str
    # Kinds whose every record carried its lookup labels at a full read (or was labelled then): from then on a
    # lookup by label is the answer. Per process: a gateway that starts reads them all first.
    _labelled: set[str] = field(default_factory=set, init=False, repr=False)
    # The slot indexes held at the last full read, with this gateway's creates and deletes since: where a new slot
    # is looked for first. Only a hint: a create is conditional, and none is declared free before a fresh read.
    _taken: set[int] | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def _meta(self, name: str, kind: str, labels: dict[str, str] | None = None) -> client.V1ObjectMeta:
        return client.V1ObjectMeta(name=name, namespace=self.namespace,
                                   labels={**MANAGED_BY, RECORD_LABEL: kind, **(labels or {})})

    def create_ticket(self, nonce: str, data: dict[str, str]) -> dict[str, str] | None:
        """Record a redemption; ``None`` if it is new, else the existing record's data."""
        try:
            self.core.create_namespaced_config_map(self.namespace, client.V1ConfigMap(
                metadata=self._meta(f"{TICKET_PREFIX}{nonce}", "ticket", record_labels("ticket", data)), data=data))
            return None
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        existing = self.core.read_namespaced_config_map(f"{TICKET_PREFIX}{nonce}", self.namespace)
        return dict(existing.data or {})

    def release_ticket(self, nonce: str, *, node: str, operation: str, keep_until: float,
                       transfer: Transfer | None = None) -> None:
        """Mark a ticket released for good: its record (created now as a tombstone if the ticket was never
        redeemed: a compensated launch) refuses every later redemption, and names its node until ``keep_until``
        (the node's certificate may outlive its removal: a Node re-created under that name is revoked)."""
        data = {"state": "released", "node": node, "operation": operation, "keepUntil": repr(keep_until)}
        name = f"{TICKET_PREFIX}{nonce}"
        for _ in range(5):
            try:
                existing = self.core.read_namespaced_config_map(name, self.namespace)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
                existing = None
            if existing is None:
                created = {**data, "expiresAt": repr(keep_until)}
                if transfer is not None:  # the node's final tunnel traffic, still answered after its slot is gone
                    created["transfer"] = transfer.dumps()
                try:
                    self.core.create_namespaced_config_map(self.namespace, client.V1ConfigMap(
                        metadata=self._meta(name, "ticket", record_labels("ticket", created)), data=created))
                    return
                except client.ApiException as exc:
                    if exc.status != 409:  # a redemption (or another release) recorded it meanwhile: read again
                        raise
                continue
            patch = dict(data)
            kept = Transfer.loads((existing.data or {}).get("transfer", ""))
            # Two releases of one slot race (the reconciler's pass and a removal): the one that read the peer's
            # counters last wins, never an older reading over a newer one (the node's final cost would shrink).
            if transfer is not None and transfer.measured_at >= kept.measured_at:
                patch["transfer"] = transfer.dumps()
            try:  # only over the version read: a concurrent release's write is read again, not overwritten
                self.core.patch_namespaced_config_map(name, self.namespace, {
                    "metadata": {"resourceVersion": existing.metadata.resource_version,
                                 "labels": record_labels("ticket", data)}, "data": patch})
                return
            except client.ApiException as exc:
                if exc.status not in (404, 409):
                    raise
        raise RuntimeError(f"ticket record {TICKET_PREFIX}{nonce} kept changing while it was released")

    def ticket(self, nonce: str) -> dict[str, str] | None:
        """A ticket's record (redeemed, or a tombstone), None if there is none."""
        try:
            return dict(self.core.read_namespaced_config_map(f"{TICKET_PREFIX}{nonce}", self.namespace).data or {})
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _records(self, kind: str, selector: str = "") -> list[tuple[str, str, dict[str, str]]]:
        """Each record of ``kind`` (and ``selector``): (name, resourceVersion, data), read as plain JSON (the
        client's model objects cost more CPU than the request, issue 26). A full read (no ``selector``) labels
        every record that lacks its lookup labels (written before them) and returns it as labelled."""
        items = raw_items(self.core.list_namespaced_config_map(
            self.namespace, label_selector=",".join(filter(None, (f"{RECORD_LABEL}={kind}", selector))),
            _preload_content=False))
        records = []
        for item in items:
            meta, data = item["metadata"], item.get("data") or {}
            name, version = str(meta["name"]), str(meta.get("resourceVersion", ""))
            wanted = record_labels(kind, data)
            if not selector and any((meta.get("labels") or {}).get(k) != v for k, v in wanted.items()):
                version = self._label(name, version, wanted) or version
            records.append((name, version, data))
        if not selector:
            self._labelled.add(kind)
        return records

    def _label(self, name: str, version: str, labels: dict[str, str]) -> str | None:
        """Add lookup labels to a record as read (its data untouched); its new resourceVersion, None if it changed
        meanwhile (the writer that changed it labelled it, or the next full read will)."""
        try:
            cm = self.core.patch_namespaced_config_map(name, self.namespace, {
                "metadata": {"resourceVersion": version, "labels": labels}})
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return None
            raise
        return str(cm.metadata.resource_version or "")

    def _lookup(self, kind: str, label: str, value: str) -> list[tuple[str, str, dict[str, str]]] | None:
        """The records of ``kind`` labelled ``label=value``; None when that may not be the whole answer (no full
        read of the kind has labelled the records written before the label yet, or ``value`` is no label value):
        read them all."""
        if len(value) > LABEL_VALUE_MAX or kind not in self._labelled:
            return None
        return self._records(kind, f"{label}={value}")

    def tickets(self) -> list[TicketRecord]:
        return [TicketRecord(name, data) for name, _, data in self._records("ticket")]

    def tickets_of(self, node: str) -> list[TicketRecord]:
        """The ticket records (redeemed, tombstones) naming ``node``."""
        found = self._lookup("ticket", TICKET_NODE_LABEL, node)
        records = [TicketRecord(n, d) for n, _, d in found] if found is not None else self.tickets()
        return [r for r in records if r.data.get("node") == node]

    def delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, self.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise

    def slots(self) -> list[Slot]:
        slots = [Slot.from_record(*record) for record in self._records("slot")]
        with self._lock:
            self._taken = {s.index for s in slots}
        return slots

    def slots_of(self, node: str) -> list[Slot]:
        """The slots held for ``node`` (found by its label; the answer must not depend on whether a record was
        written before the label)."""
        found = self._lookup("slot", SLOT_NODE_LABEL, node)
        slots = [Slot.from_record(*record) for record in found] if found is not None else self.slots()
        return [s for s in slots if s.node == node]

    def slots_with_key(self, wireguard_key: str) -> list[Slot]:
        """The joined slots whose node's WireGuard key is ``wireguard_key``."""
        found = self._lookup("slot", SLOT_KEY_LABEL, key_digest(wireguard_key))
        slots = [Slot.from_record(*record) for record in found] if found is not None else self.slots()
        return [s for s in slots if s.wireguard_key == wireguard_key]

    def taken(self, *, fresh: bool = False) -> set[int]:
        """The slot indexes held as far as this gateway knows (see ``_taken``); read them all when ``fresh``, or
        the first time."""
        with self._lock:
            taken = None if fresh or self._taken is None else set(self._taken)
        return taken if taken is not None else {s.index for s in self.slots()}

    def _hold(self, index: int, held: bool) -> None:
        with self._lock:
            if self._taken is not None:
                (self._taken.add if held else self._taken.discard)(index)

    def create_slot(self, slot: Slot) -> bool:
        try:
            data = slot.data()
            self.core.create_namespaced_config_map(self.namespace, client.V1ConfigMap(
                metadata=self._meta(slot.name, "slot", record_labels("slot", data)), data=data))
            self._hold(slot.index, True)
            return True
        except client.ApiException as exc:
            if exc.status == 409:
                self._hold(slot.index, True)
                return False
            raise

    def claim(self, slot: Slot, ticket: Ticketed, *, wireguard_key: str) -> Slot | None:
        """Complete a reservation at redemption (the node's WireGuard key; the redeemed ticket, whose labels,
        taints and GPUs are those of the instance that exists), only if it is unchanged since read; ``None`` if it
        changed (another redemption claimed it, or it was released)."""
        previous = [n for n in slot.nonces if n != ticket.nonce]
        cm = self._patch_unchanged(slot, {"wireguardPublicKey": wireguard_key, **_ticket_data(ticket),
                                          "previousTickets": json.dumps(previous)},
                                   labels={SLOT_KEY_LABEL: key_digest(wireguard_key)})
        return Slot.from_configmap(cm) if cm is not None else None

    def update_reservation(self, slot: Slot, ticket: Ticketed) -> bool:
        """Point an unredeemed reservation at a newer ticket of the same node (a retried launch, perhaps failed
        over to another location: its labels change with it), remembering the older ones (each is released with
        the slot); False if it changed since read."""
        previous = [n for n in slot.nonces if n != ticket.nonce]
        data = {**_ticket_data(ticket), "previousTickets": json.dumps(previous)}
        return self._patch_unchanged(slot, data) is not None

    def _patch_unchanged(self, slot: Slot, data: dict[str, str], *,
                         labels: dict[str, str] | None = None) -> client.V1ConfigMap | None:
        """Patch the slot's data (and ``labels``) only if it is as read (its resourceVersion); None if it changed
        or is gone."""
        try:
            return self.core.patch_namespaced_config_map(slot.name, self.namespace, {
                "metadata": {"resourceVersion": slot.resource_version, **({"labels": labels} if labels else {})},
                "data": data})
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
        self._hold(slot.index, False)
        return True

    def mark_registered(self, slot: Slot, uid: str) -> bool:
        """Record the UID of the Node that registered on the slot, only if the slot is as read (a slot released
        and re-issued during a slow pass never gets the old node's UID); False if it changed."""
        return self._mark(slot, "registeredUID", "registered_uid", uid)

    def mark_refused(self, slot: Slot, reason: str) -> bool:
        """Record the gateway's refusal of the slot's node in the slot (where the node cannot write)."""
        return self._mark(slot, "refused", "refused", reason)

    def record_transfer(self, slot: Slot, transfer: Transfer) -> bool:
        """Store the node's accounted traffic in its slot, only if the slot is as read; False if it changed (the
        next pass accounts from the record as it is then)."""
        cm = self._patch_unchanged(slot, {"transfer": transfer.dumps()})
        if cm is None:
            return False
        slot.transfer = transfer
        slot.resource_version = str(cm.metadata.resource_version or "")
        return True

    def _mark(self, slot: Slot, key: str, attribute: str, value: str) -> bool:
        cm = self._patch_unchanged(slot, {key: value})
        if cm is None:
            return False
        setattr(slot, attribute, value)
        slot.resource_version = str(cm.metadata.resource_version or "")
        return True


class _SlotChanged(Exception):
    """A reservation changed between read and update: read again."""


@dataclass
class SlotBook:
    """Which slot a ticket's node holds: reserved at issue, allocated at a join without one, claimed at
    redemption. Every change is a conditional write to the records: concurrent tickets and joins (several
    gateway replicas) never share a slot."""

    records: RecordStore
    plan: AddressPlan

    def reserve(self, ticket: Ticketed, node: str, operation: str) -> None:
        """Hold an address slot for the ticket's node. A retried launch (a new ticket for the same node and
        operation) keeps the one slot: an unredeemed reservation is pointed at the newer ticket (the node may
        still redeem the older one: the join finds the reservation by node and operation), a redeemed one is
        already the node's."""
        for _ in range(5):  # bounded: each round lost a race against a join or a release of that slot
            try:
                self._reserve_once(ticket, node, operation)
                return
            except _SlotChanged:
                continue
            except client.ApiException as exc:  # retryable: a 5xx answer, an exception the caller retries
                raise JoinRefused("kubernetes_api_error", f"reserving an address slot for {node}: "
                                  f"Kubernetes API error {exc.status}: {exc.reason}", status=502) from None
        raise JoinRefused("slot_conflict", f"the address slot of {node} kept changing while the "
                          "ticket was issued; retry", status=503)

    def _reserve_once(self, ticket: Ticketed, node: str, operation: str) -> None:
        mine = [s for s in self.records.slots_of(node) if s.operation == operation]
        if not mine:
            self.allocate(ticket, node, operation, "")
            return
        held = mine[0]  # a redeemed slot is already the node's: nothing to reserve
        if held.reserved and not self.records.update_reservation(held, ticket):
            raise _SlotChanged

    def allocate(self, ticket: Ticketed, node: str, operation: str, wg_key: str) -> Slot:
        """A free slot for the node, created atomically. Looked for among the slots this gateway does not know to
        be held, then, if none of those was free, among those a fresh read finds free: none is declared exhausted
        from a stale view."""
        # Each node starts looking at its own place (its name's hash), not at slot 0: tickets issued at once (200
        # pods at once) read the same free slots, and from slot 0 they all tried the same one, one 409 after
        # another (a fifth of the worker's time under that load, issue 26). Any free slot serves as well.
        count = self.plan.slots
        start = zlib.crc32(node.encode()) % count
        for fresh in (False, True):
            held = self.records.taken(fresh=fresh)
            for index in itertools.chain(range(start, count), range(start)):
                if index in held:
                    continue
                tunnel_ip, pod_cidr = self.plan.slot(index)
                slot = Slot(index=index, node=node, wireguard_key=wg_key, tunnel_ip=tunnel_ip,
                            pod_cidr=pod_cidr, nonce=ticket.nonce, operation=operation,
                            labels=dict(ticket.labels), taints=list(ticket.taints), gpus=ticket.gpus,
                            expires_at=ticket.expires_at)
                if self.records.create_slot(slot):  # 409: a concurrent ticket or join took it; the next one
                    return slot
        raise AddressesExhausted(self.plan.exhausted())

    def claim(self, slot: Slot, ticket: Ticketed, node: str, wg_key: str) -> Slot:
        claimed = self.records.claim(slot, ticket, wireguard_key=wg_key)
        if claimed is not None:
            return claimed
        # Changed since read: a concurrent retry of this same join (same key) claimed it, or it was released.
        again = next((s for s in self.records.slots_of(node) if s.nonce == ticket.nonce), None)
        if again is not None and again.wireguard_key == wg_key:
            return again
        raise JoinRefused("slot_conflict", f"the address slot reserved for {node} changed while it "
                          "joined; retry", status=503)
