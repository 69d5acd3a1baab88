"""Inputs, outputs and state of burst and drain operations. One model per workflow/activity argument, so fields
can be added without breaking histories (new fields need defaults)."""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from models.policy import Mode

BURST_TAINT_EFFECT: Final = "NoSchedule"
LABEL_LOCATION: Final = "gpu.kubeon.io/location"
LABEL_POLICY: Final = "gpu.kubeon.io/policy"
LABEL_OPERATION: Final = "gpu.kubeon.io/operation"
LABEL_GPU_PRODUCT: Final = "nvidia.com/gpu.product"
LABEL_INSTANCE_TYPE: Final = "node.kubernetes.io/instance-type"
# Long-held activities (serving) poll their own task queue: <task queue> + this suffix.
SERVE_QUEUE_SUFFIX: Final = "-serve"
TAG_BURST: Final = "kubeon.io/burst"
TAG_OPERATION: Final = "kubeon.io/operation"
GPU_RESOURCE: Final = "nvidia.com/gpu"


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class Phase(StrEnum):
    PLANNING = "Planning"
    PROPOSED = "Proposed"  # Recommend mode: the plan is the result
    AWAITING_APPROVAL = "AwaitingApproval"
    WAITING_FOR_CAPACITY = "WaitingForCapacity"  # maxNodes reached by other operations of the policy
    HELD = "Held"  # the hub rejected this cluster's token (R2.3): no action until a valid one is mounted
    LAUNCHING = "Launching"
    JOINING = "Joining"
    VERIFYING = "Verifying"
    SERVING = "Serving"
    DRAINING = "Draining"
    COMPLETED = "Completed"
    REJECTED = "Rejected"
    EXPIRED = "Expired"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


TERMINAL_PHASES: Final = frozenset(
    {Phase.PROPOSED, Phase.COMPLETED, Phase.REJECTED, Phase.EXPIRED, Phase.FAILED, Phase.CANCELLED}
)


class Taint(Model):
    key: str
    value: str = "true"
    effect: str = BURST_TAINT_EFFECT


class PendingPod(Model):
    namespace: str
    name: str
    uid: str = ""
    gpus: int = Field(ge=0, default=1)
    # nodeSelector entries the burst node must carry for this pod to land there (e.g. the GPU product).
    node_selector: dict[str, str] = Field(default_factory=dict)


class WorkloadGroup(Model):
    """Pending pods of one owner (a Deployment, Job, StatefulSet, or a bare pod)."""

    namespace: str
    owner_kind: str
    owner_name: str
    pods: list[PendingPod] = Field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.owner_kind}/{self.owner_name}"

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pods)

    @property
    def max_pod_gpus(self) -> int:
        return max((p.gpus for p in self.pods), default=0)

    @property
    def node_selector(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for p in self.pods:
            merged.update(p.node_selector)
        return merged


def burst_workflow_id(cluster: str, policy: str, group_key: str) -> str:
    """Derived from cluster, policy and group only, so every watcher and every restart names the same workflow."""
    digest = hashlib.sha256(group_key.encode()).hexdigest()[:12]
    return f"burst/{cluster}/{policy}/{digest}"


def operation_id(workflow_id: str, run_id: str) -> str:
    """Short, label-safe name of one run of an operation: tags, labels, tickets and audit records carry it."""
    return "op-" + hashlib.sha256(f"{workflow_id}/{run_id}".encode()).hexdigest()[:12]


class OperationSettings(Model):
    approval_timeout_seconds: int = 3600
    join_timeout_seconds: int = 900
    verify_timeout_seconds: int = 300
    serve_check_seconds: int = 30
    capacity_wait_seconds: int = 3600
    drain_timeout_seconds: int = 3600


class BurstInput(Model):
    cluster: str
    policy: str
    group: WorkloadGroup
    default_mode: Mode = "Recommend"
    settings: OperationSettings = Field(default_factory=OperationSettings)


class Offering(Model):
    """One instance type in one location, priced per GPU-hour with data transfer back home included (R4.9)."""

    location: str
    instance_type: str
    gpus: int
    gpu_product: str
    instance_usd_per_hour: float
    transfer_usd_per_gpu_hour: float

    @property
    def compute_usd_per_gpu_hour(self) -> float:
        return self.instance_usd_per_hour / self.gpus

    @property
    def usd_per_gpu_hour(self) -> float:
        return round(self.compute_usd_per_gpu_hour + self.transfer_usd_per_gpu_hour, 4)


class PlanRequest(Model):
    policy: str
    locations: list[str]
    max_gpu_hour: float
    group: WorkloadGroup


class Plan(Model):
    plan_id: str
    policy: str
    gpus_needed: int
    # Eligible offerings, cheapest first (per GPU-hour including transfer). Launch tries them in order.
    candidates: list[Offering]
    # Offerings seen but refused, with why (over maxGpuHour, wrong GPU, too small); shown with the proposal.
    refused: list[str] = Field(default_factory=list)

    @property
    def best(self) -> Offering | None:
        return self.candidates[0] if self.candidates else None

    def summary(self) -> str:
        best = self.best
        if best is None:
            return f"no eligible location for {self.gpus_needed} GPU(s)"
        return (
            f"{best.instance_type} ({best.gpus}x {best.gpu_product}) in {best.location} at "
            f"${best.usd_per_gpu_hour:.2f}/GPU-h (compute ${best.compute_usd_per_gpu_hour:.2f} + est. transfer "
            f"${best.transfer_usd_per_gpu_hour:.2f})"
        )


class PolicySnapshot(Model):
    name: str
    generation: int = 0
    mode: Mode
    tolerate: str
    locations: list[str]
    max_nodes: int
    max_gpu_hour: float
    return_home: bool


class LoadPolicyRequest(Model):
    policy: str
    default_mode: Mode


class Approval(Model):
    approver: str = "temporal-ui"
    # When set, the approval is for this plan only: a stale approval of an older plan is refused.
    plan_id: str | None = None
    reason: str = ""


class Rejection(Model):
    approver: str = "temporal-ui"
    reason: str = ""


class DecisionResult(Model):
    operation: str
    phase: Phase
    message: str


class ReservationRequest(Model):
    operation: str
    nodes: int = 1
    max_nodes: int
    # The workflow the ledger signals (`capacity_granted`) once the nodes are reserved for it.
    reply_to: str = ""


class ReservationResult(Model):
    granted: bool
    in_use: int
    max_nodes: int
    holders: list[str] = Field(default_factory=list)
    operation: str = ""
    waiting: list[str] = Field(default_factory=list)


class ReleaseRequest(Model):
    operation: str


class LaunchRequest(Model):
    operation: str
    cluster: str
    policy: str
    allowed_locations: list[str]
    offering: Offering
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]


