"""What the benchmark observes with its own clock: pod and node watches, the audit log, process memory and CPU.

Every timestamp here is a timezone-aware UTC ``datetime`` taken when the benchmark process saw the event
(``*_seen``) or copied from the object (``*_cond``: a Kubernetes condition's ``lastTransitionTime``, which has
one-second resolution)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes import watch


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class PodSeen:
    namespace: str
    name: str
    app: str
    created_seen: datetime | None = None
    unschedulable_seen: datetime | None = None
    unschedulable_cond: datetime | None = None
    scheduled_seen: datetime | None = None
    node_name: str = ""
    deleted: bool = False


@dataclass
class NodeSeen:
    name: str
    operation: str
    created: datetime | None
    first_seen: datetime
    location: str = ""  # as the label holds it: "sim.eu-west" (a label value cannot hold "/")
    instance_type: str = ""
    ready_seen: datetime | None = None
    ready_cond: datetime | None = None
    deleted_seen: datetime | None = None


def _unschedulable_condition(pod: Any) -> datetime | None:
    """lastTransitionTime of PodScheduled=False/Unschedulable (a fallback of "now" if the server left it out)."""
    if pod.spec.node_name:
        return None
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return cond.last_transition_time or utc_now()
    return None


def _ready_condition(node: Any) -> datetime | None:
    for cond in (node.status.conditions if node.status else None) or []:
        if cond.type == "Ready" and cond.status == "True":
            return cond.last_transition_time or utc_now()
    return None


class ClusterObserver:
    """Watches (not polls) the benchmark's pods and every burst node from two daemon threads. Watched objects are
    typed ``Any``: the apiserver always sets the metadata and spec the client types as optional."""

    def __init__(self, api: client.ApiClient, *, pod_selector: str, node_selector: str) -> None:
        self._core = client.CoreV1Api(api)
        self._pod_selector = pod_selector
        self._node_selector = node_selector
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.pods: dict[str, PodSeen] = {}
        self.nodes: dict[str, NodeSeen] = {}
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(self._core.list_pod_for_all_namespaces, pod_selector,
                                                      self._on_pod), daemon=True, name="bench-pod-watch"),
            threading.Thread(target=self._loop, args=(self._core.list_node, node_selector, self._on_node),
                             daemon=True, name="bench-node-watch"),
        ]

    def start(self) -> ClusterObserver:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    # -- the watch loop (re-lists after 410 Gone or a broken connection) ----------------------------------------
    def _loop(self, list_fn: Callable[..., Any], selector: str, on_event: Callable[[str, Any], None]) -> None:
        while not self._stop.is_set():
            try:
                listed = list_fn(label_selector=selector)
                for item in listed.items:
                    on_event("ADDED", item)
                rv = listed.metadata.resource_version
                while not self._stop.is_set():
                    w = watch.Watch()
                    gone = False
                    # Short windows: stop() returns within seconds.
                    for event in w.stream(list_fn, label_selector=selector, resource_version=rv, timeout_seconds=5,
                                          allow_watch_bookmarks=True):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            gone = True
                            w.stop()
                            break
                        if event["type"] == "BOOKMARK":  # the client leaves a bookmark's object a dict
                            rv = event["raw_object"]["metadata"]["resourceVersion"]
                            continue
                        rv = obj.metadata.resource_version
                        on_event(event["type"], obj)
                        if self._stop.is_set():
                            w.stop()
                    if gone:
                        break
            except Exception as exc:  # connection reset, 410 raised as ApiException, apiserver going away
                if not self._stop.is_set():
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    self._stop.wait(0.5)

    def _on_pod(self, kind: str, pod: Any) -> None:
        seen = utc_now()
        uid = str(pod.metadata.uid)
        with self._lock:
            # The record made at the pod's first event stays; later events only stamp it.
            rec = self.pods.setdefault(uid, PodSeen(
                namespace=str(pod.metadata.namespace), name=str(pod.metadata.name),
                app=str((pod.metadata.labels or {}).get("app", "")), created_seen=seen))
            if kind == "DELETED" or pod.metadata.deletion_timestamp is not None:
                rec.deleted = True
                return
            if rec.unschedulable_seen is None:
                cond = _unschedulable_condition(pod)
                if cond is not None:
                    rec.unschedulable_seen, rec.unschedulable_cond = seen, cond
            if rec.scheduled_seen is None and pod.spec.node_name:
                rec.scheduled_seen, rec.node_name = seen, str(pod.spec.node_name)

    def _on_node(self, kind: str, node: Any) -> None:
        seen = utc_now()
        name = str(node.metadata.name)
        labels = node.metadata.labels or {}
        with self._lock:
            rec = self.nodes.setdefault(name, NodeSeen(
                name=name, operation=str(labels.get("gpu.kubeon.io/operation", "")),
                created=node.metadata.creation_timestamp, first_seen=seen,
                location=str(labels.get("gpu.kubeon.io/location", "")),
                instance_type=str(labels.get("node.kubernetes.io/instance-type", ""))))
            if kind == "DELETED":
                rec.deleted_seen = rec.deleted_seen or seen
                return
            if rec.ready_seen is None:
                cond = _ready_condition(node)
                if cond is not None:
                    rec.ready_seen, rec.ready_cond = seen, cond

    # -- snapshots ---------------------------------------------------------------------------------------------
    def pods_snapshot(self) -> list[PodSeen]:
        with self._lock:
            return [PodSeen(**vars(p)) for p in self.pods.values()]

    def nodes_snapshot(self) -> dict[str, NodeSeen]:
        with self._lock:
            return {k: NodeSeen(**vars(v)) for k, v in self.nodes.items()}


# -- the audit log ---------------------------------------------------------------------------------------------
@dataclass
class AuditView:
    """``(operation, action) -> at`` from the worker's audit.jsonl (timestamps with microseconds)."""

    at: dict[tuple[str, str], datetime] = field(default_factory=dict)
    policy: dict[str, str] = field(default_factory=dict)  # operation -> policy

    def count(self, action: str, operations: Iterable[str] | None = None) -> int:
        wanted = set(operations) if operations is not None else None
        return sum(1 for (op, act) in self.at if act == action and (wanted is None or op in wanted))

    def get(self, operation: str, action: str) -> datetime | None:
        return self.at.get((operation, action))


