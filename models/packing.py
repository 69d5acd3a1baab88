"""GPU packing (``kind: Packing``): the facts the packing planner decides on and the plan it makes."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from models.base import Model
from models.base import OperationViewBase
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
    labels: dict[str, str] = Field(default_factory=dict)
    annotation_keys: list[str] = Field(default_factory=list)


class PackScope(Model):
    """What a Packing policy lets a round touch: nodes with ``node_labels``; pods of ``namespaces`` (all when
    empty) with ``pod_labels`` (a node holding another pod is kept); pods younger than ``min_pod_age_seconds`` or
    carrying one of ``protect_annotations`` hold their node."""

    node_labels: dict[str, str] = Field(default_factory=dict)
    namespaces: list[str] = Field(default_factory=list)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    min_pod_age_seconds: float = 0.0
    protect_annotations: list[str] = Field(default_factory=list)


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
    # node emptied -> its group (NodePool)
    group_of: dict[str, str] = Field(default_factory=dict)
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


class PackSettings(Model):
    approval_timeout_seconds: float = 3600.0
    # An eviction refused by a PDB (429) is tried again this often, for at most pdb_wait_seconds.
    pdb_retry_seconds: float = 5.0
    pdb_wait_seconds: float = 1800.0
    # How long a moved pod's replacement may take to be Ready on a kept node; past it the round stops.
    replacement_timeout_seconds: float = 300.0
    # How long the removed node's NodeClaim and Node may take to be gone.
    removal_timeout_seconds: float = 600.0
    poll_seconds: float = 2.0


class PackInput(Model):
    cluster: str
    policy: str
    groups: list[str]
    mode: str = "Recommend"
    max_nodes: int = Field(default=1, ge=1)
    min_savings_usd_per_hour: float = 0.0
    settings: PackSettings = Field(default_factory=PackSettings)
    scope: PackScope = Field(default_factory=PackScope)


class PackPlanRequest(Model):
    groups: list[str]
    max_nodes: int = 1
    min_savings_usd_per_hour: float = 0.0
    scope: PackScope = Field(default_factory=PackScope)


class GroupRef(Model):
    group: str
    operation: str


class NodeRef2(Model):
    node: str
    group: str = ""


class PodRef(Model):
    namespace: str
    name: str
    # As the node's pods were listed (before any of them was evicted): the pod's controller and how many of its
    # pods were Ready. What a retried eviction of a pod already evicted (terminating or gone) waits for; empty in
    # histories from before it was recorded.
    owner_uid: str = ""
    ready_before: int = 0

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class EvictOutcome(Model):
    # evicted | gone | blocked (429: a PDB allows no disruption now)
    outcome: str
    pdb: str = ""
    # The controller whose replacement is waited for, and how many of its pods were Ready before the eviction.
    owner_uid: str = ""
    ready_before: int = 0


class ReplacementCheck(Model):
    pod: PodRef
    owner_uid: str
    node: str
    ready_before: int = 0


class ReplacementState(Model):
    ready: bool
    # Why not yet (the replacement Pending, the old pod still terminating).
    detail: str = ""


class PackView(OperationViewBase):
    # The run's operation ID: its audit records and hub reports name it, and an approval's plan_id is it. Empty in
    # the results of rounds run before it was kept.
    operation: str = ""
    phase: str
    plan: PackPlan | None = None
    removed: list[str] = Field(default_factory=list)
    moved: list[str] = Field(default_factory=list)


def packing_workflow_id(cluster: str, policy: str) -> str:
    """One packing round per policy at a time."""
    return f"packing/{cluster}/{policy}"
