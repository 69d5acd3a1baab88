"""Burst defers to home capacity (``capacity.provider: karpenter``): for each waiting pod, whether the home
autoscaler is serving it (then it is not burst) or cannot (then it is, and the plan says why).

A pod is served at home when a home GPU group it fits (the group's taints tolerated, its requirements not
contradicting the pod's nodeSelector, e.g. the GPU product) has a NodeClaim launching (not failed, not
unregistered past ``register_seconds``), or has GPU room under its limit and the pod has waited less than
``grace_seconds`` (Karpenter batches pending pods for
a few seconds before it creates one). It is burst when no home group fits, when every group it fits is at its GPU
limit, when the group's NodeClaims failed to launch or stayed unregistered past ``register_seconds``, or when
Karpenter launched nothing for it within the grace (no instance type of the group fits it).

Managed node groups (eks-nodegroups, gke-nodepools, aks-nodepools) are planned as a batch (``plan_home``): the
nodes a group is launching (desired above its registered nodes) take pods first; then, where nothing else owns the
group's size, the plan grows the group by the fewest nodes its waiting pods need (first fit, largest pod first, the
cheapest group per GPU first), never past its maxSize, and those pods are not burst. A group cluster-autoscaler or
its own autoscaling owns is never resized by us: within the grace the pod waits for it, as for Karpenter. Nodes a
group was grown by that are not registered ``register_seconds`` after (the cloud is out of the type) hold no pod
back: it is burst, and the plan says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from datetime import datetime
from datetime import timedelta

from models.capacity import HomeNodeGroup
from models.provisioning import HomeScale
from models.provisioning import PendingPod


@dataclass(frozen=True)
class HomeVerdict:
    at_home: bool
    why: str


def fits_group(pod: PendingPod, group: HomeNodeGroup) -> bool:
    if "*" not in pod.tolerations and any(t not in pod.tolerations for t in group.taints):
        return False
    for req in group.requirements:
        if req.key not in pod.node_selector:
            continue
        value = pod.node_selector[req.key]
        if (req.operator == "In" and value not in req.values) or (req.operator == "NotIn" and value in req.values):
            return False
        if req.operator == "DoesNotExist":
            return False
    return True


def home_verdict(pod: PendingPod, groups: list[HomeNodeGroup], now: datetime, *, grace_seconds: float,
                 register_seconds: float) -> HomeVerdict:
    fitting = [g for g in groups if fits_group(pod, g)]
    if not fitting:
        return HomeVerdict(False, "no home NodePool fits it")
    # A NodeClaim launching counts in the pool's usage already: it is looked at before the limit.
    problems: list[str] = []
    for g in fitting:
        for claim in g.launching:
            if claim.failed:
                problems.append(f"home NodeClaim {claim.name} failed to launch: {claim.failed}")
            elif (not claim.registered and claim.created_at is not None
                  and now - claim.created_at > timedelta(seconds=register_seconds)):
                problems.append(f"home NodeClaim {claim.name} unregistered after {register_seconds:.0f}s")
            else:
                return HomeVerdict(True, f"home NodePool {g.name} is launching NodeClaim {claim.name}")
    with_room = [g for g in fitting if g.gpu_limit is None or g.gpus + pod.gpus <= g.gpu_limit]
    if not with_room:
        g = fitting[0]
        needs = "" if g.gpus >= (g.gpu_limit or 0) else f"; it needs {pod.gpus}"
        return HomeVerdict(False, f"home NodePool {g.name} at its limit ({g.gpus} of {g.gpu_limit} GPUs{needs})")
    if problems:
        return HomeVerdict(False, problems[0])
    since = pod.unschedulable_since or now
    waited = (now - since).total_seconds()
    if waited < grace_seconds:
        return HomeVerdict(True, f"waiting for Karpenter to launch a node in home NodePool {with_room[0].name} "
                                 f"({waited:.0f}s of {grace_seconds:.0f}s)")
    return HomeVerdict(False, f"Karpenter launched no node for it within {grace_seconds:.0f}s "
                              f"(no instance type of home NodePool {with_room[0].name} fits it)")


@dataclass
class HomePlan:
    # pod -> why home capacity is serving it (not burst) / why it cannot (burst).
    at_home: dict[str, str] = field(default_factory=dict)
    burst: dict[str, str] = field(default_factory=dict)
    # The managed groups to grow, and for which pods.
    scale: list[HomeScale] = field(default_factory=list)


@dataclass
class _Growing:
    """A managed group as the plan fills it: its size so far, the free GPUs of each node it is launching and of
    each node the plan adds."""

    group: HomeNodeGroup
    launching: list[int]
    # Its launching nodes were asked for by this provisioning (timed from then), not by someone else.
    ours: bool
    stale: str
    grown: list[int] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # the pods on the nodes the plan adds

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def size(self) -> int:
        """The group's size once the nodes the plan adds are there."""
        assert self.group.scaling is not None
        return self.group.scaling.desired_size + len(self.grown)


def _take(free: list[int], pod: PendingPod) -> bool:
    """First fit: the pod onto the first node with room for it."""
    for i, room in enumerate(free):
        if room >= pod.gpus:
            free[i] -= pod.gpus
            return True
    return False


