"""GPU type fit (Recommend only): from a workload's peak framebuffer and p95 activity over the policy's window,
the cheapest candidate GPU type (or MIG slice) that holds the peak plus headroom and keeps activity under the
ceiling, with the saving per month. When the candidate names its ``product`` and the workload's GPU pods run on
nodes of Karpenter NodePools, the recommendation also carries the requirement each NodePool would hold to serve it
(``nvidia.com/gpu.product In [product]``), to be applied through an Autoscaling policy's ``gpuProducts``: an
approved operation, as a requirement change drifts the pool's nodes of other products. No action is ever taken."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass

from models.capacity import NODEPOOL_LABEL
from models.labels import LABEL_GPU_PRODUCT
from models.policy import HOURS_PER_MONTH
from models.policy import FitRule
from models.policy import GpuOffering
from planning.idle import PodMemory


@dataclass(frozen=True)
class NodePoolRequirement:
    """The requirement ``node_pool`` would hold for its nodes to be of ``product`` (GPU type fit never sets it)."""

    node_pool: str
    product: str

    def status(self) -> dict[str, object]:
        return {"nodePool": self.node_pool, "key": LABEL_GPU_PRODUCT, "operator": "In", "values": [self.product]}


@dataclass(frozen=True)
class FitRecommendation:
    workload: str
    current: str
    recommended: str  # empty: keep the current type
    mig: bool
    peak_mib: float
    need_mib: float
    p95_activity: float
    gpus: int
    saving_usd_per_month: float
    reason: str
    # The recommended candidate's nvidia.com/gpu.product ("" when it names none) and, per NodePool its GPU pods'
    # nodes are in, the requirement that would serve it.
    product: str = ""
    node_pool_requirements: tuple[NodePoolRequirement, ...] = ()

    def status(self) -> dict[str, object]:
        """The camelCase form written into the policy's status."""
        d = asdict(self)
        return {"workload": d["workload"], "current": d["current"], "recommended": d["recommended"],
                "mig": d["mig"], "peakMiB": round(self.peak_mib), "needMiB": round(self.need_mib),
                "p95Activity": round(self.p95_activity, 3), "gpus": self.gpus,
                "savingUsdPerMonth": round(self.saving_usd_per_month, 2), "reason": self.reason,
                "product": self.product,
                "nodePoolRequirements": [r.status() for r in self.node_pool_requirements]}


def _refusal(c: GpuOffering, rule: FitRule, need: float, p95: float) -> str | None:
    if c.usd_per_hour >= rule.current.usd_per_hour:
        return f"{c.name} is not cheaper"
    if c.memory_mib < need:
        return f"{c.name} has {c.memory_mib} MiB"
    if p95 / c.relative_compute > rule.max_activity:
        return f"{c.name} would run at {p95 / c.relative_compute:.0%} (ceiling {rule.max_activity:.0%})"
    return None


def _requirements(best: GpuOffering, node_pools: Sequence[str]) -> tuple[tuple[NodePoolRequirement, ...], str]:
    """The requirement per NodePool of ``node_pools`` (one entry per scheduled GPU pod: its node's NodePool, ""
    for none) that would serve ``best``, and what the reason says of it."""
    if best.mig:
        return (), "no NodePool requirement: a MIG slice is made by sharing a GPU (kind Sharing), not by a NodePool"
    if best.product is None:
        return (), (f"no NodePool requirement: candidate {best.name} names no product (its {LABEL_GPU_PRODUCT} "
                    f"value, fit.candidates[].product)")
    pools = sorted({p for p in node_pools if p})
    if not pools:
        return (), (f"no NodePool requirement: its GPU pods' nodes are in no Karpenter NodePool (no "
                    f"{NODEPOOL_LABEL} label)")
    outside = sum(1 for p in node_pools if not p)
    named, them = (f"NodePool {pools[0]}", "that NodePool") if len(pools) == 1 else (
        f"NodePools {', '.join(pools)}", "those NodePools")
    return tuple(NodePoolRequirement(pool, best.product) for pool in pools), (
        f"as a NodePool requirement: {LABEL_GPU_PRODUCT} In [{best.product}] on {named}"
        + (f" ({outside} of its GPU pods' nodes are in no NodePool)" if outside else "")
        + f"; to apply it, set gpuProducts: [{best.product}] in an Autoscaling policy for {them}, an approved "
        f"operation: a requirement change drifts (replaces) the pool's nodes of other products. GPU type fit "
        f"changes no NodePool")


def recommend(workload: str, pods: list[PodMemory], gpus: int, rule: FitRule,
              node_pools: Sequence[str] = ()) -> FitRecommendation:
    """``node_pools``: the Karpenter NodePool of each of the workload's scheduled GPU pods' nodes ("" for a node
    in none)."""
    current = rule.current
    if not pods:
        return FitRecommendation(workload, current.name, "", False, 0, 0, 0, gpus, 0,
                                 "no DCGM framebuffer data for its pods")
    peak = max(p.peak_used_mib for p in pods)
    p95 = max(p.p95_activity or 0.0 for p in pods)
    coverage = min(p.coverage for p in pods)
    need = peak * (1 + rule.headroom)
    if coverage < rule.min_coverage:
        return FitRecommendation(workload, current.name, "", False, peak, need, p95, gpus, 0,
                                 f"not enough history: data over {coverage:.0%} of {rule.window} "
                                 f"(needs {rule.min_coverage:.0%})")
    refusals = []
    fitting = []
    for c in rule.candidates:
        why = _refusal(c, rule, need, p95)
        if why:
            refusals.append(why)
        else:
            fitting.append(c)
    if not fitting:
        return FitRecommendation(workload, current.name, "", False, peak, need, p95, gpus, 0,
                                 f"no cheaper GPU type fits {need / 1024:.1f} GiB (peak {peak / 1024:.1f} GiB + "
                                 f"{rule.headroom:.0%}): " + "; ".join(refusals))
    best = min(fitting, key=lambda c: (c.usd_per_hour, c.name))
    saving = (current.usd_per_hour - best.usd_per_hour) * HOURS_PER_MONTH * gpus
    kind = "MIG slice" if best.mig else "GPU type"
    requirements, applying = _requirements(best, node_pools)
    return FitRecommendation(
        workload, current.name, best.name, best.mig, peak, need, p95, gpus, saving,
        f"peak {peak / 1024:.1f} GiB + {rule.headroom:.0%} fits {kind} {best.name} ({best.memory_mib} MiB) at "
        f"p95 activity {p95:.0%}: ${current.usd_per_hour:g} -> ${best.usd_per_hour:g} per GPU-hour, "
        f"${saving:,.0f}/month for {gpus} GPU(s); {applying}", best.product or "", requirements)
