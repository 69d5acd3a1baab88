"""An Autoscaling policy's GPU limits (``limits["nvidia.com/gpu"]``) from its two budgets, pure and deterministic.

- ``maxGpus``: each NodePool at most that many GPUs.
- ``maxUsdPerHour``: all of the policy's NodePools together, valued at the worst case: a pool's GPUs are priced at
  the most expensive $/GPU-hour among the instance types it may launch (``HomeNodeGroup.launchable``) and the GPU
  nodes it runs of other types (their GPUs count in the limit too). The budget
  is shared in equal dollar parts; a pool whose maxGpus costs less than its part takes only that and leaves the
  rest to the others (water-filling). Each pool's dollar limit is the largest GPU count whose worst case stays
  within its part; the smaller of that and maxGpus wins.
- A pool whose launchable types are unknown (its requirements name no instance type: Karpenter may launch any
  that fits) or include a type without a price, or that runs a GPU node without one, cannot be valued: then the
  dollar budget cannot be held for the policy at all (the other pools' share of it is unknown), and only maxGpus
  (if any) is applied. ``reason`` names the pools and the unpriced types.
A limit counts the GPUs a pool runs now too: it stops new nodes and removes none, so a pool running above its limit
costs more than its part until its own nodes go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.capacity import HomeNodeGroup

# Prices are known to a few decimals: a quotient a hair under an integer (float error) is that integer.
_EPSILON = 1e-9


@dataclass(frozen=True)
class PoolLimit:
    pool: str
    # The GPU limit to hold; None: neither budget applies to this pool (leave its limit as it is).
    limit: int | None
    # The pool's worst-case $/GPU-hour (None: unknown).
    usd_per_gpu_hour: float | None = None
    # The GPUs the dollar budget leaves this pool (None: no dollar budget, or it cannot be held).
    budget_gpus: int | None = None
    # Why this pool cannot be valued (its part of a dollar budget unknown); "" when it can, or without one.
    unvalued: str = ""


@dataclass(frozen=True)
class BudgetPlan:
    pools: list[PoolLimit]
    max_usd_per_hour: float | None
    # Whether the dollar budget is held (False also without one).
    held: bool
    # Why it cannot be held ("" when it is, or without one).
    reason: str = ""
    # The worst case of the limits set, in USD per hour (held only).
    worst_usd_per_hour: float | None = None

    def pool(self, name: str) -> PoolLimit:
        return next(p for p in self.pools if p.pool == name)


def worst_usd_per_gpu_hour(group: HomeNodeGroup) -> tuple[float | None, str]:
    """The most expensive $/GPU-hour among the types the group may launch and the nodes it runs (a limit counts
    their GPUs too; a node of a type it no longer launches may cost more), or (None, why it is unknown). A group
    that can launch no type and runs no GPU node costs nothing more: 0."""
    if group.launchable is None:
        return None, (f"NodePool {group.name} names no instance types (node.kubernetes.io/instance-type In): "
                      "it may launch any type that fits, which cannot be priced")
    if group.unpriced:
        return None, f"NodePool {group.name} may launch instance types without a price: {', '.join(group.unpriced)}"
    known = {t.instance_type for t in group.launchable}
    running = [n for n in group.nodes if n.gpus > 0 and n.instance_type not in known]
    unpriced = sorted({n.instance_type or n.name for n in running if n.usd_per_hour is None})
    if unpriced:
        return None, f"NodePool {group.name} runs GPU nodes without a price: {', '.join(unpriced)}"
    per_gpu = [t.usd_per_gpu_hour for t in group.launchable if t.gpus > 0]
    per_gpu += [(n.usd_per_hour or 0.0) / n.gpus for n in running]
    return max(per_gpu, default=0.0), ""


def _gpus_within(usd: float, per_gpu: float) -> int:
    return max(0, math.floor(usd / per_gpu + _EPSILON))


def plan_limits(pools: list[str], groups: dict[str, HomeNodeGroup | str], *, max_gpus: int | None,
                max_usd_per_hour: float | None) -> BudgetPlan:
    """The limit of each of ``pools``; ``groups`` holds each pool's group as read, or why it could not be read."""
    if max_usd_per_hour is None:
        return BudgetPlan([PoolLimit(p, max_gpus) for p in pools], None, held=False)
    worst: dict[str, float] = {}
    why: dict[str, str] = {}
    for p in pools:
        g = groups.get(p)
        if not isinstance(g, HomeNodeGroup):
            why[p] = f"NodePool {p} cannot be read ({g or 'not listed'})"
            continue
        w, reason = worst_usd_per_gpu_hour(g)
        if w is None:
            why[p] = reason
        else:
            worst[p] = w
    if why:
        return BudgetPlan([PoolLimit(p, max_gpus, worst.get(p), unvalued=why.get(p, "")) for p in pools],
                          max_usd_per_hour, held=False,
                          reason=(f"the budget of ${max_usd_per_hour:g}/h cannot be held: " + "; ".join(why.values())
                                  + (f"; only maxGpus ({max_gpus}) is held" if max_gpus is not None
                                     else "; no limit is set for it")))
    # Water-filling in dollars: a pool that launches nothing (worst 0) needs no part.
    budget_gpus: dict[str, int] = {p: 0 for p in pools if worst[p] == 0.0}
    active = [p for p in pools if worst[p] > 0.0]
    left = max_usd_per_hour
    while active:
        share = left / len(active)
        capped = [p for p in active if max_gpus is not None and max_gpus * worst[p] <= share + _EPSILON]
        if not capped:
            for p in active:
                budget_gpus[p] = _gpus_within(share, worst[p])
            break
        for p in capped:
            budget_gpus[p] = max_gpus or 0
            left -= (max_gpus or 0) * worst[p]
            active.remove(p)
    out: list[PoolLimit] = []
    for p in pools:
        limit = budget_gpus[p] if max_gpus is None else min(max_gpus, budget_gpus[p])
        out.append(PoolLimit(p, limit, worst[p], budget_gpus[p]))
    total = sum((pl.limit or 0) * worst[pl.pool] for pl in out)
    return BudgetPlan(out, max_usd_per_hour, held=True, worst_usd_per_hour=round(total, 4))
