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
    IDLE = "Idle"  # a policy's provisioning: no pod waits, no proposal open
    PROPOSED = "Proposed"  # Recommend mode: the plan is the result
    AWAITING_APPROVAL = "AwaitingApproval"
    WAITING_FOR_CAPACITY = "WaitingForCapacity"  # maxNodes reached, or the gateway's address slots all held
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


class NodeRequirement(Model):
    """One match expression of a pod's required node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``,
    ``Gt``, ``Lt``), judged against the labels a burst node would carry."""

    key: str
    operator: str
    values: list[str] = Field(default_factory=list)


class PendingPod(Model):
    namespace: str
    name: str
    uid: str = ""
    gpus: int = Field(ge=0, default=1)
    # nodeSelector entries the burst node must carry for this pod to land there (e.g. the GPU product).
    node_selector: dict[str, str] = Field(default_factory=dict)
    # Required node affinity: the node must match one of these terms (each a list of requirements, all of which
    # hold). Empty: no affinity.
    affinity_terms: list[list[NodeRequirement]] = Field(default_factory=list)
    # Keys of NoSchedule taints the pod tolerates; "*" tolerates every key.
    tolerations: list[str] = Field(default_factory=list)
    unschedulable_since: datetime | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def tolerates(self, taint_key: str) -> bool:
        return "*" in self.tolerations or taint_key in self.tolerations


def provision_workflow_id(cluster: str, policy: str) -> str:
    """The one provisioning workflow of a policy: every watcher replica and every restart names the same one."""
    return f"provision/{cluster}/{policy}"


def node_workflow_id(cluster: str, policy: str, batch: str, index: int) -> str:
    """The workflow of the ``index``-th new node of a batch: derived, so a replayed or retried start names it."""
    return f"burst/{cluster}/{policy}/{batch}-{index}"


def operation_id(workflow_id: str, run_id: str) -> str:
    """Short, label-safe name of one run of an operation: tags, labels, tickets and audit records carry it."""
    return "op-" + hashlib.sha256(f"{workflow_id}/{run_id}".encode()).hexdigest()[:12]


class OperationSettings(Model):
    approval_timeout_seconds: int = 3600
    join_timeout_seconds: int = 900
    verify_timeout_seconds: int = 300
    serve_check_seconds: int = 30
    drain_timeout_seconds: int = 3600
    # Batching: a policy's waiting pods are planned together once no new one arrived for the idle window (0: at
    # once; pods arriving meanwhile go into the next plan), and at the latest this long after the first arrived.
    batch_idle_seconds: float = 0.0
    # Under load (pods arrived while the last plan was being made), a trickle of pods would otherwise be planned a
    # few at a time, each few on small nodes: the next plan then gathers until none came for this long, at most
    # batch_load_max_seconds (a trickle never pauses; the benchmark chose 4 s: see bench/README.md).
    batch_load_idle_seconds: float = 1.0
    batch_load_max_seconds: float = 4.0
    batch_max_seconds: float = 10.0
    # A proposal is read by a person: it gathers a rollout's pods for at least this long before it is made.
    proposal_idle_seconds: float = 2.0
    # Automatic, where the waiting pods could take every node maxNodes leaves: a rollout's stragglers are gathered
    # this long first, or the nodes planned for the first of its pods would leave none for the rest.
    limit_idle_seconds: float = 1.0
    # Pods of a rejected, expired or recommended batch are planned again only after this long (if still waiting);
    # pods whose node failed after a back-off from retry_seconds, doubling, up to this.
    recheck_seconds: float = 600.0
    retry_seconds: float = 30.0
    # While pods wait that no plan could serve (maxNodes, no offering), they are planned again this often.
    replan_seconds: float = 30.0


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

    @property
    def transfer_usd_per_hour(self) -> float:
        return self.transfer_usd_per_gpu_hour * self.gpus

    @property
    def usd_per_hour(self) -> float:
        """What the node costs per hour: the instance and the estimated transfer of all its GPUs."""
        return round(self.instance_usd_per_hour + self.transfer_usd_per_hour, 6)

    def describe(self) -> str:
        return (f"{self.instance_type} ({self.gpus}x {self.gpu_product}) in {self.location} at "
                f"${self.usd_per_hour:.2f}/h (compute ${self.instance_usd_per_hour:.2f} + est. transfer "
                f"${self.transfer_usd_per_hour:.2f})")


class NodeRecord(Model):
    """A burst node of the policy that is launching, joining, verifying or serving (the provisioning state)."""

    workflow_id: str
    node_name: str
    batch: str
    offering: Offering
    pods: list[str] = Field(default_factory=list)  # the pods (namespace/name) it was launched for


class PlannedNode(Model):
    offering: Offering
    # Other offerings its pods fit, dearer first-choice last: tried in order when a location has no capacity.
    alternatives: list[Offering] = Field(default_factory=list)
    pods: list[str] = Field(default_factory=list)
    gpus_used: int = 0


class Unplaced(Model):
    pod: str
    why: str
    # It fits an offering but waits for a burst node to free up (maxNodes, the gateway's address slots).
    waits_for_capacity: bool = False


