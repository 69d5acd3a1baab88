"""After registration: the gateway applies to a registered Node what its ticket says (labels, taints, pod CIDR)
and lifts its joining taint once checked; cordons a Node that is not what its ticket admitted; releases the slots
of removed nodes and of tickets that expired unredeemed; keeps the tunnel's peers those of the slots; and drops
ticket records past their expiry. One pass at a time, in a loop in a daemon thread."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.utils import parse_quantity

from gateway.slots import RecordStore, Slot
from gateway.tunnel_end import GatewayTunnel
from models.labels import GPU_RESOURCE, JOIN_REFUSED_ANNOTATION, JOINING_TAINT
from tunnel.uapi import UapiError

log = logging.getLogger("kubeon.gateway")

# Ticket records outlive their ticket by this much (clock skew between gateway replicas).
TICKET_RECORD_GRACE_SECONDS = 300


class Reconciler:
    """Reconcile passes with the gateway's credentials; ``joining``: a slot whose node has not registered yet, or
    is still under its joining taint (the loop runs faster then)."""

    def __init__(self, core: client.CoreV1Api, records: RecordStore, tunnel: GatewayTunnel | None,
                 clock: Callable[[], float]) -> None:
        self._core = core
        self._records = records
        self._tunnel = tunnel
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.joining = False

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
                    self.release(slot)
                    report["released"].append(slot.node)
                else:
                    live.append(slot)
                continue
            if slot.registered_uid and node.metadata.uid != slot.registered_uid:
                # The Node was deleted and registered again (with a still valid certificate): not the node the
                # ticket admitted. Its slot goes; the new object is cordoned and never served.
                self._cordon(node, "re-registered after its node was removed")
                self.release(slot)
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
        self.joining = any(not s.registered_uid or s.node in report["labelled"] for s in live)
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

    def release(self, slot: Slot) -> None:
        if self._tunnel is not None and slot.wireguard_key:
            with contextlib.suppress(UapiError):
                self._tunnel.uapi.remove_peer(slot.wireguard_key)
        self._records.release_ticket(slot.nonce)
        self._records.delete(slot.name)

    def start(self, interval: float = 1.0, joining_interval: float = 0.25) -> None:
        """Reconcile every ``interval`` seconds in a daemon thread, until ``stop()``; every ``joining_interval``
        while a node that joined has not registered yet (its joining taint is lifted that much sooner)."""
        def loop() -> None:
            wait = interval
            while not self._stop.wait(wait):
                try:
                    self.reconcile()
                except Exception as exc:  # the API may be briefly away; the next pass retries
                    log.warning("gateway reconcile failed: %s: %s", type(exc).__name__, exc)
                wait = joining_interval if self.joining else interval

        if self._thread is None:
            self._thread = threading.Thread(target=loop, name="gateway-reconcile", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
