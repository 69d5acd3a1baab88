"""Burst defers to home capacity (``capacity.provider: karpenter``): for each waiting pod, whether the home
autoscaler is serving it (then it is not burst) or cannot (then it is, and the plan says why).

A pod is served at home when a home GPU group it fits (the group's taints tolerated, its requirements not
contradicting the pod's nodeSelector, e.g. the GPU product) has a NodeClaim launching (not failed, not
unregistered past ``register_seconds``), or has GPU room under its limit and the pod has waited less than
``grace_seconds`` (Karpenter batches pending pods for
a few seconds before it creates one). It is burst when no home group fits, when every group it fits is at its GPU
limit, when the group's NodeClaims failed to launch or stayed unregistered past ``register_seconds``, or when
Karpenter launched nothing for it within the grace (no instance type of the group fits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from models.capacity import HomeNodeGroup
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