class BatchPlan(Model):
    """One plan for a policy's waiting pods: onto nodes already there, then the cheapest new nodes."""

    plan_id: str
    batch: str
    policy: str
    new_nodes: list[PlannedNode] = Field(default_factory=list)
    # pod -> the burst node (launching, joining or serving) with room that it is expected on.
    on_existing: dict[str, str] = Field(default_factory=dict)
    unplaced: list[Unplaced] = Field(default_factory=list)
    # uids of the pods asked about that no longer wait (bound, deleted).
    gone: list[str] = Field(default_factory=list)
    # Offerings seen but refused, with why (outside the policy, over maxGpuHour, location unavailable).
    refused: list[str] = Field(default_factory=list)
    planned_at: datetime | None = None

    @property
    def total_usd_per_hour(self) -> float:
        return round(sum(n.offering.usd_per_hour for n in self.new_nodes), 4)

    def summary(self) -> str:
        if not self.new_nodes:
            parts = [f"no new node: {len(self.on_existing)} pod(s) on nodes already there"]
        else:
            counts: dict[str, int] = {}
            for n in self.new_nodes:
                what = f"{n.offering.instance_type} in {n.offering.location}"
                counts[what] = counts.get(what, 0) + 1
            parts = [f"{len(self.new_nodes)} node(s) for {sum(len(n.pods) for n in self.new_nodes)} pod(s): "
                     + ", ".join(f"{c}x {w}" for w, c in counts.items())
                     + f", total ${self.total_usd_per_hour:.2f}/h"]
            if self.on_existing:
                parts.append(f"{len(self.on_existing)} pod(s) on nodes already there")
        if self.unplaced:
            parts.append(f"{len(self.unplaced)} pod(s) not placed ({self.unplaced[0].why})")
        return "; ".join(parts)

    def lines(self) -> list[str]:
        """The plan in full, as the proposal shows it."""
        out = [f"plan {self.plan_id} (batch {self.batch}): total ${self.total_usd_per_hour:.2f}/h"]
        for i, n in enumerate(self.new_nodes):
            out.append(f"- node {i}: {n.offering.describe()}; pods: {', '.join(n.pods)}")
        out += [f"- {pod} on {node} (already there)" for pod, node in sorted(self.on_existing.items())]
        out += [f"- not placed: {u.pod}: {u.why}" for u in self.unplaced]
        return out


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
    # When set, the approval is for this batch only (the operation ID the proposal was reported under).
    operation: str | None = None


class Rejection(Model):
    approver: str = "temporal-ui"
    reason: str = ""
    operation: str | None = None


class DecisionResult(Model):
    operation: str
    phase: Phase
    message: str


class PodsWaiting(Model):
    """The watcher's signal to a policy's provisioning: these pods wait for a node (sent again on resync)."""

    pods: list[PendingPod]


class PodsGone(Model):
    """The watcher's signal: these pods (uids) no longer wait (bound, deleted)."""

    uids: list[str]


class NodeFinished(Model):
    """A node workflow's signal to its provisioning: the node is gone home, failed or was cancelled."""

    workflow_id: str
    phase: Phase
    message: str = ""
    launched: bool = False
    pods: list[str] = Field(default_factory=list)


class BatchRecord(Model):
    """One batch as `ops show` lists it: its plan, what became of it, and the node workflows it started."""

    batch: str
    phase: Phase
    plan: BatchPlan
    message: str = ""
    approver: str | None = None
    nodes: list[str] = Field(default_factory=list)  # node workflow IDs


class ProvisionInput(Model):
    cluster: str
    policy: str
    default_mode: Mode = "Recommend"
    settings: OperationSettings = Field(default_factory=OperationSettings)
    # Carried over continue-as-new.
    chain: str = ""
    seq: int = 0
    waiting: list[PendingPod] = Field(default_factory=list)
    nodes: list[NodeRecord] = Field(default_factory=list)
    # uid -> ISO time before which the pod is not planned again (declined, or its node failed).
    not_before: dict[str, str] = Field(default_factory=dict)
    failures: dict[str, int] = Field(default_factory=dict)
    batches: list[BatchRecord] = Field(default_factory=list)
    # History stays short: the workflow continues as new after this many events.
    continue_after_events: int = 4000


class BatchPlanRequest(Model):
    policy: PolicySnapshot
    batch: str
    pods: list[PendingPod]
    nodes: list[NodeRecord]
    max_new_nodes: int


class NodeInput(Model):
    """One new burst node of a batch: launch -> join -> verify -> serve -> return home."""

    cluster: str
    policy: str
    batch: str
    provision_workflow_id: str
    node: PlannedNode
    default_mode: Mode = "Recommend"
    settings: OperationSettings = Field(default_factory=OperationSettings)


class ProvisionView(Model):
    """What `ops show` and the provisioning workflow's query return."""

    workflow_id: str
    cluster: str
    policy: str
    mode: Mode | None = None
    phase: Phase
    message: str = ""
    proposal: BatchRecord | None = None
    waiting: list[str] = Field(default_factory=list)  # pods waiting, with why where known
    nodes: list[NodeRecord] = Field(default_factory=list)
    max_nodes: int = 0
    batches: list[BatchRecord] = Field(default_factory=list)
    history: list[str] = Field(default_factory=list)


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


class VerifyResult(Model):
    node_name: str
    pods_on_node: list[str]


class ServeCheckRequest(Model):
    node_name: str
    return_home: bool
    check_seconds: float = 30
    # An empty node is idle only when no waiting pod tolerating this taint could take it (burst nodes are shared).
    taint_key: str = ""
    # What home nodes must carry to take the node's pods back (returnHome).
    node_selector: dict[str, str] = Field(default_factory=dict)


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
    """What `ops show` and a node workflow's query return."""

    operation: str
    workflow_id: str
    cluster: str
    policy: str
    batch: str = ""
    phase: Phase
    node: PlannedNode | None = None
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
    node: PlannedNode | None = None
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


class DrainStatus(Model):
    status: str
    blocked: dict[str, str] = Field(default_factory=dict)
    cordoned: bool = False
    evicted: list[str] = Field(default_factory=list)  # namespace/name, in eviction order
    pdb_waits: dict[str, int] = Field(default_factory=dict)  # pod -> eviction rounds a PDB refused it
    terminated: str | None = None  # the instance ID, once terminated
    node_removed: bool = False