def _growing(g: HomeNodeGroup, now: datetime, register_seconds: float, scaled: Mapping[str, datetime]) -> _Growing:
    assert g.scaling is not None
    launching = max(0, g.scaling.desired_size - len(g.nodes))
    since = scaled.get(g.name)
    stale = ""
    if launching and since is not None and (now - since).total_seconds() > register_seconds:
        stale = (f"home node group {g.name}: {launching} node(s) not registered {register_seconds:.0f}s after it "
                 f"was scaled to {g.scaling.desired_size}")
    return _Growing(group=g, launching=[] if stale else [g.gpus_per_node] * launching, ours=since is not None,
                    stale=stale)


def _usd_per_gpu_hour(g: HomeNodeGroup) -> float:
    prices = [n.usd_per_hour / n.gpus for n in g.nodes if n.usd_per_hour and n.gpus]
    return min(prices) if prices else math.inf


def plan_home(pods: list[PendingPod], groups: list[HomeNodeGroup], now: datetime, *, grace_seconds: float,
              register_seconds: float, scaled: Mapping[str, datetime]) -> HomePlan:
    """Which waiting pods home capacity serves, which it cannot (each with why), and the managed groups to grow.
    ``scaled``: group -> when this provisioning last grew it."""
    plan = HomePlan()
    if not any(g.scaling for g in groups):  # Karpenter NodePools: each pod on its own
        for pod in pods:
            verdict = home_verdict(pod, groups, now, grace_seconds=grace_seconds, register_seconds=register_seconds)
            (plan.at_home if verdict.at_home else plan.burst)[pod.key] = verdict.why
        return plan
    managed = [_growing(g, now, register_seconds, scaled)
               for g in sorted((g for g in groups if g.scaling), key=lambda g: (_usd_per_gpu_hour(g), g.name))]
    for pod in sorted(pods, key=lambda p: (-p.gpus, p.key)):
        matching = [m for m in managed if fits_group(pod, m.group)]
        fitting = [m for m in matching if m.group.gpus_per_node >= pod.gpus]
        if not fitting:
            plan.burst[pod.key] = (f"home node group {matching[0].name}'s nodes have {matching[0].group.gpus_per_node}"
                                   f" GPU(s); it needs {pod.gpus}" if matching else "no home node group fits it")
            continue
        waited = (now - (pod.unschedulable_since or now)).total_seconds()
        verdict = (_launching_for(pod, fitting, waited, grace_seconds + register_seconds)
                   or _grown_for(pod, fitting, waited, grace_seconds))
        (plan.at_home if verdict.at_home else plan.burst)[pod.key] = verdict.why
    for m in managed:
        if m.added:
            assert m.group.scaling is not None
            h = HomeScale(group=m.name, from_size=m.group.scaling.desired_size, to_size=m.size,
                          pods=sorted(m.added))
            plan.scale.append(h)
            for pod_key in h.pods:
                plan.at_home[pod_key] = f"home node group {h.group} scaling from {h.from_size} to {h.to_size} nodes"
    return plan


def _launching_for(pod: PendingPod, fitting: list[_Growing], waited: float, longest: float) -> HomeVerdict | None:
    """At home when a node a group is launching has room for the pod. Nodes launching for someone else (a user,
    an autoscaler) hold the pod back only while it has waited less than ``longest`` (grace + register)."""
    for m in fitting:
        if (m.ours or waited <= longest) and _take(m.launching, pod):
            assert m.group.scaling is not None
            desired, registered = m.group.scaling.desired_size, len(m.group.nodes)
            return HomeVerdict(True, f"home node group {m.name} is launching {desired - registered} node(s) "
                                     f"({registered} of {desired} registered)")
    return None


def _grown_for(pod: PendingPod, fitting: list[_Growing], waited: float, grace_seconds: float) -> HomeVerdict:
    """At home on a node the plan adds to a group (or, for a group an autoscaler owns, while the pod is within
    the grace); else burst, with why no group can grow for it."""
    reasons: list[str] = []
    for m in fitting:
        s = m.group.scaling
        assert s is not None
        if m.stale:
            reasons.append(m.stale)
            continue
        if not s.autoscaler and _take(m.grown, pod):
            m.added.append(pod.key)
            return HomeVerdict(True, "")  # the why names the group's final size, known once every pod is planned
        if m.group.frozen_by:
            # A packing round is emptying nodes of the group: growing it would undo the round, and the pods it
            # evicts are re-placed on the nodes it keeps. Bounded like any wait for home capacity.
            if waited < grace_seconds:
                return HomeVerdict(True, f"home node group {m.name} is being packed by operation "
                                         f"{m.group.frozen_by} ({waited:.0f}s of {grace_seconds:.0f}s)")
            reasons.append(f"home node group {m.name} is being packed by operation {m.group.frozen_by}")
            continue
        to = s.landed(m.size + 1)
        if to > s.max_size:
            reasons.append(f"home node group {m.name} at its maxSize ({m.size} of {s.max_size} nodes)")
            continue
        if s.autoscaler:
            if waited < grace_seconds:
                return HomeVerdict(True, f"waiting for {s.autoscaler} to grow home node group {m.name} "
                                         f"({waited:.0f}s of {grace_seconds:.0f}s)")
            reasons.append(f"{s.autoscaler} added no node to home node group {m.name} for it within "
                           f"{grace_seconds:.0f}s")
            continue
        m.grown += [m.group.gpus_per_node] * (to - m.size)
        _take(m.grown, pod)
        m.added.append(pod.key)
        return HomeVerdict(True, "")
    return HomeVerdict(False, reasons[0])
