"""GPU type fit (Recommend only): from a workload's peak framebuffer and p95 activity over the policy's window,
the cheapest candidate GPU type (or MIG slice) that holds the peak plus headroom and keeps activity under the
ceiling, with the saving per month. No action is ever taken."""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass

from models.policy import HOURS_PER_MONTH
from models.policy import FitRule
from models.policy import GpuOffering
from planning.idle import PodMemory


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

    def status(self) -> dict[str, object]:
        """The camelCase form written into the policy's status."""
        d = asdict(self)
        return {"workload": d["workload"], "current": d["current"], "recommended": d["recommended"],
                "mig": d["mig"], "peakMiB": round(self.peak_mib), "needMiB": round(self.need_mib),
                "p95Activity": round(self.p95_activity, 3), "gpus": self.gpus,
                "savingUsdPerMonth": round(self.saving_usd_per_month, 2), "reason": self.reason}


def _refusal(c: GpuOffering, rule: FitRule, need: float, p95: float) -> str | None:
    if c.usd_per_hour >= rule.current.usd_per_hour:
        return f"{c.name} is not cheaper"
    if c.memory_mib < need:
        return f"{c.name} has {c.memory_mib} MiB"
    if p95 / c.relative_compute > rule.max_activity:
        return f"{c.name} would run at {p95 / c.relative_compute:.0%} (ceiling {rule.max_activity:.0%})"
    return None


def recommend(workload: str, pods: list[PodMemory], gpus: int, rule: FitRule) -> FitRecommendation:
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
    return FitRecommendation(
        workload, current.name, best.name, best.mig, peak, need, p95, gpus, saving,
        f"peak {peak / 1024:.1f} GiB + {rule.headroom:.0%} fits {kind} {best.name} ({best.memory_mib} MiB) at "
        f"p95 activity {p95:.0%}: ${current.usd_per_hour:g} -> ${best.usd_per_hour:g} per GPU-hour, "
        f"${saving:,.0f}/month for {gpus} GPU(s)")