class Instance(Model):
    provider: str
    location: str
    instance_id: str
    instance_type: str = ""
    state: str = ""
    tags: dict[str, str] = Field(default_factory=dict)
    node_name: str = ""
    launched_at: datetime | None = None


class InstanceRef(Model):
    location: str
    instance_id: str
    policy: str


class NodeWaitRequest(Model):
    operation: str
    node_name: str
    timeout_seconds: int


class NodeExpectation(Model):
    node_name: str
    taint_key: str
    labels: dict[str, str]
    pods: list[PendingPod]
    timeout_seconds: int
    group: WorkloadGroup | None = None


class VerifyResult(Model):
    node_name: str
    pods_on_node: list[str]


class ServeCheckRequest(Model):
    group: WorkloadGroup
    node_name: str
    return_home: bool
    check_seconds: float = 30
    # An empty node is idle only when no pod tolerating this taint waits that it could take (not just the
    # group's: burst nodes are shared). Empty in older histories: the group's pods alone.
    taint_key: str = ""


class PlacementRequest(Model):
    group: WorkloadGroup
    operation: str


class GroupPlacement(Model):
    """Where the group's pods are: still waiting, or placed on another operation's burst node (they took the
    node that operation launched for its own pods, which now wait: this operation launches for them)."""

    pending: int
    displaced: int = 0


class ServeCheckResult(Model):
    done: bool
    reason: str = ""
    pods_on_node: int = 0


class DrainInput(Model):
    cluster: str
    policy: str
    operation: str
    node_name: str
    instance: InstanceRef | None = None
    reason: str = ""
    settings: OperationSettings = Field(default_factory=OperationSettings)


class EvictionResult(Model):
    remaining: list[str]
    blocked: dict[str, str] = Field(default_factory=dict)  # pod -> "blocked by PDB <name>"


class NodeRef(Model):
    node_name: str


class DrainResult(Model):
    node_name: str
    evicted: int
    instance_terminated: bool
    node_removed: bool


class OperationView(Model):
    """What `ops show` and the workflow query return."""

    operation: str
    workflow_id: str
    cluster: str
    policy: str
    group: str
    mode: Mode | None = None
    phase: Phase
    plan: Plan | None = None
    location: str | None = None
    instance: Instance | None = None
    node_name: str | None = None
    approver: str | None = None
    message: str = ""
    history: list[str] = Field(default_factory=list)


class BurstResult(Model):
    operation: str
    phase: Phase
    message: str
    plan: Plan | None = None
    instance: Instance | None = None
    node_name: str | None = None


class AuditRecord(Model):
    """Append-only record of what happened to a burst node (R4.7)."""

    key: str  # idempotency: a retried activity writes the same record once
    at: datetime
    cluster: str
    policy: str
    operation: str
    action: str  # proposed, approved, launched, joined, verified, drained, removed, failed, ...
    location: str | None = None
    instance_id: str | None = None
    node_name: str | None = None
    approver: str | None = None
    detail: str = ""


class LedgerInput(Model):
    cluster: str
    policy: str
    # Carried over continue-as-new.
    reservations: dict[str, int] = Field(default_factory=dict)
    waiting: list[ReservationRequest] = Field(default_factory=list)
    max_nodes: int = 0
    # Histories stay short: after this many requests and releases the ledger continues as new.
    continue_after_signals: int = 1000


class LedgerReserve(Model):
    cluster: str
    policy: str
    request: ReservationRequest


class CleanupRequest(Model):
    """Compensation: everything an operation may have made, found by its tag, not by what the workflow saw."""

    operation: str
    policy: str
    locations: list[str]
    node_name: str


class CleanupResult(Model):
    terminated: list[str] = Field(default_factory=list)
    node_removed: bool = False


class NodeRemoval(Model):
    node_name: str
    operation: str


class GoneCheck(Model):
    node_name: str
    instance: InstanceRef | None = None


def ledger_workflow_id(cluster: str, policy: str) -> str:
    return f"ledger/{cluster}/{policy}"


class DrainStatus(Model):
    status: str
    blocked: dict[str, str] = Field(default_factory=dict)
    cordoned: bool = False
    evicted: list[str] = Field(default_factory=list)  # namespace/name, in eviction order
    pdb_waits: dict[str, int] = Field(default_factory=dict)  # pod -> eviction rounds a PDB refused it
    terminated: str | None = None  # the instance ID, once terminated
    node_removed: bool = False
