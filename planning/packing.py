"""Which GPU nodes to empty: the nodes whose GPU pods all fit on the other nodes' free GPUs, saving the most $/h.

Pure (no I/O). A node can be emptied only if every pod on it may be moved:
- bare pods (no controller) are never moved (nothing re-creates them); DaemonSet pods are not moved (they go with
  the node) and do not hold it;
- a pod with ``karpenter.sh/do-not-disrupt: "true"``, or a duration not yet elapsed since it started, holds its
  node (an invalid value is ignored, as Karpenter does); so does the node's own annotation;
- a pod covered by more than one PodDisruptionBudget holds its node (the Eviction API refuses it; Karpenter skips
  such nodes too); a PDB allowing no disruption now does not: the eviction waits for it (shown in the plan);
- a moved pod keeps its GPU product and must fit its target: nodeSelector, required node affinity, the target's
  taints tolerated, enough free GPUs. Nodes emptied are never targets.
Exact for up to ``EXACT_CANDIDATES`` candidate nodes (every subset, every assignment by backtracking, as the
burst planner); greedy beyond (cheapest-to-empty first), and the plan says so.
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from datetime import timedelta

from models.packing import PackMove
from models.packing import PackNode
from models.packing import PackPlan
from models.packing import PackPod
from models.packing import PackScope
from planning.burst import pod_matches

EXACT_CANDIDATES = 12
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str) -> timedelta | None:
    """A Go duration of hours, minutes and seconds ("2h", "90m", "1h30m"); None if it is not one."""
    m = _DURATION.match(text.strip())
    if not m or not any(m.groups()):
        return None
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return timedelta(hours=h, minutes=mi, seconds=s)


def holds_node(pod: PackPod, now: datetime, scope: PackScope | None = None) -> str | None:
    """Why this pod keeps its node from being emptied, or None."""
    key = pod.pod.key
    if pod.owner_kind == "DaemonSet":
        return None
    if not pod.owner_kind:
        return f"bare pod {key} (no controller re-creates it)"
    if scope is not None:
        if (scope.namespaces and pod.pod.namespace not in scope.namespaces) or any(
                pod.labels.get(k) != v for k, v in scope.pod_labels.items()):
            return f"pod {key} is not among the policy's pods"
        protected = next((a for a in scope.protect_annotations if a in pod.annotation_keys), None)
        if protected:
            return f"pod {key} carries the protected annotation {protected}"
        if scope.min_pod_age_seconds and (pod.started_at is None or
                                          (now - pod.started_at).total_seconds() < scope.min_pod_age_seconds):
            return f"pod {key} is younger than {scope.min_pod_age_seconds / 60:g} min"
    if len(pod.pdbs) > 1:
        return f"pod {key} is covered by {len(pod.pdbs)} PodDisruptionBudgets ({', '.join(sorted(pod.pdbs))})"
    value = pod.do_not_disrupt
    if value is not None:
        if value.strip().lower() == "true":
            return f"pod {key} has karpenter.sh/do-not-disrupt: true"
        duration = parse_duration(value)
        if duration is not None and (pod.started_at is None or now - pod.started_at < duration):
            return f"pod {key} has karpenter.sh/do-not-disrupt: {value} (not elapsed)"
    return None


def _fits(pod: PackPod, node: PackNode) -> bool:
    if node.gpu_product and pod.pod.node_selector.get("nvidia.com/gpu.product", node.gpu_product) != node.gpu_product:
        return False
    if "*" not in pod.pod.tolerations and any(t not in pod.pod.tolerations for t in node.taints):
        return False
    return pod_matches(pod.pod, {**node.labels, **({"nvidia.com/gpu.product": node.gpu_product}
                                                   if node.gpu_product else {})})


# Placements one assignment may try before it gives up (its node is then not emptied: a plan not found is safe).
ASSIGN_STEPS = 20_000


def _assign(pods: list[PackPod], targets: list[PackNode], free: dict[str, int], source_product: dict[str, str]
            ) -> dict[str, str] | None:
    """Every pod onto a target with room (backtracking, biggest pods first); None if impossible, or if not found
    within ``ASSIGN_STEPS`` placements.

    Without pruning, an impossible assignment of many alike pods (the 1-GPU pods of one Deployment) tries every
    permutation: a 50-node pool's greedy pass took minutes of CPU. So: the GPUs asked must fit the free GPUs of the
    targets the pods may use at all; and at each pod, targets alike for the pods still to place (the same free GPUs,
    and a target of the same pods) are tried once, since placing the pod on one or the other leaves the same
    problem."""
    order = sorted(pods, key=lambda p: -p.pod.gpus)
    options = [[t for t in targets if t.gpu_product == source_product[p.node] and _fits(p, t)] for p in order]
    if any(not o for o in options):
        return None
    usable = {t.name for o in options for t in o}
    if sum(p.pod.gpus for p in order) > sum(max(free[name], 0) for name in usable):
        return None
    # Which pods (by their place in ``order``) may go on each target: targets of equal sets are alike.
    takes: dict[str, list[int]] = {}
    for i, o in enumerate(options):
        for t in o:
            takes.setdefault(t.name, []).append(i)
    kind = {name: tuple(pods_of) for name, pods_of in takes.items()}
    placed: dict[str, str] = {}
    steps = 0

    def place(i: int) -> bool:
        nonlocal steps
        if i == len(order):
            return True
        pod = order[i]
        tried: set[tuple[int, tuple[int, ...]]] = set()
        for t in options[i]:
            room = free[t.name]
            if room < pod.pod.gpus or (room, kind[t.name]) in tried:
                continue
            tried.add((room, kind[t.name]))
            steps += 1
            if steps > ASSIGN_STEPS:
                return False
            free[t.name] -= pod.pod.gpus
            placed[pod.pod.key] = t.name
            if place(i + 1):
                return True
            free[t.name] += pod.pod.gpus
            del placed[pod.pod.key]
        return False

    return dict(placed) if place(0) else None


def plan_packing(nodes: list[PackNode], pods: list[PackPod], *, now: datetime, pdb_allowed: dict[str, int],
                 max_nodes: int = 1, min_savings_usd_per_hour: float = 0.0,
                 scope: PackScope | None = None) -> PackPlan:
    gpu_pods: dict[str, list[PackPod]] = {n.name: [] for n in nodes}
    used: dict[str, int] = {n.name: 0 for n in nodes}
    kept: dict[str, str] = {}
    for pod in pods:
        if pod.node not in gpu_pods:
            continue
        used[pod.node] += pod.pod.gpus
        if pod.owner_kind != "DaemonSet" and pod.pod.gpus > 0:
            gpu_pods[pod.node].append(pod)
        why = holds_node(pod, now, scope)
        if why and pod.node not in kept:
            kept[pod.node] = why
    for n in nodes:
        if n.name in kept:
            continue
        if not n.ready:
            kept[n.name] = "not Ready"
        elif n.cordoned:
            kept[n.name] = "cordoned (by someone else)"
        elif n.do_not_disrupt:
            kept[n.name] = "node has karpenter.sh/do-not-disrupt: true"
    candidates = [n for n in nodes if n.name not in kept]
    product = {n.name: n.gpu_product for n in nodes}
    exact = len(candidates) <= EXACT_CANDIDATES

    def feasible(chosen: tuple[PackNode, ...]) -> dict[str, str] | None:
        names = {c.name for c in chosen}
        targets = [n for n in nodes if n.name not in names and n.ready and not n.cordoned]
        free = {t.name: t.gpus - used[t.name] for t in targets}
        moving = [p for c in chosen for p in gpu_pods[c.name]]
        return _assign(moving, targets, free, product)

    best: tuple[float, int, tuple[PackNode, ...], dict[str, str]] | None = None
    if exact:
        for size in range(1, min(max_nodes, len(candidates)) + 1):
            for chosen in itertools.combinations(candidates, size):
                saving = round(sum(c.usd_per_hour for c in chosen), 4)
                moved = sum(len(gpu_pods[c.name]) for c in chosen)
                if best is not None and (saving, -moved) <= (best[0], best[1]):
                    continue
                found = feasible(chosen)
                if found is not None:
                    best = (saving, -moved, chosen, found)
    else:
        chosen_list: list[PackNode] = []
        greedy: dict[str, str] = {}
        for c in sorted(candidates, key=lambda n: (len(gpu_pods[n.name]), -n.usd_per_hour, n.name)):
            if len(chosen_list) >= max_nodes:
                break
            trial = feasible((*chosen_list, c))
            if trial is not None:
                chosen_list.append(c)
                greedy = trial
        if chosen_list:
            best = (round(sum(c.usd_per_hour for c in chosen_list), 4),
                    -sum(len(gpu_pods[c.name]) for c in chosen_list), tuple(chosen_list), greedy)
    if best is None:
        return PackPlan(kept=kept, exact=exact, message="no GPU node's pods fit on the others' free GPUs")
    saving, _, chosen, placement = best
    if saving < min_savings_usd_per_hour:
        return PackPlan(kept=kept, exact=exact, message=(
            f"the best round saves ${saving:.2f}/h, under minSavingsUsdPerHour ${min_savings_usd_per_hour:.2f}/h"))
    moves = []
    for c in sorted(chosen, key=lambda n: n.name):
        for p in sorted(gpu_pods[c.name], key=lambda p: p.pod.key):
            wait = next((b for b in p.pdbs if pdb_allowed.get(b, 1) < 1), "")
            moves.append(PackMove(pod=p.pod.key, source=c.name, target=placement[p.pod.key], gpus=p.pod.gpus,
                                  waits_for_pdb=wait))
    return PackPlan(empty=sorted(c.name for c in chosen), group_of={c.name: c.group for c in chosen}, moves=moves,
                    usd_per_hour_saved=saving, kept=kept,
                    exact=exact)
