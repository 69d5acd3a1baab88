"""Sharing (time-slicing and MIG through the GPU Operator): which GPU nodes to share and how, from their GPU pods'
DCGM use. Pure: the metrics loop, the workflows and the bench decide alike.

Per node, from its GPU pods' p95 activity (``DCGM_FI_PROF_GR_ENGINE_ACTIVE``, else ``DCGM_FI_DEV_GPU_UTIL / 100``)
and peak framebuffer over the policy's window:

- **busy** (never proposed): the pods' summed p95 at or above the policy's threshold, or any pod without enough
  history (coverage below ``minCoverage``) or without data at all: sharing a GPU whose use is unknown is not done.
- **time-slicing**: ``r`` replicas per GPU, the fewest that serve the node's running pods and the GPU pods
  waiting for it (at least 2, the device plugin's minimum), and only if ``r`` times the busiest pod's p95 stays
  under the threshold (``r`` pods like it on one GPU) and ``r <= maxReplicas``. Pods asking for more than one GPU
  block it when ``failRequestsGreaterThanOne`` (their next start would fail).
- **MIG**: among the allowed geometries the product has, those whose slices hold every pod's peak framebuffer
  plus headroom (pods matched to slices largest first) and whose slice compute keeps each pod's p95 under the
  threshold; the one with the most slices wins.

The saving is the GPUs the pods (running, and waiting ones the change lets run) no longer need, at the policy's
``usdPerGpuHour``: demand in GPUs minus the physical GPUs it occupies after the change.

Slice memory is the profile's nominal size (``1g.10gb`` = 10 GiB) unless the node's GFD label
``nvidia.com/mig-<profile>.memory`` says what it reports; geometries per product follow the GPU Operator's
``default-mig-parted-config`` (A100-40GB, A100-80GB; H100-80GB as A100-80GB).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from dataclasses import field
from typing import Final
from typing import Literal

from planning.idle import PodMemory

A100_40GB: Final[dict[str, dict[str, int]]] = {
    "all-1g.5gb": {"1g.5gb": 7}, "all-2g.10gb": {"2g.10gb": 3}, "all-3g.20gb": {"3g.20gb": 2},
    "all-7g.40gb": {"7g.40gb": 1}, "all-balanced": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}
GPU_80GB: Final[dict[str, dict[str, int]]] = {
    "all-1g.10gb": {"1g.10gb": 7}, "all-2g.20gb": {"2g.20gb": 3}, "all-3g.40gb": {"3g.40gb": 2},
    "all-7g.80gb": {"7g.80gb": 1}, "all-balanced": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}
FULL_GPU_SLICES: Final = 7  # compute slices of a whole A100/H100


def mig_geometries(product: str) -> dict[str, dict[str, int]]:
    """Geometries (per GPU) the default MIG manager config gives a GFD product name; {} when not MIG-capable."""
    p = product.upper()
    if "A100" in p and "40GB" in p:
        return A100_40GB
    if ("A100" in p or "H100" in p) and "80GB" in p:
        return GPU_80GB
    return {}


def profile_memory_mib(profile: str) -> int:
    match = re.fullmatch(r"([1-7])g\.([0-9]+)gb", profile)
    if not match:
        raise ValueError(f"not a MIG profile: {profile!r}")
    return int(match.group(2)) * 1024


def profile_compute(profile: str) -> int:
    return int(profile.split("g.", 1)[0])


@dataclass(frozen=True)
class GpuPod:
    namespace: str
    name: str
    gpus: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class NodeFacts:
    """A GPU node as the Kubernetes API shows it."""

    name: str
    product: str  # GFD's nvidia.com/gpu.product without -SHARED
    gpus: int  # physical GPUs (nvidia.com/gpu.count)
    replicas: int = 1  # nvidia.com/gpu.replicas now
    mig_config: str = "all-disabled"
    pods: tuple[GpuPod, ...] = ()
    waiting: tuple[GpuPod, ...] = ()  # pending GPU pods this node could take
    slice_memory_mib: dict[str, int] = field(default_factory=dict)  # GFD nvidia.com/mig-<p>.memory


@dataclass(frozen=True)
class Rule:
    threshold: float
    min_coverage: float
    window: str
    max_replicas: int | None  # None: no time-slicing
    fail_requests_greater_than_one: bool = True
    mig_allowed: tuple[str, ...] = ()
    mig_headroom: float = 0.1
    usd_per_gpu_hour: float | None = None


@dataclass(frozen=True)
class Proposal:
    node: str
    kind: Literal["time-slicing", "mig"]
    replicas: int = 1
    geometry: str = ""
    pods: tuple[str, ...] = ()
    waiting_served: tuple[str, ...] = ()
    summed_p95: float = 0.0
    peak_mib: float = 0.0
    gpus_saved: int = 0
    saving_usd_per_hour: float = 0.0
    reason: str = ""
    risk: str = ""

    @property
    def plan_id(self) -> str:
        what = f"r{self.replicas}" if self.kind == "time-slicing" else self.geometry
        return f"{self.node}/{self.kind}/{what}"

    def summary(self) -> str:
        what = (f"time-slicing {self.replicas} replicas per GPU" if self.kind == "time-slicing"
                else f"MIG geometry {self.geometry}")
        saving = (f"saves ${self.saving_usd_per_hour:,.2f}/h ({self.gpus_saved} GPU(s))"
                  if self.saving_usd_per_hour else f"frees {self.gpus_saved} GPU(s)")
        return f"{self.node}: {what}; {saving}; risk: {self.risk}"

    def status(self) -> dict[str, object]:
        return {"node": self.node, "kind": self.kind, "replicas": self.replicas, "geometry": self.geometry,
                "pods": list(self.pods), "waitingServed": list(self.waiting_served),
                "summedP95": round(self.summed_p95, 3), "peakMiB": round(self.peak_mib),
                "gpusSaved": self.gpus_saved, "savingUsdPerHour": round(self.saving_usd_per_hour, 2),
                "reason": self.reason, "risk": self.risk, "planId": self.plan_id}


@dataclass(frozen=True)
class Verdict:
    node: str
    proposals: tuple[Proposal, ...]
    reason: str  # why nothing, or what was found


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _measure(node: NodeFacts, usage: dict[tuple[str, str], PodMemory], rule: Rule
             ) -> tuple[list[PodMemory], str]:
    got: list[PodMemory] = []
    for pod in node.pods:
        m = usage.get(pod.key)
        if m is None or m.p95_activity is None:
            return [], f"no DCGM data for pod {pod.namespace}/{pod.name} over {rule.window}"
        if m.coverage < rule.min_coverage:
            return [], (f"too little history for pod {pod.namespace}/{pod.name}: data over {_pct(m.coverage)} of "
                        f"{rule.window} (needs {_pct(rule.min_coverage)})")
        got.append(m)
    return got, ""


def _saving(node: NodeFacts, served: int, gpus_after: int, rule: Rule) -> tuple[int, float]:
    demand = sum(p.gpus for p in node.pods) + served
    saved = max(0, demand - gpus_after)
    return saved, saved * (rule.usd_per_gpu_hour or 0.0)


def time_slicing(node: NodeFacts, measured: list[PodMemory], rule: Rule) -> tuple[Proposal | None, str]:
    assert rule.max_replicas is not None
    if node.mig_config != "all-disabled":
        return None, f"MIG geometry {node.mig_config} in use"
    if rule.fail_requests_greater_than_one:
        big = [p for p in node.pods if p.gpus > 1]
        if big:
            return None, (f"pod {big[0].namespace}/{big[0].name} requests {big[0].gpus} GPUs: with "
                          "failRequestsGreaterThanOne its next start would fail")
    waiting = [p for p in node.waiting if p.gpus == 1 or not rule.fail_requests_greater_than_one]
    busiest = max((m.p95_activity or 0.0 for m in measured), default=0.0)
    # The most replicas the measured use allows: r pods like the busiest one on a GPU stay under the threshold.
    limit = rule.max_replicas if busiest <= 0 else min(rule.max_replicas,
                                                       math.ceil(rule.threshold / busiest - 1e-9) - 1)
    running = sum(p.gpus for p in node.pods)
    wanted = running + sum(p.gpus for p in waiting)
    need = max(2, math.ceil(wanted / node.gpus))
    if node.replicas >= need and node.replicas > 1:
        return None, f"already time-sliced at {node.replicas} replicas, enough for its {wanted} GPU pod(s)"
    if not waiting:
        return None, "no GPU pod waits for it: time-slicing would free nothing"
    replicas = min(need, limit)
    if replicas < 2:
        return None, (f"busiest pod p95 {_pct(busiest)}: even 2 replicas would reach {_pct(2 * busiest)} "
                      f"(threshold {_pct(rule.threshold)})")
    capacity = node.gpus * replicas
    served: list[GpuPod] = []
    room = capacity - running
    for p in waiting:
        if p.gpus <= room:
            served.append(p)
            room -= p.gpus
    if not served:
        return None, f"{replicas} replicas leave no room for the waiting pods"
    saved, usd = _saving(node, sum(p.gpus for p in served), node.gpus, rule)
    summed = sum(m.p95_activity or 0.0 for m in measured)
    return Proposal(
        node=node.name, kind="time-slicing", replicas=replicas,
        pods=tuple(f"{p.namespace}/{p.name}" for p in node.pods),
        waiting_served=tuple(f"{p.namespace}/{p.name}" for p in served), summed_p95=summed,
        peak_mib=max((m.peak_used_mib for m in measured), default=0.0), gpus_saved=saved, saving_usd_per_hour=usd,
        reason=(f"{len(node.pods)} pod(s) at summed p95 {_pct(summed)} (busiest {_pct(busiest)}) over "
                f"{rule.window}, under {_pct(rule.threshold)}: {replicas} replicas make {node.gpus} GPU(s) "
                f"{capacity} and run {len(served)} waiting pod(s) here instead of on new nodes"),
        risk=(f"noisy neighbours: up to {replicas} pods share each GPU with no memory or fault isolation "
              f"(busiest p95 x {replicas} = {_pct(busiest * replicas)}); the product label becomes "
              f"{node.product}-SHARED, so pods selecting {node.product} no longer schedule here")), ""


def _fits(peaks: list[float], slices: list[int]) -> bool:
    """Each peak gets its own slice, largest peaks on largest slices."""
    if len(peaks) > len(slices):
        return False
    return all(p <= s for p, s in zip(sorted(peaks, reverse=True), sorted(slices, reverse=True), strict=False))


def mig(node: NodeFacts, measured: list[PodMemory], rule: Rule) -> tuple[Proposal | None, str]:
    options = mig_geometries(node.product)
    if not options:
        return None, f"{node.product} has no MIG geometries"
    if node.replicas > 1:
        return None, f"time-sliced at {node.replicas} replicas"
    if any(p.gpus > 1 for p in node.pods):
        return None, "a pod requests more than one GPU: MIG slices are one device each"
    need = [m.peak_used_mib * (1 + rule.mig_headroom) for m in measured]
    p95s = [m.p95_activity or 0.0 for m in measured]
    refused: list[str] = []
    best: tuple[int, str, dict[str, int]] | None = None
    for geometry in rule.mig_allowed:
        if geometry == node.mig_config:
            refused.append(f"{geometry} is in use")
            continue
        per_gpu = options.get(geometry)
        if per_gpu is None:
            refused.append(f"{geometry} is not a geometry of {node.product}")
            continue
        mem = {p: node.slice_memory_mib.get(p) or profile_memory_mib(p) for p in per_gpu}
        slices = [mem[p] for p, n in per_gpu.items() for _ in range(n * node.gpus)]
        smallest = min(per_gpu, key=lambda p: mem[p])
        if not _fits(need, slices):
            refused.append(f"{geometry}: {len(measured)} pod(s) needing up to {max(need, default=0) / 1024:.1f} GiB "
                           f"(peak + {_pct(rule.mig_headroom)}) do not fit its slices ({smallest}: "
                           f"{mem[smallest]} MiB)")
            continue
        compute = min(profile_compute(p) for p in per_gpu)
        slowest = max(p95s, default=0.0) * FULL_GPU_SLICES / compute
        if slowest >= rule.threshold:
            refused.append(f"{geometry}: the busiest pod would run at {_pct(slowest)} of a {compute}g slice "
                           f"(threshold {_pct(rule.threshold)})")
            continue
        count = len(slices)
        if best is None or count > best[0]:
            best = (count, geometry, per_gpu)
    if best is None:
        return None, "no allowed MIG geometry fits: " + "; ".join(refused)
    count, geometry, per_gpu = best
    per_gpu_slices = sum(per_gpu.values())
    gpus_after = math.ceil(len(node.pods) / per_gpu_slices)
    saved, usd = _saving(node, 0, gpus_after, rule)
    peak = max((m.peak_used_mib for m in measured), default=0.0)
    return Proposal(
        node=node.name, kind="mig", geometry=geometry, pods=tuple(f"{p.namespace}/{p.name}" for p in node.pods),
        summed_p95=sum(p95s), peak_mib=peak, gpus_saved=saved, saving_usd_per_hour=usd,
        reason=(f"{len(node.pods)} pod(s) peaking at {peak / 1024:.1f} GiB fit {geometry} "
                f"({count} slices on {node.gpus} GPU(s)); their GPUs fit in {gpus_after}"),
        risk=(f"MIG reconfiguration evicts every GPU pod of {node.name} ({len(node.pods)} now) and may reboot it; "
              f"the node is cordoned meanwhile; pods use the slices only if they request "
              f"nvidia.com/mig-<profile> (e.g. nvidia.com/mig-{min(per_gpu, key=profile_memory_mib)})")), ""


def decide(node: NodeFacts, usage: dict[tuple[str, str], PodMemory], rule: Rule) -> Verdict:
    """The proposals for one node (time-slicing first when both apply), or why none."""
    if not node.pods:
        return Verdict(node.name, (), "no GPU pods to measure")
    measured, problem = _measure(node, usage, rule)
    if problem:
        return Verdict(node.name, (), f"not measured: {problem}")
    summed = sum(m.p95_activity or 0.0 for m in measured)
    if summed >= rule.threshold:
        return Verdict(node.name, (), f"busy: its pods' summed p95 is {_pct(summed)} over {rule.window} "
                                      f"(threshold {_pct(rule.threshold)})")
    out: list[Proposal] = []
    why: list[str] = []
    if rule.max_replicas is not None:
        ts, reason = time_slicing(node, measured, rule)
        if ts:
            out.append(ts)
        else:
            why.append(f"time-slicing: {reason}")
    if rule.mig_allowed:
        m, reason = mig(node, measured, rule)
        if m:
            out.append(m)
        else:
            why.append(f"MIG: {reason}")
    if out:
        return Verdict(node.name, tuple(out), "; ".join(p.summary() for p in out))
    return Verdict(node.name, (), "; ".join(why) or "nothing to share")
