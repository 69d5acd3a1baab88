"""After registration: the gateway applies to a registered Node what its ticket says (labels, taints, pod CIDR)
and lifts its joining taint once checked; cordons a Node that is not what its ticket admitted; releases the slots
of removed nodes and of tickets that expired unredeemed; keeps the tunnel's peers those of the slots; and drops
ticket records past their expiry. One pass at a time, in a loop in a daemon thread."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.utils import parse_quantity

from common.kube import raw_items
from common.kube import read_or_none
from common.watch import Json as NodeJson
from common.watch import WatchedList
from gateway.metrics import BURST_TRANSFER
from gateway.slots import RecordStore
from gateway.slots import Slot
from gateway.transfer import Transfer
from gateway.transfer import accumulate
from gateway.transfer import restarted
from gateway.tunnel_end import GatewayTunnel
from models.labels import BURN_IN_LABEL
from models.labels import BURNED_IN_ANNOTATION
from models.labels import GPU_RESOURCE
from models.labels import JOIN_REFUSED_ANNOTATION
from models.labels import JOIN_REFUSED_TAINT
from models.labels import JOINING_TAINT
from models.labels import LABEL_LOCATION
from tunnel.uapi import UapiError

log = logging.getLogger("kubeon.gateway")

# Labels under this prefix carry trust (operation, location, policy): only those the ticket names stay on a node.
TRUST_LABEL_PREFIX = "gpu.kubeon.io/"

# Ticket records outlive their ticket by this much (clock skew between gateway replicas).
TICKET_RECORD_GRACE_SECONDS = 300


class Reconciler:
    """Reconcile passes with the gateway's credentials. Started, it passes when a Node it must act on changes (seen
    by its watch of the Nodes: registered, or burned in, under its joining taint) and every ``interval`` seconds."""

    def __init__(self, core: client.CoreV1Api, records: RecordStore, tunnel: GatewayTunnel | None,
                 clock: Callable[[], float], *, tombstone_seconds: float = 24 * 3600,
                 transfer_seconds: float = 10.0) -> None:
        self._core = core
        self._transfer_seconds = transfer_seconds
        self._tombstone_seconds = tombstone_seconds
        self._records = records
        self._tunnel = tunnel
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        # A pass and a removal's release never interleave: a pass that listed a slot before the removal released
        # it would add its peer back (counters from 0) and release it again from an older reading.
        self._serial = threading.RLock()
        self._thread: threading.Thread | None = None
        self._watch = WatchedList(core.list_node, lambda node: node, on_change=self._node_changed,
                                  name="gateway-node-watch")

    def wake(self) -> None:
        """Pass now (a node was admitted: its transfer baseline is due)."""
        self._wake.set()

    def _node_changed(self, node: NodeJson) -> None:
        """Wake the loop for a Node under its joining taint that may be lifted now (it registered, or was annotated
        burned in); any other change waits for the timed pass."""
        taints = node.get("spec", {}).get("taints") or []
        if not any(t.get("key") == JOINING_TAINT.key for t in taints):
            return
        meta = node["metadata"]
        if BURN_IN_LABEL in (meta.get("labels") or {}) and BURNED_IN_ANNOTATION not in (meta.get("annotations") or {}):
            return
        self._wake.set()

    def reconcile(self) -> dict[str, list[str]]:
        """One pass over the Nodes listed now (see ``_pass``)."""
        return self._pass(None)

    def _pass(self, nodes: dict[str, NodeJson] | None) -> dict[str, list[str]]:
        with self._serial:
            return self._pass_serially(nodes)

    def _pass_serially(self, nodes: dict[str, NodeJson] | None) -> dict[str, list[str]]:
        """One pass over ``nodes`` (the watch's view; None: list them): label and taint registered nodes as their
        tickets say (only those), refuse a node whose capacity exceeds its ticket's offering, revoke a Node
        re-created under a removed or replaced node's name, release the slots of removed nodes and of tickets that
        expired unregistered, resync the WireGuard peers with the slots, drop ticket records past their expiry
        (tombstones past the certificate's lifetime)."""
        report: dict[str, list[str]] = {"labelled": [], "cordoned": [], "released": [], "revoked": []}
        # Slots first, then nodes: a slot marked registered names a node that existed before this list. The watch's
        # view is taken after the slots, as the list was; a node missing from a view that lags is read before its
        # slot is released (_node_gone), and every patch is conditional on the Node being as seen.
        slots = self._records.slots()
        tickets = self._records.tickets()
        if nodes is None:
            nodes = {n["metadata"]["name"]: n for n in raw_items(self._core.list_node(_preload_content=False))}
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
                    if self.release(slot):
                        report["released"].append(slot.node)
                else:
                    live.append(slot)
                continue
            uid = str(node["metadata"]["uid"])
            if slot.registered_uid and uid != slot.registered_uid:
                # The Node was deleted and registered again (with a still valid certificate): not the node the
                # ticket admitted. Its slot goes (its tickets tombstoned); the new object is evicted and deleted.
                self._revoke(node, "re-registered after its node was removed")
                self.release(slot)
                report["released"].append(slot.node)
                report["revoked"].append(slot.node)
                continue
            live.append(slot)
            if not slot.registered_uid and not self._records.mark_registered(slot, uid):
                continue  # the slot changed during this pass (released, re-issued): the next pass sees it
            gpus = parse_quantity((node.get("status", {}).get("capacity") or {}).get(GPU_RESOURCE, "0"))
            refused = slot.refused
            if slot.gpus and gpus > slot.gpus and not refused:
                refused = f"reports {gpus} GPUs, its ticket's offering has {slot.gpus}"
                if not self._records.mark_refused(slot, refused):
                    continue
                report["cordoned"].append(slot.node)
            if refused:
                node = self._refuse(node, refused, taint=False)  # the taint with the ticket's, below
                if node is None:
                    continue
            if self._apply_ticket(node, slot, refused=bool(refused)):
                report["labelled"].append(slot.node)
        slotted = {s.node for s in slots}
        for record in tickets:
            data = record.data
            name = data.get("node", "")
            keep_until = max(float(data.get("expiresAt", "0")), float(data.get("keepUntil", "0")))
            if (data.get("state") == "released" and keep_until >= now and name in nodes and name not in slotted
                    and name not in report["revoked"]):
                # A Node registered under a removed node's name (its certificate is still valid): never served.
                self._revoke(nodes[name], "registered again after the gateway removed it")
                report["revoked"].append(name)
        if self._tunnel is not None:
            # Only a slot that was a reservation, or absent, when this pass read them can have joined since: a slot
            # the pass left out of ``live`` (its node revoked, its release refused) keeps no peer.
            read = {s.node: s.reserved for s in slots}
            synced = self._tunnel.sync(live, joined_since=lambda: [
                s for s in self._records.slots() if read.get(s.node, True)])
            self.account(live, new=set(synced.get("new", ())))
        for record in tickets:
            data = record.data
            keep_until = max(float(data.get("expiresAt", "0")), float(data.get("keepUntil", "0")))
            if keep_until + TICKET_RECORD_GRACE_SECONDS < now:
                self._records.delete(record.name)
        return report

    def account(self, slots: list[Slot], *, new: set[str] | None = None, force: bool = False) -> list[str]:
        """Add to each joined slot's record what its peer's raw counters moved since the record's last reading
        (``gateway.transfer``); ``new``: peers just added, whose counters start at 0. Written when a peer is new or
        its counters went down (a reset: the record must know before they climb past the old value), else at
        most every ``transfer_seconds`` (``force``: now, at shutdown), so a restart loses at most what moved
        since the last write. The nodes whose record was written."""
        if self._tunnel is None:
            return []
        counters = self._tunnel.counters()
        now = self._clock()
        written = []
        for slot in slots:
            raw = counters.get(slot.wireguard_key) if not slot.reserved else None
            if raw is None:
                continue
            old = slot.transfer
            fresh = slot.wireguard_key in (new or ())
            moved = accumulate(restarted(old) if fresh else old, raw[0], raw[1], now)
            if (moved.last_rx, moved.last_tx) == (old.last_rx, old.last_tx) and not fresh:
                continue  # nothing moved since the record's reading
            reset = raw[0] < old.last_rx or raw[1] < old.last_tx
            due = now - old.measured_at >= self._transfer_seconds
            if (fresh or reset or force or due) and self._records.record_transfer(slot, moved):
                written.append(slot.node)
                self._count(slot, old, moved)
        return written

    @staticmethod
    def _count(slot: Slot, old: Transfer, new: Transfer) -> None:
        """The bytes accounted from ``old`` to ``new`` in ``kubeon_burst_transfer_bytes_total``."""
        location = slot.labels.get(LABEL_LOCATION, "") or "unknown"
        BURST_TRANSFER.labels(location=location, direction="egress").inc(max(0, new.rx_bytes - old.rx_bytes))
        BURST_TRANSFER.labels(location=location, direction="ingress").inc(max(0, new.tx_bytes - old.tx_bytes))

    def flush_transfer(self) -> list[str]:
        """Write every joined node's counters now (the gateway stops: its interface and counters go with it)."""
        if self._tunnel is None:
            return []
        return self.account([s for s in self._records.slots() if not s.reserved], force=True)

    def _node_gone(self, name: str) -> bool:
        return read_or_none(lambda: self._core.read_node(name)) is None

    def _apply_ticket(self, node: NodeJson, slot: Slot, *, refused: bool) -> bool:
        """The ticket's labels and taints (only those: a ``gpu.kubeon.io/`` label the node set itself and its
        ticket does not name is removed), the pod CIDR; the joining taint lifted when checked, the refusal taint
        kept on a refused node. Whether the Node was patched."""
        if not self._ticket_patch(node, slot, refused=refused):
            return False
        return self._patch_fresh(node, lambda seen: self._ticket_patch(seen, slot, refused=refused)) is not None

    @staticmethod
    def _ticket_patch(node: NodeJson, slot: Slot, *, refused: bool) -> dict[str, Any]:
        """What the Node lacks of its ticket (see ``_apply_ticket``); empty when nothing."""
        meta, spec_now = node["metadata"], node.get("spec", {})
        labels = meta.get("labels") or {}
        patch: dict[str, Any] = {}
        wrong: dict[str, str | None] = {k: v for k, v in slot.labels.items() if labels.get(k) != v}
        wrong.update({k: None for k in labels if k.startswith(TRUST_LABEL_PREFIX) and k not in slot.labels})
        if wrong:
            patch["metadata"] = {"labels": wrong}
        taints: list[dict[str, Any]] = spec_now.get("taints") or []
        have = {(t["key"], t["effect"]) for t in taints}
        wanted = [*slot.taints, *([JOIN_REFUSED_TAINT] if refused else [])]
        missing = [t for t in wanted if (t.key, t.effect) not in have]
        # A node under burn-in (issue 27) keeps its joining taint until the optimizer has annotated it burned in.
        burning_in = BURN_IN_LABEL in slot.labels and BURNED_IN_ANNOTATION not in (meta.get("annotations") or {})
        keep = [t for t in taints if refused or burning_in or t["key"] != JOINING_TAINT.key]
        spec: dict[str, Any] = {}
        if missing or len(keep) != len(taints):
            spec["taints"] = keep + [t.model_dump() for t in missing]
        if not spec_now.get("podCIDR"):
            spec["podCIDR"] = slot.pod_cidr
        if spec:
            patch["spec"] = spec
        return patch

    def _patch_as_seen(self, node: NodeJson, patch: dict[str, Any]) -> NodeJson | None:
        """Patch the Node only if it is still as seen (its resourceVersion): the taint list is written whole, so a
        taint added since (a drain's, a refusal's) must not be dropped. The Node as patched; None when it had
        changed (nothing written: the change's own watch event, or the next pass, sees it again)."""
        meta = node["metadata"]
        patch.setdefault("metadata", {})["resourceVersion"] = meta["resourceVersion"]
        try:
            patched = self._core.patch_node(meta["name"], patch, _preload_content=False)
        except client.ApiException as exc:
            if exc.status in (404, 409):
                return None
            raise
        result: NodeJson = json.loads(patched.data)  # type: ignore[attr-defined]  # raw (_preload_content)
        return result

    def _patch_fresh(self, node: NodeJson, patch_for: Callable[[NodeJson], dict[str, Any]]) -> NodeJson | None:
        """Patch the Node with what ``patch_for`` says it lacks, conditional on it being as seen; a Node that
        changed since (a kubelet's heartbeat, the node controller's taint) is read again and patched as it is now,
        at most three reads, so a refusal or a ticket's taint is not left to the next pass. The Node as patched
        (as seen when it lacked nothing); None when it is gone or kept changing (the next pass sees it again)."""
        name = node["metadata"]["name"]
        for _ in range(3):
            patch = patch_for(node)
            if not patch:
                return node
            patched = self._patch_as_seen(node, patch)
            if patched is not None:
                return patched
            fresh = read_or_none(lambda: self._core.read_node(name, _preload_content=False))
            if fresh is None:
                return None
            node = json.loads(fresh.data)  # type: ignore[attr-defined]  # the raw response (_preload_content)
        return None

    def _refuse(self, node: NodeJson, reason: str, *, taint: bool = True) -> NodeJson | None:
        """A refusal the node cannot lift: the refusal taint (NoExecute: nothing runs there), cordoned, the reason
        annotated (what verification reads); applied again every pass from the slot, where the refusal lives. The
        Node as refused; None if it is gone or kept changing."""

        def refusal(seen: NodeJson) -> dict[str, Any]:
            spec_now = seen.get("spec", {})
            taints: list[dict[str, Any]] = spec_now.get("taints") or []
            annotations = seen["metadata"].get("annotations") or {}
            tainted = any(t["key"] == JOIN_REFUSED_TAINT.key and t["effect"] == JOIN_REFUSED_TAINT.effect
                          for t in taints)
            if spec_now.get("unschedulable") and annotations.get(JOIN_REFUSED_ANNOTATION) and (tainted or not taint):
                return {}
            spec: dict[str, Any] = {"unschedulable": True}
            if taint and not tainted:
                spec["taints"] = [*(t for t in taints if t["key"] != JOIN_REFUSED_TAINT.key),
                                  JOIN_REFUSED_TAINT.model_dump()]
            return {"metadata": {"annotations": {JOIN_REFUSED_ANNOTATION: reason}}, "spec": spec}

        return self._patch_fresh(node, refusal)

    def _revoke(self, node: NodeJson, reason: str) -> None:
        """A Node no slot admits (re-created with a removed node's certificate): refused (NoExecute), then
        deleted; its certificate stays refused while a tombstone names it."""
        name = str(node["metadata"]["name"])
        log.warning("revoking node %s: %s", name, reason)
        try:
            self._refuse(node, reason)
            self._core.delete_node(name, body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=node["metadata"]["uid"])))
        except client.ApiException as exc:
            if exc.status not in (404, 409):  # gone, or re-created again meanwhile (the next pass sees it)
                raise

    def release(self, slot: Slot) -> bool:
        """Free a slot whose node is gone: its peer removed, every ticket it was issued for tombstoned (refused
        for good, its name watched for the certificate's lifetime), the record deleted if unchanged since read;
        False if it changed (read again)."""
        with self._serial:
            return self._release_serially(slot)

    def _release_serially(self, slot: Slot) -> bool:
        final = slot.transfer
        if self._tunnel is not None and slot.wireguard_key:
            with contextlib.suppress(UapiError):
                raw = self._tunnel.counters().get(slot.wireguard_key)
                if raw is not None:  # its last bytes, read before the peer (and its counters) goes
                    final = accumulate(final, raw[0], raw[1], self._clock())
            with contextlib.suppress(UapiError):
                self._tunnel.uapi.remove_peer(slot.wireguard_key)
        if final != slot.transfer:
            self._count(slot, slot.transfer, final)
        keep_until = max(slot.expires_at, self._clock() + self._tombstone_seconds)
        for nonce in slot.nonces:
            self._records.release_ticket(nonce, node=slot.node, operation=slot.operation, keep_until=keep_until,
                                         transfer=final if nonce == slot.nonce and not slot.reserved else None)
        return self._records.delete_unchanged(slot)

    def start(self, interval: float = 1.0, settle: float = 0.05) -> None:
        """Reconcile in a daemon thread until ``stop()``: when the node watch reports a Node to act on (after
        ``settle`` seconds, so nodes registering together share a pass), else every ``interval`` seconds. Passes
        read the watch's Nodes; while it has none (starting, or lost), they list them."""
        def loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(interval)
                if self._stop.wait(settle):
                    break
                self._wake.clear()
                try:
                    self._pass(self._watch.snapshot())
                except Exception as exc:  # the API may be briefly away; the next pass retries
                    log.warning("gateway reconcile failed: %s: %s", type(exc).__name__, exc)

        if self._thread is None:
            self._watch.start()
            self._thread = threading.Thread(target=loop, name="gateway-reconcile", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