def read_audit(path: Path) -> AuditView:
    view = AuditView()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return view
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            view.at[(str(rec["operation"]), str(rec["action"]))] = datetime.fromisoformat(rec["at"])
            view.policy[str(rec["operation"])] = str(rec["policy"])
        except (ValueError, KeyError):
            continue  # a line being written right now
    return view


# -- processes -------------------------------------------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (not its children)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """(busy, wall x CPUs) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total, idle = sum(fields[:8]), fields[3] + fields[4]  # user nice system idle iowait irq softirq steal
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


def children(pid: int | None = None) -> dict[int, str]:
    """Live (non-zombie) child processes of ``pid`` (default: this process): pid -> command name."""
    parent = os.getpid() if pid is None else pid
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == parent and fields[0] != "Z":
                out[int(entry.name)] = comm
    return out


class ProcessSampler:
    """Samples a process's resident memory (VmRSS) twice a second; VmHWM is the kernel's own peak."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss_kib = 0
        self.last_rss_kib = 0
        self.last_hwm_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-rss-sampler")

    def start(self) -> ProcessSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        rss = _status_kib(self.pid, "VmRSS")
        hwm = _status_kib(self.pid, "VmHWM")
        if rss is not None:
            self.last_rss_kib = rss
            self.peak_rss_kib = max(self.peak_rss_kib, rss)
        if hwm is not None:
            self.last_hwm_kib = hwm

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)

    @staticmethod
    def mib(kib: int) -> float:
        return kib / 1024


# -- statistics ------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0
