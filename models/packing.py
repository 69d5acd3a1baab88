"""GPU packing (``kind: Packing``): the facts the packing planner decides on and the plan it makes."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from models.base import Model
from models.provisioning import PendingPod


class PackPod(Model):
    """A pod bound to a GPU node, as packing sees it. ``pod`` carries what placement needs (GPUs, nodeSelector,
    required node affinity, tolerated taint keys)."""

    pod: PendingPod
    node: str
    # The kind of its controller (ReplicaSet, StatefulSet, Job, DaemonSet, ...); "" for a bare pod.
    owner_kind: str = ""
    # Its karpenter.sh/do-not-disrupt annotation ("true" or a duration such as "2h"), if any.
    do_not_disrupt: str | None = None
    started_at: datetime | None = None
    # The PodDisruptionBudgets whose selector covers it.
    pdbs: list[str] = Field(default_factory=list)


class PackNode(Model):
    name: str
    group: str = ""
    gpus: int = 0
    gpu_product: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    # Keys of its NoSchedule/NoExecute taints.
    taints: list[str] = Field(default_factory=list)
    usd_per_hour: float = 0.0
    ready: bool = True
    cordoned: bool = False
    # karpenter.sh/do-not-disrupt: "true" on the node itself.
    do_not_disrupt: bool = False


class PackMove(Model):
    pod: str
    source: str
    # The kept node it is expected to land on (the scheduler decides; the plan shows one that has room).
    target: str
    gpus: int
    # A PDB covering it allows no disruption now: its eviction will wait (429) until it does.
    waits_for_pdb: str = ""


class PackPlan(Model):
    empty: list[str] = Field(default_factory=list)
    moves: list[PackMove] = Field(default_factory=list)
    usd_per_hour_saved: float = 0.0
    # node -> why it cannot be emptied (a bare pod, do-not-disrupt, two PDBs, not ready, ...).
    kept: dict[str, str] = Field(default_factory=dict)
    exact: bool = True
    message: str = ""

    def summary(self) -> str:
        if not self.empty:
            return self.message or "no GPU node can be emptied"
        return (f"empty {len(self.empty)} node(s) ({', '.join(self.empty)}), moving {len(self.moves)} pod(s): "
                f"saves ${self.usd_per_hour_saved:.2f}/h")
